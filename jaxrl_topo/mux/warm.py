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
  """A job's weight sync whose destination is its host-side rollout copy: trainer state -> rollout layout
  (the job's own TransferPlan, unchanged) -> host memory. `old` (the previous host copy) is freed first."""

  def __init__(self, inner):
    if inner.mode == "delta":
      raise ValueError("mux: sync.mode='delta' compares against the rollout side's last copy, which a warm "
                       "switch parks in host memory; use sync.mode='full' or 'lora'")
    self.inner = inner

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def __call__(self, state, old):
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


def check_residency(residents: list[Residency], host_memory_gb: float) -> None:
  """Raises naming every job and its bytes when the group's host-resident state exceeds the budget."""
  total, budget = sum(r.total for r in residents), int(host_memory_gb * 2**30)
  if total > budget:
    each = ", ".join(f"{r.job}: {r.total:,} B (train state {r.train_state_bytes:,} + rollout "
                     f"{r.rollout_bytes:,})" for r in residents)
    raise ValueError(f"mux: the group's host-resident state is {total:,} B > mux.host_memory_gb={host_memory_gb:g} "
                     f"({budget:,} B); {each}. Drop a job or raise mux.host_memory_gb")
