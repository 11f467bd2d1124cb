r"""Validate a topology: carve it, sync trainer -> rollout weights, check every shard bit for bit.

  python launchers/sync_check.py --mode=disaggregated --trainer=fsdp=4 --rollout=data=2,tensor=2
  # across processes on this machine (2 x 4 CPU devices, jax.distributed + gloo):
  python launchers/local_multiprocess.py --num_processes=2 -- \
      python launchers/sync_check.py --mode=disaggregated --trainer=fsdp=4 --rollout=data=2,tensor=2
  # on a cluster: --coordinator=host:port --num_processes=N --process_id=i (or JAX's auto-detection)

Prints one JSON line per sync: {"mode", "gen_id", "routes", "buckets", "bytes_total", ...}; the
per-role parameter sharding table is logged at start-up.
"""

import json
from collections.abc import Sequence

import jax
from absl import app, flags, logging

from jaxrl_topo import cli
from jaxrl_topo.models.presets import PRESETS, get_preset
from jaxrl_topo.runtime.distributed import initialize
from jaxrl_topo.topology.carve import TopologyConfig
from jaxrl_topo.topology.sync_check import run_sync_check

_MODES = flags.DEFINE_list("mode", ["disaggregated"], "Topologies to check: colocated, disaggregated, async.")
_TRAINER = flags.DEFINE_string("trainer", "fsdp=4", "Trainer mesh axes, e.g. fsdp=4,tensor=2.")
_ROLLOUT = flags.DEFINE_string("rollout", "data=2,tensor=2", "Rollout mesh axes, e.g. data=2,tensor=2.")
_COLOC_TRAINER = flags.DEFINE_string("colocated_trainer", None, "Trainer axes for the colocated check (default "
                                     "--trainer).")
_COLOC_ROLLOUT = flags.DEFINE_string("colocated_rollout", None, "Rollout axes for the colocated check (default "
                                     "--rollout).")
_PRESET = flags.DEFINE_enum("preset", "tiny", sorted(PRESETS), "Model shape (random weights).")
_KV_HEADS = flags.DEFINE_integer("n_kv_heads", None, "Override the preset's kv heads (e.g. so tensor=4 divides).",
                                 lower_bound=1)
_BUCKET_MB = flags.DEFINE_float("bucket_mb", 64, "Transfer bucket size in MiB.")
_VERSIONS = flags.DEFINE_integer("versions", 2, "Weight versions to sync (gen_id 1..N).", lower_bound=1)
_DISTRIBUTED = cli.define_distributed_flags()


def _axes(spec: str, flag: str) -> dict[str, int]:
  """'fsdp=4,tensor=2' -> {'fsdp': 4, 'tensor': 2}; a malformed value is a one-line user error naming the flag."""
  try:
    pairs = [(k, int(v)) for k, v in (part.split("=") for part in spec.split(",") if part)]
  except ValueError:
    raise ValueError(f"--{flag}={spec}: expected name=size[,name=size], e.g. fsdp=4,tensor=2") from None
  names = [k for k, _ in pairs]
  if len(set(names)) < len(names):
    raise ValueError(f"--{flag}={spec}: an axis is named twice")
  return dict(pairs)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  initialize(_DISTRIBUTED())
  logging.info("process %d/%d devices=%s", jax.process_index(), jax.process_count(), jax.devices())
  overrides = {"n_kv_heads": _KV_HEADS.value} if _KV_HEADS.value else {}
  model_cfg = get_preset(_PRESET.value, **overrides)
  for mode in _MODES.value:
    colocated = mode == "colocated"
    trainer = (_axes(_COLOC_TRAINER.value, "colocated_trainer") if colocated and _COLOC_TRAINER.value
               else _axes(_TRAINER.value, "trainer"))
    rollout = (_axes(_COLOC_ROLLOUT.value, "colocated_rollout") if colocated and _COLOC_ROLLOUT.value
               else _axes(_ROLLOUT.value, "rollout"))
    topo_cfg = TopologyConfig.from_dict({"mode": mode, "trainer": trainer, "rollout": rollout})
    for row in run_sync_check(topo_cfg, model_cfg, bucket_bytes=int(_BUCKET_MB.value * 2**20),
                              versions=_VERSIONS.value):
      print("SYNC-OK " + json.dumps(row), flush=True)
  if jax.process_count() > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  cli.launch(main)
