"""Every byte of one RL step of a run, itemised from its RunConfig (the figures come from review/bytes.py).

`step_bytes(run_cfg)` is what `review/record.py` (and so `launchers/review.py`) predicts a step from;
`model_config(run_cfg)` is the ModelConfig a run would build, without building it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.models.hf_io import read_config
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.review import bytes as bytes_lib
from jaxrl_topo.topology.rules import ROLLOUT_RULES, TRAIN_RULES

if TYPE_CHECKING:
  from jaxrl_topo.runtime.config import RunConfig


def per_hour(bytes_per_step: float, steps_per_hour: float) -> float:
  if not steps_per_hour > 0:
    raise ValueError(f"steps_per_hour={steps_per_hour!r} must be > 0")
  return bytes_per_step * steps_per_hour


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBytes:
  """Every figure of one RL step, in bytes, itemised; `to_dict()` is the JSON record."""

  model: str  # preset name or HF directory
  n_params: int
  mode: str  # colocated | disaggregated | async
  trainer_axes: dict[str, int]
  rollout_axes: dict[str, int]
  sync_dtype: str  # the rollout copy's dtype (the model's compute dtype)
  changed_frac: float
  sync_mode: str  # the run's sync.mode: which of the three figures below the loop sends each step (`sync_per_step`)
  sync_full: int  # TransferPlan, mode full: every weight not aliased
  sync_full_per_rollout_device: int
  sync_aliased_params: int  # colocated zero-copy leaves
  sync_delta: int  # changed_frac x sync_full
  sync_lora: int | None  # adapters in fp32, if LoRA is on
  sync_lora_moved: int | None = None  # what a lora sync writes (colocated: 0, aliased); None: sync_lora
  trainer_param_bytes_per_device: int  # the policy's own weights, param dtype, TRAIN_RULES
  rollout_param_bytes_per_device: int  # sync dtype, ROLLOUT_RULES
  payload: dict[str, int]
  policy_collectives: dict[str, int]  # per trainer rank
  reference_collectives: int
  critic_collectives: dict[str, int]
  steps_per_hour: float | None = None

  @property
  def sync_per_step(self) -> int:
    """What the loop sends each step under the run's sync.mode (delta: at the assumed changed_frac)."""
    if self.sync_mode == "lora":
      if self.sync_lora is None:
        raise ValueError("sync.mode='lora' needs lora.rank > 0")
      return self.sync_lora if self.sync_lora_moved is None else self.sync_lora_moved
    return self.sync_delta if self.sync_mode == "delta" else self.sync_full

  def totals(self) -> dict[str, int]:
    return {"sync": self.sync_per_step, "payload": self.payload["total"],
            "collectives_per_rank": (self.policy_collectives["total"] + self.reference_collectives
                                     + self.critic_collectives["total"])}

  def to_dict(self) -> dict[str, Any]:
    out = {**dataclasses.asdict(self), "totals": self.totals()}
    if self.steps_per_hour is not None:
      out["per_hour"] = {k: per_hour(v, self.steps_per_hour) for k, v in out["totals"].items()}
    return out


def model_config(run_cfg: RunConfig) -> tuple[ModelConfig, str]:
  """(ModelConfig, name) the run would build: the HF dir's config.json, or the preset with its overrides."""
  spec = run_cfg.model
  if spec.hf_dir is not None:
    return read_config(spec.hf_dir, dtype=spec.dtype), spec.hf_dir
  try:
    cfg = dataclasses.replace(get_preset(spec.preset), **spec.overrides)
  except TypeError as e:
    raise ValueError(f"model.overrides: {e}") from None
  return dataclasses.replace(cfg, dtype=spec.dtype), spec.preset


def step_bytes(run_cfg: RunConfig, *, changed_frac: float = 0.02, steps_per_hour: float | None = None) -> StepBytes:
  """Predicts every byte count of one step of `run_cfg` (see review/bytes.py's docstring for the model)."""
  b = bytes_lib
  model_cfg, name = model_config(run_cfg)
  topo, lora, lc, n_micro = run_cfg.topology, run_cfg.lora, run_cfg.rl, run_cfg.run.n_micro
  t_axes, r_axes = dict(topo.trainer_axes), dict(topo.rollout_axes)
  plan = b.sync_plan_bytes(model_cfg, topo)
  pdt = model_cfg.param_dtype
  return StepBytes(
      model=name, n_params=sum(leaf.size for leaf in b.param_leaves(model_cfg)), mode=topo.mode,
      trainer_axes=t_axes, rollout_axes=r_axes, sync_dtype=model_cfg.dtype, changed_frac=changed_frac,
      sync_mode=run_cfg.sync.mode,
      sync_full=plan["total"], sync_full_per_rollout_device=plan["per_rollout_device"],
      sync_aliased_params=plan["aliased_params"],
      sync_delta=round(b.check_frac(changed_frac) * plan["total"]),
      sync_lora=b.weight_sync_bytes(model_cfg, dtype="float32", mode="lora", lora_rank=lora.rank,
                                    lora_targets=lora.targets) if lora.enabled else None,
      sync_lora_moved=b.lora_sync_plan_bytes(model_cfg, topo, lora.rank, lora.targets) if lora.enabled else None,
      trainer_param_bytes_per_device=b.per_device_shard_bytes(model_cfg, t_axes, TRAIN_RULES, pdt),
      rollout_param_bytes_per_device=b.per_device_shard_bytes(model_cfg, r_axes, ROLLOUT_RULES, model_cfg.dtype),
      payload=b.rollout_payload_bytes(run_cfg.data.batch_size, lc.group_size, run_cfg.data.max_prompt_len,
                                      run_cfg.rollout.max_new_tokens),
      # rl.epochs passes run every microbatch's forward and backward again; with more than one update a step,
      # the old policy's log-probs are one more no-grad forward, counted with the reference's.
      policy_collectives=b.gradient_collective_bytes(model_cfg, t_axes, pdt, param_dtype=pdt,
                                                     n_micro=n_micro * lc.epochs, lora_rank=lora.rank or None,
                                                     lora_targets=lora.targets),
      reference_collectives=sum(b.reference_collective_bytes(model_cfg, t_axes, kl_coef=kl, param_dtype=pdt,
                                                             n_micro=n_micro)
                                for kl in (lc.kl_coef, float(lc.updates > 1))),
      critic_collectives=b.critic_collective_bytes(model_cfg, t_axes, lc.critic, param_dtype=pdt, grad_dtype=pdt,
                                                   n_micro=n_micro, epochs=lc.epochs),
      steps_per_hour=steps_per_hour)
