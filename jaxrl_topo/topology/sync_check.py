"""Carve a topology, sync weights trainer -> rollout a few times, and verify every shard bit for bit.

What `launchers/sync_check.py` runs, on one process or many (each process checks its own shards, so
nothing is gathered). Use it to validate a topology config on a cluster before an RL run: it logs
the per-role sharding table, builds the TransferPlan once, syncs `versions` weight versions
(gen_id 1, 2, ...) and returns one stats row per sync.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.models.model import abstract_model, init_params
from jaxrl_topo.topology.carve import TopologyConfig, carve, check_model_fits, log_sharding_table
from jaxrl_topo.topology.transfer import TransferPlan, VersionedWeights, sync


class SyncMismatch(AssertionError):
  """A destination shard differs from the bf16 cast of the source."""


def _check_shards(tree, want_leaves, dtype, what: str) -> None:
  """Every shard this process holds equals `want` (full host arrays) cast to `dtype`, bit for bit."""
  for y, want in zip(jax.tree.leaves(tree), want_leaves, strict=True):
    if y.dtype != dtype:
      raise SyncMismatch(f"{what}: dtype {y.dtype}, expected {jnp.dtype(dtype)}")
    for s in y.addressable_shards:
      if not np.array_equal(np.asarray(s.data), np.asarray(want[s.index]).astype(dtype)):
        raise SyncMismatch(f"{what}: shard {s.index} on device {s.device.id} differs")


def run_sync_check(topo_cfg: TopologyConfig, model_cfg: ModelConfig, *, bucket_bytes: int = 64 << 20,
                   mode: str = "full", versions: int = 2) -> list[dict]:
  """One stats row per sync; raises SyncMismatch if any of this process's shards is wrong."""
  topo = carve(topo_cfg)
  _, abstract = abstract_model(model_cfg)
  log_sharding_table(abstract, topo)
  shardings = check_model_fits(topo, abstract)
  src_abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract.shapes,
                              shardings["actor"])
  plan = TransferPlan.build(src_abstract, shardings["rollout"], bucket_bytes=bucket_bytes, mode=mode)
  weights, rows = VersionedWeights(params=None, gen_id=0), []
  for gen_id in range(1, versions + 1):
    key = jax.random.key(gen_id)  # each version different weights
    _, params = init_params(model_cfg, key, topo.trainer, topo.rules_for("actor"))
    # Reference values: the same init on this process's own first device (init values don't depend on
    # the mesh); the trainer shards this process holds must equal them exactly, and so must the
    # rollout shards after the cast.
    want = jax.tree.leaves(jax.device_get(init_params(model_cfg, key)[1]))
    _check_shards(params, want, jnp.dtype(model_cfg.param_dtype), f"{topo.mode} trainer gen_id {gen_id}")
    weights = sync(plan, params, weights, gen_id)
    _check_shards(weights.params, want, jnp.bfloat16, f"{topo.mode} rollout gen_id {gen_id}")
    rows.append({"mode": topo.mode, "gen_id": weights.gen_id, "routes": sorted({lf.route for lf in plan.leaves}),
                 "buckets": len(plan.buckets), "bytes_total": plan.bytes_total,
                 "max_bytes_per_device": max(plan.bytes_per_device.values(), default=0),
                 **{k: v for k, v in weights.stats.items() if k in ("bytes_sent", "seconds")}})
  return rows
