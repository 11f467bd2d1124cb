"""A run's checkpoint as a Hugging Face model directory: what launchers/export.py and serving read back."""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from jaxrl_topo.runtime import experiment as experiment_lib
from jaxrl_topo.runtime import workdir as workdir_lib
from jaxrl_topo.runtime.checkpoint import Checkpointer, abstract_like
from jaxrl_topo.runtime.run import load_config
from jaxrl_topo.topology import hostcomm
from jaxrl_topo.topology.carve import carve


def export(workdir: str, out_dir: str, *, step: int | None = None, dtype: str | None = None) -> int:
  """Writes the policy of checkpoint `step` (default: newest) as an HF directory; returns the step."""
  from jaxrl_topo.models import hf_io
  from jaxrl_topo.topology.rules import TRAIN_RULES
  from jaxrl_topo.train.optim import make_optimizer
  from jaxrl_topo.train.state import create_train_state

  workdir_lib.check_export_out(workdir, out_dir)
  cfg = load_config(workdir)
  model_dir = experiment_lib.model_dir_for(cfg, workdir)
  # Only the trainer's mesh: a disaggregated run's export does not need its rollout devices too.
  trainer = carve(dataclasses.replace(cfg.topology, mode="colocated")).trainer
  model_cfg, _, params = hf_io.load_model(model_dir, trainer, TRAIN_RULES, dtype=cfg.model.dtype)
  state = create_train_state(params, cfg.train_config, make_optimizer(cfg.optim), d_model=model_cfg.d_model)
  # As in train: only the processes holding trainer devices read the checkpoint (the others hold no shard of it).
  holders = frozenset(d.process_index for d in trainer.devices.flat)
  if jax.process_index() in holders:
    with Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True, processes=holders) as ckpt:
      step = ckpt.latest_step() if step is None else step  # (the run may be saving: read-only)
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints")
      state, _ = ckpt.restore(step, abstract_like(state))
  step = hostcomm.broadcast(step, src=min(holders))
  if jax.process_index() not in holders:  # nothing of the policy here; process 0 (a holder: carve starts there) writes
    return step
  policy = state.params["policy"]
  if cfg.lora.enabled:
    from jaxrl_topo.train.lora import merge_lora
    policy = merge_lora(state.frozen, policy, cfg.lora)
  with open(os.path.join(model_dir, "config.json")) as f:
    eos = json.load(f).get("eos_token_id")
  hf_io.save_model(out_dir, model_cfg, policy, dtype=dtype, eos_token_id=eos, tokenizer_dir=model_dir)
  if jax.process_index() == 0:  # marks the directory as an export, which a later export may replace
    with open(os.path.join(out_dir, workdir_lib.EXPORT_RECORD), "w") as f:
      json.dump({"workdir": os.path.realpath(workdir), "step": step, "dtype": dtype or model_cfg.param_dtype}, f)
  return step
