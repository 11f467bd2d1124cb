"""The loop's weight sync: trainer state -> rollout layout -> engine, under `sync.mode` (topology/transfer.py).

  full   every leaf of the policy, cast to the rollout dtype, bucket by bucket
  delta  only the buckets whose cast values changed bitwise since the last sync (sync/changed_frac per sync)
  lora   only the LoRA adapters (fp32, replicated on the rollout mesh); the rollout side keeps its own copy
         of the frozen base and merges W + (alpha/r) A B there (transfer.merge_on_destination). The base copy
         is in the rollout dtype: into bf16, W is rounded before the merge and the sum again after, so a
         merged weight can differ from a full sync's bf16(W + (alpha/r) A B) by one rounding (fp32: equal)

The engine's current weights are handed to the plan as the old destination, so each bucket's stale arrays
are deleted just before the new bucket lands: a sync needs about one bucket of extra rollout memory, not a
second copy. The one exception is the `finish_on_old` update policy inside a running batch: live sequences
keep decoding on the old weights, so those stay alive until the engine swaps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
from absl import logging

from jaxrl_topo.topology.transfer import TransferPlan, merge_on_destination, replicated
from jaxrl_topo.train.lora import merge_lora


class WeightSync:
  """Built once per run from the initial train state; `initial()` is the engine's first weights, then
  `__call__(state, old)` is every later sync. `on_bucket(i)` (tests, benchmarks) runs at each bucket's peak."""

  def __init__(self, cfg, state, rollout_shardings, dst_dtype, rollout_mesh):
    self.mode, self.lora = cfg.sync.mode, cfg.lora
    self.on_bucket: Callable[[int], None] | None = None
    bucket, route = cfg.sync.bucket_bytes, cfg.sync.route

    def plan(*args, **kw) -> TransferPlan:
      try:
        return TransferPlan.build(*args, bucket_bytes=bucket, route=route, **kw)
      except ValueError as e:  # e.g. a route that cannot move these device counts: name the key that chose it
        if route == "auto":
          raise
        raise ValueError(f"sync.route={route!r}: {e}") from None

    if self.mode == "lora":
      self._base_plan = plan(state.frozen, rollout_shardings, dst_dtype=dst_dtype)
      self.rebase(state)
      adapters = state.params["policy"]
      self.plan = plan(adapters, replicated(adapters, rollout_mesh), mode="lora")
      plans = (self._base_plan, self.plan)
    else:
      self.base = None
      self.plan = plan(self.policy(state), rollout_shardings, dst_dtype=dst_dtype, mode=self.mode)
      plans = (self.plan,)
    taken = sorted({leaf.route for p in plans for leaf in p.leaves})
    if route != "auto" and route not in taken and jax.process_index() == 0:
      # same devices on both sides (colocated), or processes bridged by collectives: the key is not ignored unsaid
      logging.warning("sync.route=%r changes nothing here: no weight crosses between different devices of one "
                      "process (the routes taken: %s)", route, ", ".join(taken) or "none, no weights")
    self._adapters = None  # lora: the adapters on the rollout side (the old destination of the next sync)

  def rebase(self, state) -> None:
    """lora: sends `state`'s frozen base to the rollout side, where the adapters merge into it. The base crosses
    once a run, and again when a resume restores a checkpoint's (a warmed-up base, not the one built)."""
    if self.mode != "lora":
      return
    base, _ = self._base_plan.run(state.frozen)
    # A zero-copy route hands back the trainer's own array, which the next train step donates: keep a copy.
    self.base = jax.tree.map(lambda b, f: jax.device_put(b, may_alias=False) if b is f else b, base, state.frozen)

  def policy(self, state):
    """The full policy weights of a train state (LoRA adapters merged into the frozen base, on the trainer)."""
    if self.lora.enabled:
      return _merge(self.lora)(state.frozen, state.params["policy"])
    return state.params["policy"]

  def initial(self, state):
    params, _ = self(state, None)
    return params

  def __call__(self, state, old) -> tuple[object, dict]:
    """(the rollout weights of `state`, stats). `old`: the engine's current weights, freed bucket by bucket
    (None: kept alive). The stats' sync/bytes count bytes written on the rollout side."""
    t = time.perf_counter()
    if self.mode == "lora":
      if old is not None:  # the merged copy is rebuilt whole: drop the stale one first
        for x in jax.tree.leaves(old):
          if not x.is_deleted():
            x.delete()
      self._adapters, stats = self.plan.run(state.params["policy"], self._adapters if old is not None else None,
                                            on_bucket=self.on_bucket)
      params = merge_on_destination(self.base, self._adapters, self.lora)
    else:
      params, stats = self.plan.run(self.policy(state), old, on_bucket=self.on_bucket)
    jax.block_until_ready(params)
    return params, {"time/sync_s": time.perf_counter() - t, "sync/bytes": float(stats["bytes_sent"]),
                    "sync/changed_frac": float(stats["changed_frac"]), "sync/buckets": float(stats["buckets_sent"])}


_MERGE_CACHE: dict = {}


def _merge(lora_cfg):
  if lora_cfg not in _MERGE_CACHE:
    _MERGE_CACHE[lora_cfg] = jax.jit(lambda base, adapters: merge_lora(base, adapters, lora_cfg))
  return _MERGE_CACHE[lora_cfg]
