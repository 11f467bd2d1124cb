r"""Train a policy with RL: one command for every algorithm and mode.

  python launchers/train.py --config=configs/grpo_task.py:tiny --workdir=/tmp/run \
      [--config.rl.group_size=8 --config.topology.mode=async ...] [--fresh] [--traceback]

The config file's `get_config(arg)` returns a locked ml-collections ConfigDict; `--config.a.b=v`
overrides any key (a typo is rejected with the valid keys). It becomes typed, frozen dataclasses
(jaxrl_topo/runtime/config.py), validated before anything compiles. Re-running with the same
workdir resumes from its newest checkpoint, if the run's identity (model, LoRA, data) is unchanged:
otherwise nothing is touched and the differences are named (`--fresh` starts the workdir over).
Under `jax.distributed` (--coordinator/--num_processes/--process_id, or JAXRL_COORDINATOR etc.: see
jaxrl_topo/runtime/distributed.py) every process runs this same command. --helpfull lists every flag
(--traceback, --library_logs, ...).
"""

# Heavy imports live inside main(): reward worker processes are spawned and re-import this file.

import os
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from jaxrl_topo import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/grpo_task.py:tiny.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, summary.json).", required=True)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
_FRESH = flags.DEFINE_bool("fresh", False, "Start the workdir over: delete its checkpoints, init_model and metrics "
                           "(once the config, data and devices have passed their checks).")
_DISTRIBUTED = cli.define_distributed_flags()


def preflight(cfg) -> None:
  """What can be checked without JAX devices, before the workdir is touched: the model directory,
  the prompt files, the reward functions and environment, and prompt + response against the model's position
  limit."""
  from jaxrl_topo.envs import env as env_lib
  from jaxrl_topo.envs import rewards
  from jaxrl_topo.runtime.preflight import check_positions

  if cfg.model.hf_dir is not None and not os.path.isfile(os.path.join(cfg.model.hf_dir, "config.json")):
    raise FileNotFoundError(f"model.hf_dir={cfg.model.hf_dir!r}: no config.json there (expected a local "
                            "Hugging Face model directory; --config.model.hf_dir=None trains model.preset "
                            f"{cfg.model.preset!r} from random weights instead)")
  for key in ("source", "eval_source"):
    src = getattr(cfg.data, key)
    if src is not None and not (key == "source" and cfg.data.is_task) and not os.path.isfile(src):
      raise FileNotFoundError(f"data.{key}={src!r}: no such file")
  check_positions(cfg)  # also run.train's (and the model.overrides check)
  for name, _ in cfg.reward.fns:
    rewards.resolve(name)
  if cfg.env.fn:
    env_lib.resolve(cfg.env.fn)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/grpo_task.py:tiny")
  dist = _DISTRIBUTED()  # a partial explicit set-up fails here, first
  from jaxrl_topo.runtime import distributed
  from jaxrl_topo.runtime.config import from_config_dict
  from jaxrl_topo.runtime.preflight import check_data, check_model
  from jaxrl_topo.runtime.workdir import (
    check_fresh,
    check_not_a_model,
    check_not_in_use,
    check_workdir,
    start_over,
  )

  cli.unescape_stops(_CONFIG.value)  # --config.rollout.stop='\n' is a newline, as generate.py's --stop
  cfg = from_config_dict(_CONFIG.value)  # validated before jax starts
  preflight(cfg)
  check_data(cfg)  # the prompts build: a bad task or data file fails before the workdir is touched
  check_model(cfg)  # lora.targets name the model's projections
  workdir, fresh = _WORKDIR.value, _FRESH.value or cfg.run.fresh
  check_not_a_model(cfg, workdir)  # a model directory is refused, --fresh or not
  if fresh:
    check_fresh(workdir)  # --fresh deletes a run's folders: refused while they hold anything else
    check_not_in_use(workdir)  # ... or while a run is writing them
  else:
    check_workdir(cfg, workdir)  # before config.json is overwritten
  distributed.initialize(dist)
  import jax

  from jaxrl_topo.runtime import run
  from jaxrl_topo.runtime.preflight import check_shapes
  from jaxrl_topo.topology.carve import carve

  check_shapes(cfg, carve(cfg.topology, warn=False))  # enough devices? the weights and batch divide over the meshes?
  if fresh:  # only now that every check has passed: a launch that cannot start deletes nothing
    gone = start_over(workdir) if jax.process_index() == 0 else []
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("fresh")  # nobody reads the workdir before it is cleared
    if gone:
      print(f"--fresh: removed {', '.join(gone)} from {workdir}")
  summary = run.train(cfg, workdir, progress=_PROGRESS.value)  # saves config.json (run.fresh=False: a relaunch resumes)
  k, figure = cfg.run.eval_samples, lambda x: "n/a" if x is None else f"{x:.3f}"  # None: not measured before RL
  best = f"; pass@{k} {figure(summary[f'pass@{k}_before'])} -> {figure(summary[f'pass@{k}_after'])}" if k > 1 else ""
  print(f"held-out accuracy: before RL {summary['accuracy_before']:.3f}, after RL {summary['accuracy_after']:.3f}"
        f"{best} ({summary['steps']} steps, {summary['mode']}, {summary['wall_s']:.0f} s)")


def _interrupted() -> str:
  """What a Ctrl-C leaves: a checkpoint to resume from, or none yet (before: 'resume' was promised either way)."""
  from jaxrl_topo.runtime.workdir import latest_checkpoint_step

  if not flags.FLAGS.is_parsed():  # interrupted while the flags were read: no run started, nothing to say of one
    return ""
  if _WORKDIR.value and latest_checkpoint_step(_WORKDIR.value) is not None:
    return "run the same command again to resume from the newest checkpoint"
  return "no checkpoint was saved yet: the same command starts the run over (its warm-up included)"


if __name__ == "__main__":
  cli.launch(main, interrupted=_interrupted)
