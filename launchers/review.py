r"""The data-path review: a one-page decision record for a config, optionally folding in a measured run.

  python launchers/review.py --config=configs/grpo_gsm8k.py:/models/qwen --out=review/ \
      [--workdir=RUN] [--train_s=30 --decode_tokens_per_s=2000 --link_gbps=100 --n_devices=64]

Writes record.md, record.json, timelines.png and (with n_devices >= 2, devices to split) split_sweep.png
into --out. Without --workdir the simulator runs on the stated assumptions; with it, on the run's
measured spans, and the record adds
the measured breakdown and staleness (exiting non-zero if the staleness bound was ever exceeded).
With both, the record is a what-if for --config (another mesh, mode or bound) on the run's measured phase
times; the run's observed staleness is checked against the run's own bound (its config.json), not --config's.
--out must be a directory of its own: a run's workdir or its folders, a group's or a model's are refused.
A --workdir of launchers/mux.py (a co-execution group, no --config) gets group.md, group.json and
group_timeline.png instead: every job's phases on each pool, from the group's mux_spans.jsonl.
"""

import sys
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from jaxrl_topo import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/grpo_task.py:tiny.",
                                          lock_config=True)
_OUT = flags.DEFINE_string("out", None, "Directory for the record.", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "A run of launchers/train.py to fold in.")
_TRAIN_S = flags.DEFINE_float("train_s", 30.0, "Assumed seconds per train step on the trainer devices.")
_DECODE = flags.DEFINE_float("decode_tokens_per_s", 2000.0, "Assumed decode tokens/s per rollout device.")
_PER_SEQ = flags.DEFINE_float("per_seq_tokens_per_s", 50.0, "Assumed decode tokens/s of one sequence.")
_LINK = flags.DEFINE_float("link_gbps", 100.0, "Trainer -> rollout link bandwidth, Gbit/s.")
_N_DEVICES = flags.DEFINE_integer("n_devices", None, "Devices to split (default: what the topology uses).")
_DEVICE_GB = flags.DEFINE_float("device_memory_gb", 80.0,
                                 "One device's memory in GiB (an H100 80GB holds 80), for the fit check.")
for _flag in (_TRAIN_S, _DECODE, _PER_SEQ, _LINK, _DEVICE_GB, _N_DEVICES):  # checked as the flags are parsed
  flags.register_validator(_flag, lambda v: v is None or v > 0, message="must be > 0")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from jaxrl_topo.review.record import Assumptions, fit_warning, write_record
  from jaxrl_topo.runtime import run
  from jaxrl_topo.runtime.config import from_config_dict

  if _CONFIG.value is None and _WORKDIR.value is None:
    raise app.UsageError("give --config, or --workdir of a run (its config.json is used)")
  from jaxrl_topo.review import group, outdir

  outdir.check_out(_OUT.value, _WORKDIR.value)  # before anything is read or written
  if _CONFIG.value is not None and _WORKDIR.value is not None and group.is_group(_WORKDIR.value):
    raise app.UsageError(f"--workdir={_WORKDIR.value} is a multiplexed group: its review takes no --config (a what-if "
                         "is for one run: give one job's folder, <group>/<i>-<config>, with --config)")
  if _CONFIG.value is None and group.is_group(_WORKDIR.value):  # a co-execution group (launchers/mux.py)
    fig = group.write_group_record(_WORKDIR.value, _OUT.value)
    print(group.to_markdown(fig))
    print(f"wrote {_OUT.value}/group.md, group.json, group_timeline.png ({len(fig['jobs'])} jobs)")
    return
  cfg = from_config_dict(_CONFIG.value) if _CONFIG.value is not None else run.load_config(_WORKDIR.value)
  if _CONFIG.value is not None and _WORKDIR.value is not None:
    from jaxrl_topo.runtime import workdir

    ran = workdir.recorded_identity(_WORKDIR.value)
    diff = workdir.identity_diff(ran, workdir.identity(cfg)) if ran is not None else []
    if diff:  # a what-if on another mesh is the point; on another model, the measured phases mean little
      print(f"WARNING: --workdir={_WORKDIR.value} ran another model or data than --config: "
            f"{'; '.join(diff[:4])}{' ...' if len(diff) > 4 else ''}. The record fits its measured phase times to "
            "this config as they are", file=sys.stderr)
  a = Assumptions(n_devices=_N_DEVICES.value, decode_tokens_per_s_per_device=_DECODE.value,
                  per_seq_tokens_per_s=_PER_SEQ.value, train_s=_TRAIN_S.value, link_gbps=_LINK.value,
                  device_memory_gb=_DEVICE_GB.value)
  fig = write_record(cfg, _OUT.value, workdir=_WORKDIR.value, assumptions=a)
  rates = ", ".join(f"{m} {v:.1f}" for m, v in fig["steps_per_hour"].items())
  print(f"wrote {_OUT.value}/record.md (steps/hour: {rates})")
  warning = fit_warning(fig["memory"], cfg.topology.mode)
  if warning:
    print(f"WARNING: {warning}", file=sys.stderr)


if __name__ == "__main__":
  cli.launch(main)
