"""Reading device arrays on the host in a multi-process run, without device collectives.

Every process of a run drives the same global program and must take the same host decisions
(which sequence finished, which step's weights land), so every process needs the same host copy of
rollout tokens and train metrics, even when the arrays live on other processes' devices.

`to_host` does that through jax.distributed's key-value store: the process that owns a slice
pickles it under a key, every other process reads it. A device collective (`process_allgather`)
would do the same job, but it runs on every device of the run: it queues behind whatever those
devices are busy with, so the rollout side's per-chunk reads would wait for the trainer's step
(no overlap), and on CPU a gather issued beside an in-flight train step hung. The store touches
only the owners' devices and the coordinator.

Keys are `jaxrl_topo/x/<epoch>/<seq>/<process>`: every process calls `to_host` in the same order,
so the sequence numbers agree. `collect()` (a barrier, then process 0 deletes the epoch's keys) is
called once per train step by the controller so the store does not grow.

Process-wide state (the sequence counter) lives in `_STATE`: like jax.distributed's own client, it
belongs to the process, not to any one engine or loop.
"""

from __future__ import annotations

import dataclasses
import pickle

import jax
import numpy as np

_PREFIX = "jaxrl_topo/x"
TIMEOUT_S = 1800  # a reader may wait for a whole train step (or a decode chunk) on the owner


@dataclasses.dataclass
class _Sequence:
  epoch: int = 0
  seq: int = 0


_STATE = _Sequence()


def _client():
  from jax._src import distributed  # the coordinator's key-value store has no public accessor yet
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("a multi-process host read needs jax.distributed.initialize() (runtime/distributed.py)")
  return client


def _slice_key(index) -> tuple:
  return tuple((sl.start, sl.stop) for sl in index)


def _local_everywhere(x) -> bool:
  """True when every process holds the whole of `x` (decided from the global sharding, so all
  processes agree), or `x` is not a device array."""
  if not isinstance(x, jax.Array):
    return True
  if jax.process_count() == 1:
    return True
  if not x.sharding.is_fully_replicated:
    return False
  return {d.process_index for d in x.sharding.device_set} == set(range(jax.process_count()))


def _owners(x) -> dict[tuple, int]:
  """Each distinct slice of `x` -> the lowest-numbered process holding it."""
  owners: dict[tuple, int] = {}
  for device, index in x.sharding.devices_indices_map(x.shape).items():
    key = _slice_key(index)
    owners[key] = min(owners.get(key, device.process_index), device.process_index)
  return owners


def to_host(tree):
  """numpy copies of every array in `tree`, the same on every process (see the module doc)."""
  leaves, treedef = jax.tree.flatten(tree)
  if all(_local_everywhere(x) for x in leaves):
    return jax.tree.unflatten(treedef, [np.asarray(jax.device_get(x)) for x in leaves])
  return jax.tree.unflatten(treedef, _exchange(leaves))


def _exchange(leaves: list) -> list[np.ndarray]:
  me = jax.process_index()
  out: list[np.ndarray | None] = [None] * len(leaves)
  mine, senders = [], set()
  for i, x in enumerate(leaves):
    if _local_everywhere(x):
      out[i] = np.asarray(jax.device_get(x))
      continue
    out[i] = np.empty(x.shape, x.dtype)
    owners = _owners(x)
    senders |= set(owners.values())
    done = set()
    for shard in x.addressable_shards:
      key = _slice_key(shard.index)
      if key not in done:  # every local copy of a slice is read from the device once
        out[i][shard.index] = np.asarray(shard.data)
        done.add(key)
        if owners[key] == me:
          mine.append((i, shard.index, out[i][shard.index]))
  blobs = _publish_and_read(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL) if me in senders else None,
                            senders)
  for blob in blobs.values():
    for i, index, data in pickle.loads(blob):
      out[i][index] = data
  return out


def broadcast(obj, src: int):
  """`obj` as process `src` has it (any picklable value), on every process; every process calls it."""
  if jax.process_count() == 1:
    return obj
  blob = _publish_and_read(pickle.dumps(obj) if jax.process_index() == src else None, {src})
  return obj if jax.process_index() == src else pickle.loads(blob[src])


def _publish_and_read(mine: bytes | None, senders: set[int]) -> dict[int, bytes]:
  """One exchange: this process publishes `mine` (a sender's bytes) and reads every other sender's."""
  me, client = jax.process_index(), _client()
  base = f"{_PREFIX}/{_STATE.epoch}/{_STATE.seq}"
  _STATE.seq += 1
  if mine is not None:
    client.key_value_set_bytes(f"{base}/{me}", mine)
  got = {}
  for p in sorted(senders - {me}):
    try:
      got[p] = client.blocking_key_value_get_bytes(f"{base}/{p}", TIMEOUT_S * 1000)
    except Exception as e:  # the runtime raises a bare XlaRuntimeError on timeout
      raise RuntimeError(f"process {me}: no host data from process {p} under {base}/{p} after {TIMEOUT_S} s "
                         "(did every process call to_host in the same order?)") from e
  return got


def collect() -> None:
  """Barrier across processes (so every read is done), then process 0 deletes this epoch's keys."""
  if jax.process_count() == 1:
    return
  client = _client()
  client.wait_at_barrier(f"jaxrl_topo/collect/{_STATE.epoch}", TIMEOUT_S * 1000)
  if jax.process_index() == 0:
    client.key_value_delete(f"{_PREFIX}/{_STATE.epoch}/")
  _STATE.epoch, _STATE.seq = _STATE.epoch + 1, 0
