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

from jaxrl_topo.topology.transfer import merge_on_destination, replicated

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


def place(parked: Parked, mesh: jax.sharding.Mesh):
  """The host copy onto `mesh`, some of its devices (each leaf keeps its PartitionSpec). The host copy stays: it
  is still the job's weights for its next phase on all its devices. A leaf whose shards on those devices are
  the ones `mesh` needs (its spec does not split over the devices left out) goes from their own host memory;
  any other through numpy."""
  devices = set(mesh.devices.flat)

  def one(x, s):
    target = jax.sharding.NamedSharding(mesh, s.spec)
    if isinstance(x, jax.Array):
      have, want = x.sharding.devices_indices_map(x.shape), target.devices_indices_map(x.shape)
      if all(have.get(d) == want[d] for d in devices):
        shards = {sh.device: sh.data for sh in x.addressable_shards if sh.device in devices}
        x = jax.make_array_from_single_device_arrays(
            x.shape, target.with_memory_kind(x.sharding.memory_kind), [shards[d] for d in want])
      else:
        x = np.asarray(x)
    return jax.device_put(x, target)

  tree = jax.tree.map(one, parked.host, parked.shardings)
  jax.block_until_ready(tree)
  return tree


class HostSync:
  """A job's weight sync whose destination is its host-side rollout copy, written straight from the train
  devices: one jitted program on the trainer turns the train state into the rollout weights (full: the policy
  cast to the rollout dtype; lora: the frozen base cast to the rollout dtype, then the adapters merged in, the
  same order of operations as the plan's merge on the rollout side, so the bits are the same), and the result
  is put into host memory in the rollout layout (`pinned_host` shardings of the rollout devices where they
  offer it, else numpy), so no rollout device holds or moves a byte of it; the job's next rollout phase loads
  it (`unpark`). The old host copy is freed first. Its stats are the job's own plan's (the bytes and buckets a
  solo run's sync of that mode reports). `direct=False` (tests) sends every sync through the plan instead."""

  def __init__(self, inner, direct: bool = True):
    if inner.mode == "delta":
      raise ValueError("mux: sync.mode='delta' compares against the rollout side's last copy, which a warm "
                       "switch parks in host memory; use sync.mode='full' or 'lora'")
    self.inner = inner
    self.direct = direct

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def __call__(self, state, old):
    if not (self.direct and isinstance(old, Parked)):
      return self._via_plan(state, old)
    t = time.perf_counter()
    shardings, dtypes = old.shardings, jax.tree.map(lambda x: np.dtype(x.dtype), old.host)
    free(old.host)
    cast, inputs = self._on_trainer(state, shardings, dtypes)
    if cast is None:
      return self._via_plan(state, None)
    leaves = jax.tree.leaves(shardings)
    if leaves and all(HOST_KIND in {m.kind for d in s.device_set for m in d.addressable_memories()} for s in leaves):
      host = jax.device_put(cast, jax.tree.map(lambda s: s.with_memory_kind(HOST_KIND), shardings))
    else:
      host = jax.device_get(cast)
    jax.block_until_ready(host)
    free([x for x in jax.tree.leaves(cast) if id(x) not in inputs])  # not a train array a no-op cast forwarded
    plan = self.inner.plan
    total = sum(b.nbytes for b in plan.buckets)
    stats = {"time/sync_s": time.perf_counter() - t, "sync/bytes": float(total),
             "sync/changed_frac": total / plan.bytes_total if plan.bytes_total else 0.0,
             "sync/buckets": float(len(plan.buckets))}
    return Parked(host, shardings), stats

  def _on_trainer(self, state, shardings, dtypes):
    """(the rollout weights on train devices, ids of train arrays they may share), or (None, None) when the
    lora merge cannot run in the rollout layout on the trainer (then the plan's path serves)."""
    lora = self.inner.lora if self.inner.lora.enabled else None
    leaves, treedef = jax.tree.flatten(dtypes)
    if self.inner.mode != "lora":
      args = (state.frozen, state.params["policy"]) if lora else (state.params["policy"],)
      return _cast_fn(treedef, tuple(leaves), lora)(*args), set(map(id, jax.tree.leaves(args)))
    # sync.mode='lora': the plan ships the cast base once and merges in the rollout dtype on the rollout mesh;
    # the same merge program runs here on a train-device mesh of the rollout's shape, so the bits match.
    train_devices = list(jax.tree.leaves(state.frozen)[0].sharding.mesh.devices.flat)
    shadow = shadow_shardings(shardings, train_devices)
    if shadow is None:
      return None, None
    base = jax.device_put(_cast_fn(treedef, tuple(leaves), None)(state.frozen), shadow)
    mesh = jax.tree.leaves(shadow)[0].mesh
    adapters = jax.device_put(state.params["policy"], replicated(state.params["policy"], mesh))
    return merge_on_destination(base, adapters, lora), set()  # base, adapters: dropped here (may alias the state)

  def _via_plan(self, state, old):
    free(old.host if isinstance(old, Parked) else old)
    params, stats = self.inner(state, None)
    return park(params), stats


def free(tree) -> None:
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and not x.is_deleted():
      x.delete()


@functools.lru_cache(maxsize=32)
def _cast_fn(treedef, dtypes: tuple, lora):
  """One jitted program on the trainer: the policy cast to the rollout `dtypes` (LoRA: merged in the base's dtype
  first, as sync.mode='full' ships it)."""
  from jaxrl_topo.train.lora import merge_lora

  def cast(tree):
    return jax.tree.unflatten(treedef, [x.astype(d) for x, d in zip(jax.tree.leaves(tree), dtypes, strict=True)])

  if lora is None:
    return jax.jit(cast)
  return jax.jit(lambda base, adapters: cast(merge_lora(base, adapters, lora)))


def shadow_shardings(rollout_shardings, train_devices):
  """The rollout layout on the first train devices: a mesh of the rollout mesh's shape and axis names, same
  specs. A merge compiled there is the rollout side's merge program shard for shard (same per-shard shapes),
  hence the same bits. None when the rollout layout is not one NamedSharding mesh or the trainer has fewer
  devices than it."""
  leaves, treedef = jax.tree.flatten(rollout_shardings)
  meshes = {s.mesh for s in leaves if isinstance(s, jax.sharding.NamedSharding)}
  if len(meshes) != 1 or len(leaves) != sum(isinstance(s, jax.sharding.NamedSharding) for s in leaves):
    return None
  (mesh,) = meshes
  if len(train_devices) < mesh.devices.size:
    return None
  shadow = jax.sharding.Mesh(np.array(train_devices[:mesh.devices.size]).reshape(mesh.devices.shape), mesh.axis_names)
  return jax.tree.unflatten(treedef, [jax.sharding.NamedSharding(shadow, s.spec) for s in leaves])


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
  from jaxrl_topo.review.step_bytes import model_config
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
                     f"({budget:,} B); {each}. Drop a job or raise host_memory_gb (launchers/mux.py --host_memory_gb)")
