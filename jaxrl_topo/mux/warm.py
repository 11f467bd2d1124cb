"""Warm switches: a job off a pool keeps its state in host memory and comes back by a planned transfer.

A job's device state is two pytrees: the train state (params + optimizer state, trainer pool) and the
rollout weights (rollout pool). Off its pool each lives as arrays of the same shardings with
`memory_kind="pinned_host"` where the platform offers that memory (GPU, TPU, and CPU in current JAX),
else as numpy arrays. Coming back is one `jax.device_put` to the recorded device shardings: the same
shapes, dtypes and shardings as before, so every compiled program of the job is reused (no retrace).

`HostSync` wraps a job's `WeightSync`: a finished train step's weights are written into the job's
host-side rollout copy (the engine then holds that copy until the job's next rollout phase loads it).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

HOST_KIND = "pinned_host"


def host_kind_available(x: jax.Array) -> bool:
  """Whether every device holding `x` offers pinned host memory."""
  return all(HOST_KIND in {m.kind for m in d.addressable_memories()} for d in x.sharding.device_set)


def tree_bytes(tree) -> int:
  return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(tree)))


@dataclasses.dataclass
class Parked:
  """One pytree off its pool: the host copy and the device shardings it goes back to."""

  host: object
  shardings: object


def park(tree) -> Parked:
  """Device pytree -> host memory (the device buffers are freed)."""
  shardings = jax.tree.map(lambda x: x.sharding, tree)
  leaves = jax.tree.leaves(tree)
  if leaves and all(host_kind_available(x) for x in leaves):
    host = jax.device_put(tree, jax.tree.map(lambda s: s.with_memory_kind(HOST_KIND), shardings))
  else:
    host = jax.device_get(tree)
  jax.block_until_ready(host)
  for x in leaves:
    if not x.is_deleted():
      x.delete()
  return Parked(host, shardings)


def unpark(parked: Parked):
  """Host copy -> the recorded device shardings (the host copy is dropped)."""
  tree = jax.device_put(parked.host, parked.shardings)
  jax.block_until_ready(tree)
  for x in jax.tree.leaves(parked.host):
    if isinstance(x, jax.Array) and not x.is_deleted():
      x.delete()
  return tree


class HostSync:
  """A job's weight sync whose destination is its host-side rollout copy, written straight from the train
  devices: the policy is cast to the rollout dtype on the trainer, then put into host memory in the rollout
  layout (`pinned_host` shardings of the rollout devices where they offer it, else numpy), so no rollout
  device holds or moves a byte of it; the job's next rollout phase loads it (`unpark`). The old host copy is
  freed first. Its stats are the job's own plan's (same bytes and buckets as a solo run's full sync).
  sync.mode='lora' keeps the plan's path (the merge runs on the rollout side), then parks the result."""

  def __init__(self, inner):
    if inner.mode == "delta":
      raise ValueError("mux: sync.mode='delta' compares against the rollout side's last copy, which a warm "
                       "switch parks in host memory; use sync.mode='full' or 'lora'")
    self.inner = inner
    self.direct = inner.mode == "full"

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def __call__(self, state, old):
    if not (self.direct and isinstance(old, Parked)):
      return self._via_plan(state, old)
    t = time.perf_counter()
    shardings, dtypes = old.shardings, jax.tree.map(lambda x: np.dtype(x.dtype), old.host)
    for x in jax.tree.leaves(old.host):
      if isinstance(x, jax.Array) and not x.is_deleted():
        x.delete()
    cast = jax.tree.map(lambda x, d: x.astype(d), self.inner.policy(state), dtypes)  # on the train devices
    leaves = jax.tree.leaves(shardings)
    if leaves and all(HOST_KIND in {m.kind for d in s.device_set for m in d.addressable_memories()} for s in leaves):
      host = jax.device_put(cast, jax.tree.map(lambda s: s.with_memory_kind(HOST_KIND), shardings))
    else:
      host = jax.device_get(cast)
    jax.block_until_ready(host)
    policy = set(map(id, jax.tree.leaves(self.inner.policy(state))))
    for x in jax.tree.leaves(cast):
      if id(x) not in policy:  # a cast copy (an astype to the same dtype is the trainer's own array)
        x.delete()
    plan = self.inner.plan
    total = sum(b.nbytes for b in plan.buckets)
    stats = {"time/sync_s": time.perf_counter() - t, "sync/bytes": float(total),
             "sync/changed_frac": total / plan.bytes_total if plan.bytes_total else 0.0,
             "sync/buckets": float(len(plan.buckets))}
    return Parked(host, shardings), stats

  def _via_plan(self, state, old):
    if isinstance(old, Parked):
      old = old.host
    for x in jax.tree.leaves(old):
      if isinstance(x, jax.Array) and not x.is_deleted():
        x.delete()
    params, stats = self.inner(state, None)
    return park(params), stats


@dataclasses.dataclass(frozen=True)
class Residency:
  """Host bytes a job keeps while off its pools."""

  job: str
  train_state_bytes: int
  rollout_bytes: int

  @property
  def total(self) -> int:
    return self.train_state_bytes + self.rollout_bytes


def planned_residency(job: str, cfg) -> Residency:
  """A job's host-resident bytes from its config alone (abstract shapes; nothing is built or allocated): the
  train state (`train/state.py` init traced on the model's abstract parameters) and the rollout weights (the
  policy in the model dtype)."""
  from jaxrl_topo.models.model import abstract_model
  from jaxrl_topo.review.bytes import model_config
  from jaxrl_topo.train import state as state_lib
  from jaxrl_topo.train.optim import make_optimizer

  model_cfg, _ = model_config(cfg)
  _, params = abstract_model(model_cfg)
  params = params.shapes
  tcfg = cfg.train_config
  init = functools.partial(state_lib._init, cfg=tcfg, tx=make_optimizer(tcfg.optim), d_model=model_cfg.d_model)
  train_state = jax.eval_shape(init, params, jax.random.key(0))
  rollout = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.dtype(model_cfg.dtype)), params)
  return Residency(job, tree_bytes(train_state), tree_bytes(rollout))


def check_residency(residents: list[Residency], host_memory_gb: float) -> None:
  """Raises naming every job and its bytes when the group's host-resident state exceeds the budget."""
  total, budget = sum(r.total for r in residents), int(host_memory_gb * 2**30)
  if total > budget:
    each = ", ".join(f"{r.job}: {r.total:,} B (train state {r.train_state_bytes:,} + rollout "
                     f"{r.rollout_bytes:,})" for r in residents)
    raise ValueError(f"mux: the group's host-resident state is {total:,} B > mux.host_memory_gb={host_memory_gb:g} "
                     f"({budget:,} B); {each}. Drop a job or raise mux.host_memory_gb")
