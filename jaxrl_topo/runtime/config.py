"""A run's settings as typed, frozen dataclasses: what the ml-collections config becomes at the boundary.

The ConfigDict of `configs/<name>.py` has one section per dataclass below (the *Spec ones in runtime/sections.py):

  model     ModelSpec          which weights (a preset shape, or a local HF directory)
  data      PromptDataConfig   prompts (data/pipeline.py); data.task holds a built-in task's knobs
  rollout   RolloutSpec        sampling, engine sizes, weight-update policy
  reward    RewardSpec         reward functions, worker pool, DAPO dynamic sampling and overlong shaping
  rl        LossConfig         the objective (train/config.py); rl.group_size is the rollout's too
  optim     OptimConfig        AdamW and its schedule
  lora      LoraConfig
  train     TrainSpec          packing, remat, where the log-prob pre-pass runs
  topology  TopologyConfig     the mode and each side's mesh axes (topology/carve.py)
  sync      SyncSpec           how the trainer's weights reach the rollout side (full | delta | lora, bucket size)
  env       EnvSpec            multi-turn episodes: the environment, its workers and turn limits
  run       RunSpec            steps, evaluation, checkpoints, staleness bound, logging

`from_config_dict` converts and validates every field before anything compiles: an unknown key is
rejected with the closest valid name, a wrong type names the field.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from jaxrl_topo.data.pipeline import PromptDataConfig
from jaxrl_topo.runtime.dataclass_io import build_dataclass, config_defaults, plain
from jaxrl_topo.runtime.sections import EnvSpec, ModelSpec, RewardSpec, RolloutSpec, RunSpec, SyncSpec, TrainSpec
from jaxrl_topo.topology.carve import DEFAULT_ROLES, TopologyConfig
from jaxrl_topo.train.config import LoraConfig, LossConfig, OptimConfig, TrainConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  model: ModelSpec
  data: PromptDataConfig
  rollout: RolloutSpec
  reward: RewardSpec
  rl: LossConfig
  optim: OptimConfig
  lora: LoraConfig
  topology: TopologyConfig
  run: RunSpec
  train: TrainSpec = TrainSpec()
  sync: SyncSpec = SyncSpec()
  env: EnvSpec = EnvSpec()

  def __post_init__(self):
    mode = self.topology.mode
    if self.sync.mode == "lora" and not self.lora.enabled:
      raise ValueError("sync.mode='lora' ships LoRA adapters: it needs LoRA (lora.rank > 0)")
    if mode == "colocated" and self.run.max_staleness != 0:
      object.__setattr__(self, "run", dataclasses.replace(self.run, max_staleness=0))  # nothing overlaps
    if mode == "async" and self.run.max_staleness < 1:
      raise ValueError("async mode needs run.max_staleness >= 1 (eta, in weight versions)")
    fixed = {r: p for r, p in DEFAULT_ROLES if r != "reward"}
    moved = {r: p for r, p in self.topology.roles if r in fixed and p != fixed[r]}
    if moved:  # only the reward model's role moves in a run (runtime/experiment.py); the rest would be ignored
      raise ValueError(f"topology.roles moves {moved}: a run keeps actor, reference and critic on the trainer pool "
                       "and the engine on the rollout pool; only 'reward' (a reward model) may be mapped")
    if self.rl.temperature != self.rollout.temperature:
      raise ValueError(f"rl.temperature={self.rl.temperature} must equal rollout.temperature="
                       f"{self.rollout.temperature}: the trainer recomputes the sampler's log-probs")
    if self.reward.dynamic_sampling and self.rl.group_size < 2:
      raise ValueError("reward.dynamic_sampling drops groups without reward variance: rl.group_size must be >= 2")
    data = dict(self.topology.rollout_axes).get("data", 1)
    for name in ("n_slots", "n_pages"):  # the engine's slots and KV pages split evenly over the data shards
      if getattr(self.rollout, name) % data:
        raise ValueError(f"rollout.{name}={getattr(self.rollout, name)} must be a multiple of the rollout mesh's "
                         f"data axis ({data}): each data shard owns an equal share")
    for name, n in (("rl.group_size", self.rl.group_size), ("run.eval_samples", self.run.eval_samples)):
      if n > self.rollout.n_slots // data:
        raise ValueError(f"{name}={n} > rollout.n_slots={self.rollout.n_slots} / the rollout mesh's data axis "
                         f"({data}): a prompt's samples are generated at once, on one data shard's slots")
    if self.run.eval_samples > 1 and self.rollout.eval_greedy:
      raise ValueError(f"run.eval_samples={self.run.eval_samples} greedy samples of a prompt are one sample "
                       f"{self.run.eval_samples} times: set rollout.eval_greedy=False to sample them")
    budget, row = self.train.max_tokens_per_row, self.data.max_prompt_len + self.rollout.max_new_tokens
    if budget and budget < row:
      raise ValueError(f"train.max_tokens_per_row={budget} < data.max_prompt_len + rollout.max_new_tokens = {row}: "
                       "the longest completion would not fit a row")
    if budget and self.model.attention == "cudnn":
      raise ValueError("model.attention='cudnn' takes no segment mask: packed rows (train.max_tokens_per_row > 0) "
                       "need 'flash' or 'xla'")

  @property
  def continuous_rollout(self) -> bool:
    """Whether the loop runs one long-lived rollout stream (runtime/rollout_side.Feed) that batches join while
    others decode, rather than one rollout per batch: disaggregated and async, unless switched off."""
    return (self.topology.mode != "colocated" and self.run.max_staleness >= 1 and self.rollout.continuous
            and not self.reward.dynamic_sampling)

  @property
  def train_config(self) -> TrainConfig:
    return TrainConfig(loss=self.rl, optim=self.optim, lora=self.lora, seed=self.run.seed)


# "run" first: other sections' values follow its keys (optim.total_steps 0 follows run.steps), so a bad run.steps
# is reported as itself, not as the optim key that copied it
_SECTIONS = {"run": RunSpec, "model": ModelSpec, "data": PromptDataConfig, "rollout": RolloutSpec,
             "reward": RewardSpec, "rl": LossConfig, "optim": OptimConfig, "lora": LoraConfig, "train": TrainSpec,
             "sync": SyncSpec, "env": EnvSpec}


def from_config_dict(config: Any) -> RunConfig:
  """The whole run's settings, validated; errors name the offending key."""
  config = plain(config)
  allowed = [*_SECTIONS, "topology"]
  for key in config:
    if key not in allowed:
      close = difflib.get_close_matches(key, allowed, n=1)
      raise ValueError(f"config: unknown section {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
  sections = {}
  for name, cls in _SECTIONS.items():
    raw = config.get(name, {})
    if name == "optim" and isinstance(raw, dict):
      raw = _decay_over_the_run(raw, sections["run"].steps)
    sections[name] = build_dataclass(cls, raw, name)
  sections["topology"] = TopologyConfig.from_dict(config.get("topology", {"mode": "colocated", "trainer": {},
                                                                           "rollout": {}}))
  return RunConfig(**sections)


def _decay_over_the_run(optim: dict, steps: int) -> dict:
  """optim.total_steps left 0 under the cosine schedule: the decay ends with the run, at run.steps (at least
  warmup_steps + 1: a run no longer than its warm-up never reaches the decay). A config that linked the two keys
  (a FieldReference) made --config.optim.total_steps=N set run.steps to N as well."""
  warmup = optim.get("warmup_steps", OptimConfig.warmup_steps)
  if optim.get("schedule") != "cosine" or optim.get("total_steps", 0) != 0 or not isinstance(warmup, int):
    return optim
  return {**optim, "total_steps": max(steps, warmup + 1)}


# ---------------------------------------------------------------- the ConfigDict every config file starts from


def config_from_file(path: str, arg: str | None = None):
  """`get_config(arg)` of a config file (what `--config=path:arg` gives the launchers), for configs that
  build on a sibling file and for tests."""
  import importlib.util
  import os

  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(f"jaxrl_config_{name}", path)
  if spec is None or not os.path.isfile(path):
    raise FileNotFoundError(f"no config file at {path}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def base_config_dict():
  """Every key a run reads, at its default; configs/<name>.py change what they need and `lock()` it,
  so a typo in an override (`--config.rl.gruop_size=8`) is rejected with the closest valid key."""
  import ml_collections

  c = ml_collections.ConfigDict()
  c.model = config_defaults(ModelSpec)
  c.data = config_defaults(PromptDataConfig, source="arithmetic")
  c.rollout = config_defaults(RolloutSpec)
  c.reward = config_defaults(RewardSpec)
  c.rl = config_defaults(LossConfig, group_size=8)
  c.optim = config_defaults(OptimConfig)
  c.lora = config_defaults(LoraConfig)
  c.train = config_defaults(TrainSpec)
  # Every axis is listed (size 1 = unused) so `--config.topology.rollout.tensor=2` is a valid override.
  c.topology = dict(mode="colocated", trainer={"data": 1, "fsdp": 1, "tensor": 1}, rollout={"data": 1, "tensor": 1},
                    reward_devices=0)
  c.run = config_defaults(RunSpec)
  c.sync = config_defaults(SyncSpec)
  c.env = config_defaults(EnvSpec)
  return c
