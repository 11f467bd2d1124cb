"""Train a policy with RL: one command for every algorithm and mode.

  python launchers/train.py --config=configs/grpo_task.py:tiny --workdir=/tmp/run \
      [--config.rl.group_size=8 --config.topology.mode=async ...]

The config file's `get_config(arg)` returns a locked ml-collections ConfigDict; `--config.a.b=v`
overrides any key (a typo is rejected with the valid keys). It becomes typed, frozen dataclasses
(jaxrl_topo/runtime/config.py), validated before anything compiles. Re-running with the same
workdir resumes from its newest checkpoint. Under `jax.distributed` (JAXRL_COORDINATOR etc., see
jaxrl_topo/runtime/distributed.py) every process runs this same command.

Heavy imports live inside main(): reward worker processes are spawned and re-import this file.
"""

from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/grpo_task.py:tiny.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, summary.json).", required=True)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from jaxrl_topo.runtime import distributed
  from jaxrl_topo.runtime.config import from_config_dict

  cfg = from_config_dict(_CONFIG.value)  # validated before jax starts
  distributed.initialize()
  from jaxrl_topo.runtime import run

  run.save_config(_CONFIG.value, _WORKDIR.value)
  summary = run.train(cfg, _WORKDIR.value, progress=_PROGRESS.value)
  print(f"held-out accuracy: before RL {summary['accuracy_before']:.3f}, after RL {summary['accuracy_after']:.3f} "
        f"({summary['steps']} steps, {summary['mode']}, {summary['wall_s']:.0f} s)")


if __name__ == "__main__":
  app.run(main)
