"""Train a policy with RL: one command for every algorithm and mode.

  python launchers/train.py --config=configs/grpo_task.py:tiny --workdir=/tmp/run \
      [--config.rl.group_size=8 --config.topology.mode=async ...] [--fresh] [--traceback]

The config file's `get_config(arg)` returns a locked ml-collections ConfigDict; `--config.a.b=v`
overrides any key (a typo is rejected with the valid keys). It becomes typed, frozen dataclasses
(jaxrl_topo/runtime/config.py), validated before anything compiles. Re-running with the same
workdir resumes from its newest checkpoint, if the run's identity (model, LoRA, data) is unchanged:
otherwise nothing is touched and the differences are named (`--fresh` starts the workdir over).
Under `jax.distributed` (JAXRL_COORDINATOR etc., see jaxrl_topo/runtime/distributed.py) every
process runs this same command.

Heavy imports live inside main(): reward worker processes are spawned and re-import this file.
"""

import json
import os
import shutil
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from jaxrl_topo import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/grpo_task.py:tiny.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, summary.json).", required=True)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
_FRESH = flags.DEFINE_bool("fresh", False, "Start the workdir over: delete its checkpoints, init_model and metrics.")

# Keys that make a checkpoint (or a preset's init_model/) another run's: a change here cannot resume.
_IDENTITY = ("model.preset", "model.hf_dir", "model.overrides", "model.init_seed", "model.dtype", "lora.",
             "data.source", "data.task")
_RUN_FILES = ("checkpoints", "init_model", "metrics.jsonl", "histograms.jsonl", "spans.jsonl", "summary.json", "tb",
              "reward_curve.png", "config.json")


def _flat(d, prefix="") -> dict:
  out = {}
  for k, v in (d or {}).items():
    if isinstance(v, dict) and v and not k.endswith("overrides"):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def identity_diff(old: dict, new: dict) -> list[str]:
  """'key: old -> new' for every identity key (see _IDENTITY) that differs."""
  a, b = _flat(old), _flat(new)
  keys = sorted(k for k in set(a) | set(b) if k.startswith(_IDENTITY) or k in _IDENTITY)
  return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def _has_run(workdir: str) -> bool:
  ckpts = os.path.join(workdir, "checkpoints")
  has_ckpt = os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts))
  return has_ckpt or os.path.isfile(os.path.join(workdir, "init_model", "config.json"))


def check_workdir(config_json: str, workdir: str) -> None:
  """Raises (naming the differences) when `workdir` holds a checkpoint or an init_model of another run."""
  path = os.path.join(workdir, "config.json")
  if not _has_run(workdir):
    return
  if not os.path.isfile(path):
    raise cli.UserError(f"{workdir} holds checkpoints but no config.json: use a new --workdir, or --fresh "
                        "(--config.run.fresh=True)")
  with open(path) as f:
    old = json.load(f)
  diff = identity_diff(old, json.loads(config_json))
  if diff:
    raise cli.UserError(f"{workdir} holds another run (its config.json differs in {'; '.join(diff)}); nothing "
                        "was changed. Use a new --workdir, or --fresh (--config.run.fresh=True) to start this one "
                        "over (deletes its checkpoints).")


def start_over(workdir: str) -> list[str]:
  """--fresh: removes the run's files from `workdir` (nothing else there); returns what went."""
  gone = []
  for name in _RUN_FILES:
    p = os.path.join(workdir, name)
    if os.path.isdir(p):
      shutil.rmtree(p)
    elif os.path.exists(p):
      os.remove(p)
    else:
      continue
    gone.append(name)
  return gone


def preflight(cfg) -> None:
  """What can be checked without JAX devices, before the workdir is touched: the model directory,
  the prompt files, the reward functions, and prompt + response against the model's position limit."""
  import dataclasses

  from jaxrl_topo.envs import rewards
  from jaxrl_topo.models.presets import get_preset

  if cfg.model.hf_dir is not None:
    if not os.path.isfile(os.path.join(cfg.model.hf_dir, "config.json")):
      raise FileNotFoundError(f"model.hf_dir={cfg.model.hf_dir!r}: no config.json there (expected a local "
                              "Hugging Face model directory)")
    from jaxrl_topo.models import hf_io
    max_position = hf_io.read_config(cfg.model.hf_dir).max_position
  else:
    try:
      max_position = dataclasses.replace(get_preset(cfg.model.preset), **cfg.model.overrides).max_position
    except TypeError as e:
      raise ValueError(f"model.overrides: {e}") from None
  for key in ("source", "eval_source"):
    src = getattr(cfg.data, key)
    if src is not None and not (key == "source" and cfg.data.is_task) and not os.path.isfile(src):
      raise FileNotFoundError(f"data.{key}={src!r}: no such file")
  need = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
  if need > max_position:
    raise ValueError(f"data.max_prompt_len + rollout.max_new_tokens = {cfg.data.max_prompt_len} + "
                     f"{cfg.rollout.max_new_tokens} = {need} > the model's position limit {max_position} "
                     "(max_position_embeddings): lower one of them")
  for name, _ in cfg.reward.fns:
    rewards.resolve(name)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/grpo_task.py:tiny")
  from jaxrl_topo.runtime import distributed
  from jaxrl_topo.runtime.config import from_config_dict

  cfg = from_config_dict(_CONFIG.value)  # validated before jax starts
  preflight(cfg)
  workdir = _WORKDIR.value
  if _FRESH.value or cfg.run.fresh:
    gone = start_over(workdir) if os.environ.get("JAXRL_PROCESS_ID", "0") == "0" else []
    if gone:
      print(f"--fresh: removed {', '.join(gone)} from {workdir}")
    _CONFIG.value.run.fresh = False  # a relaunch with the saved config.json resumes; it does not wipe
  else:
    check_workdir(_CONFIG.value.to_json(), workdir)  # before config.json is overwritten
  distributed.initialize()
  from jaxrl_topo.runtime import run
  from jaxrl_topo.topology.carve import carve

  carve(cfg.topology)  # enough devices for the topology? (before the workdir is written)
  run.save_config(_CONFIG.value, workdir)
  summary = run.train(cfg, workdir, progress=_PROGRESS.value)
  print(f"held-out accuracy: before RL {summary['accuracy_before']:.3f}, after RL {summary['accuracy_after']:.3f} "
        f"({summary['steps']} steps, {summary['mode']}, {summary['wall_s']:.0f} s)")


if __name__ == "__main__":
  cli.launch(main)
