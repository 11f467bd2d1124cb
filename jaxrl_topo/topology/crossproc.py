"""Moving arrays between device sets owned by different processes, with collectives only.

In multi-controller JAX a `device_put` onto devices of another process needs a cross-host
transfer service that the CPU backend (and many GPU set-ups) lack. A bucket of leaves therefore
travels in three steps, each one program that every process runs (a process owning none of a
step's devices runs it as a no-op):
  1. source side: cast, flatten and concatenate the leaves into one vector sharded evenly over the
     source devices (the intermediate layout: equal shard shapes on both sides);
  2. a `ppermute` over a two-row "union" mesh (row 0 the source devices, row 1 the destination's)
     sends each source shard to its partner device;
  3. destination side: split the vector back into leaves, each resharded to its destination layout.
Both sides need the same device count (JAX's own condition for cross-process transfers).
Letters: n devices per side, L padded vector length.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


def _line_mesh(mesh: Mesh) -> Mesh:
  """The same devices, in the same order, as one axis "x" (so jit sees the same device set)."""
  return Mesh(mesh.devices.reshape(-1), ("x",), axis_types=(AxisType.Auto,))


def _src_mesh(xs: Sequence[jax.Array]) -> Mesh:
  meshes = {x.sharding.mesh for x in xs}
  if len(meshes) != 1 or not isinstance(xs[0].sharding, NamedSharding):
    raise ValueError("a cross-process bucket's leaves must share one source mesh (NamedSharding)")
  return meshes.pop()


@functools.cache
def _pack_fn(sizes: tuple[int, ...], dtype, length: int, line: NamedSharding):
  def pack(*xs):
    flat = jnp.concatenate([x.astype(dtype).reshape(-1) for x in xs])
    return jnp.pad(flat, (0, length - flat.shape[0]))
  return jax.jit(pack, out_shardings=line)


@functools.cache
def _unpack_fn(shapes: tuple[tuple[int, ...], ...], dsts: tuple[NamedSharding, ...]):
  def unpack(flat):
    out, start = [], 0
    for shape in shapes:
      size = math.prod(shape)
      out.append(flat[start : start + size].reshape(shape))
      start += size
    return out
  return jax.jit(unpack, out_shardings=list(dsts))


@functools.cache
def _send_fn(union: Mesh):
  spec = PartitionSpec("side", "x")
  return jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, "side", [(0, 1)]), mesh=union, in_specs=spec,
                               out_specs=spec))


def transfer_bucket(xs: Sequence[jax.Array], dsts: Sequence[NamedSharding], dtype) -> list[jax.Array]:
  """`xs` (on one source mesh) cast to `dtype` and laid out as `dsts` (one destination mesh).

  Every process must call this with the same arguments in the same order.
  """
  src_mesh, dst_mesh = _src_mesh(xs), dsts[0].mesh
  n = src_mesh.devices.size
  if dst_mesh.devices.size != n:
    raise ValueError(f"cross-process transfer needs equal device counts: source {n}, destination "
                     f"{dst_mesh.devices.size}")
  if set(src_mesh.devices.flat) & set(dst_mesh.devices.flat):
    raise ValueError("cross-process transfer is for disjoint device sets; use a local reshard instead")
  dtype = jnp.dtype(dtype)
  total = sum(x.size for x in xs)
  length = -(-total // n) * n
  src_line, dst_line = _line_mesh(src_mesh), _line_mesh(dst_mesh)
  packed = _pack_fn(tuple(x.size for x in xs), dtype, length, NamedSharding(src_line, PartitionSpec("x")))(*xs)

  union = Mesh(np.stack([src_line.devices, dst_line.devices]), ("side", "x"), axis_types=(AxisType.Auto,) * 2)
  row_of = {d: 0 for d in src_line.devices} | {d: 1 for d in dst_line.devices}
  by_device = {s.device: s.data for s in packed.addressable_shards}
  shards = []
  for d in union.devices.flat:  # this process's devices, in mesh order
    if d.process_index == jax.process_index():
      shards.append(by_device[d][None] if row_of[d] == 0 else jax.device_put(np.zeros((1, length // n), dtype), d))
  union_array = jax.make_array_from_single_device_arrays(
      (2, length), NamedSharding(union, PartitionSpec("side", "x")), shards, dtype=dtype)
  received = _send_fn(union)(union_array)

  got = {s.device: s.data[0] for s in received.addressable_shards}
  mine = [got[d] for d in dst_line.devices if d.process_index == jax.process_index()]
  flat = jax.make_array_from_single_device_arrays((length,), NamedSharding(dst_line, PartitionSpec("x")), mine,
                                                  dtype=dtype)
  return _unpack_fn(tuple(x.shape for x in xs), tuple(dsts))(flat)
