"""Weight sync as a planned sharding-spec transfer: trainer layout (fp32, FSDP) -> rollout layout (bf16, TP).

  plan = TransferPlan.build(train_params, rollout_shardings)  # once: routes, buckets, AOT-compiled casts
  weights = sync(plan, train_params, weights, new_gen_id=step)  # every RL step; plan.describe() for bytes

Leaves are grouped in tree order into buckets of at most `bucket_bytes` destination bytes. Per bucket:
free the stale destination arrays, cast (one compiled function on the source devices), copy whole
shards to the destination devices (`jax.device_put`), and, where the layout change was left to the
destination, reshard there (a second compiled function). Peak extra memory is about one bucket.

Where the layout changes (`route`), chosen per leaf at plan time:
  alias        same sharding and dtype: the destination *is* the source array (colocated zero-copy).
  local        same devices in the same order: one compiled cast + reshard, nothing to copy.
  source       cast + reshard on the source devices into the destination's layout, then copy shards.
  destination  cast on the source in its own layout, copy shards, reshard on the destination.
  device_put   cast on the source, then plain `jax.device_put` (JAX's own routing).
  collective   multi-process, disjoint device sets: crossproc.transfer_bucket (pack on the source,
               ppermute over a union mesh, unpack on the destination); every process runs the plan.
"auto" takes whichever of source/destination copies fewer bytes between the device sets (ties:
source), and device_put only when the device counts divide neither way: within one process, JAX
moves a layout change between device sets through host memory (`Array._value`, a numpy copy of the
whole array), which on a GPU means a device-to-host and a host-to-device copy of every leaf.

Modes: "full" sends every bucket; "delta" keeps the last-sent cast values on the source and sends a
bucket only if one of its values changed bitwise; "lora" sends the adapter dict (fp32) and the
destination merges it into its own base copy with `merge_on_destination`.
Bytes: `bytes_total` / `bytes_per_device` are destination bytes written per full sync (aliased leaves
excluded); `bytes_shipped` counts copies between the device sets (a reshard within a set is not).
Run a plan only between decode chunks: the old destination arrays are deleted bucket by bucket. Aliased
leaves ARE the trainer's arrays: a train step that donates them leaves the rollout without weights until
the next sync.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrl_topo.topology import crossproc
from jaxrl_topo.train.lora import merge_lora

MODES = ("full", "delta", "lora")
ROUTES = ("auto", "source", "destination", "device_put")


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """How one leaf travels: src -> mid_src (cast on source devices) -> mid_dst (shard copy) -> dst."""

  route: str  # alias | local | source | destination | device_put | collective
  src: jax.ShapeDtypeStruct  # shape, source dtype and sharding
  dtype: Any  # destination dtype
  mid_src: NamedSharding
  mid_dst: NamedSharding
  dst: NamedSharding
  nbytes: int  # destination bytes of the global array
  shipped: int  # bytes copied from source devices to destination devices


@dataclasses.dataclass(frozen=True)
class Bucket:
  leaves: tuple[int, ...]  # flat leaf indices, tree order
  nbytes: int  # destination bytes
  cast: Callable  # compiled [src] -> [mid_src]
  compare: Callable | None  # compiled ([src], [last sent]) -> changed (delta mode)
  post: Callable | None  # compiled [mid_dst] -> [dst] for the leaves at `post_at`
  post_at: tuple[int, ...]


def _on(devices, like: NamedSharding) -> NamedSharding:
  """`like`'s layout on `devices` (k times as many as like's mesh: k copies on an extra trailing axis)."""
  k = len(devices) // like.mesh.size
  extra = (k,) if k > 1 else ()
  names = like.mesh.axis_names + (("_copies",) if k > 1 else ())
  grid = np.asarray(devices, dtype=object).reshape(like.mesh.devices.shape + extra)
  return NamedSharding(Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names)), like.spec)


def _device_bytes(sharding: NamedSharding, shape, itemsize: int) -> dict[int, int]:
  """Bytes each device holds of an array with this sharding (replicas count on every holder)."""
  out = {}
  for device, index in sharding.devices_indices_map(tuple(shape)).items():
    out[device.id] = itemsize * math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
  return out


def plan_leaf(src: jax.ShapeDtypeStruct, dst: NamedSharding, dst_dtype, route: str = "auto") -> LeafPlan:
  """The route of one leaf, with its intermediate layouts and byte counts."""
  if not isinstance(src.sharding, NamedSharding) or not isinstance(dst, NamedSharding):
    raise TypeError(f"weight sync needs NamedShardings on both sides, got {src.sharding} -> {dst}")
  floating = jnp.issubdtype(src.dtype, jnp.floating)
  dtype = jnp.dtype(dst_dtype if dst_dtype is not None and floating else src.dtype)
  per_dst = lambda s: sum(_device_bytes(s, src.shape, dtype.itemsize).values())  # bytes over dst-many shards
  leaf = functools.partial(LeafPlan, src=src, dtype=dtype, dst=dst, nbytes=math.prod(src.shape) * dtype.itemsize)
  s_dev, d_dev = list(src.sharding.mesh.devices.flat), list(dst.mesh.devices.flat)
  if dtype == src.dtype and src.sharding.is_equivalent_to(dst, len(src.shape)):
    return leaf(route="alias", mid_src=dst, mid_dst=dst, shipped=0)
  if s_dev == d_dev:
    return leaf(route="local", mid_src=dst, mid_dst=dst, shipped=0)
  if jax.process_count() > 1 and not set(s_dev) & set(d_dev):
    if len(s_dev) != len(d_dev):  # JAX's condition for moving shards between processes
      raise ValueError(f"multi-process weight sync needs equal device counts per side: {len(s_dev)} -> {len(d_dev)}")
    if len(s_dev) == 1 and s_dev[0].platform == "cpu":
      # Measured 2026-11-29 (jax 0.10.2): the run's first rollout program then dies in a segfault on the trainer's
      # process (sync_check's transfer alone passes); cause not found. Refused here rather than crash.
      raise ValueError("a trainer and a rollout of one CPU device each, in different processes, crash XLA:CPU's "
                       "runtime in the first rollout: give each side 2 or more devices (e.g. local_multiprocess.py "
                       "--devices_per_process=2 with topology.trainer.fsdp=2 and topology.rollout.data=2)")
    return leaf(route="collective", mid_src=src.sharding, mid_dst=dst, shipped=math.prod(src.shape) * dtype.itemsize)
  options = {}
  if route in ("auto", "source") and len(s_dev) % len(d_dev) == 0:
    options["source"] = (_on(s_dev, dst), dst, per_dst(dst))
  if route in ("auto", "destination") and len(d_dev) % len(s_dev) == 0:
    mid = _on(d_dev, src.sharding)
    options["destination"] = (src.sharding, mid, per_dst(mid))
  if route == "device_put" or (route == "auto" and not options):
    options["device_put"] = (src.sharding, dst, per_dst(dst))
  if not options:
    raise ValueError(f"route={route!r} cannot move {len(s_dev)} source shards to {len(d_dev)} devices; "
                     "use 'auto' or 'device_put'")
  name = min(options, key=lambda k: options[k][2])
  mid_src, mid_dst, shipped = options[name]
  return leaf(route=name, mid_src=mid_src, mid_dst=mid_dst, shipped=shipped)


def _group(sizes: list[tuple[int, int]], limit: int) -> list[list[int]]:
  """Consecutive (index, bytes) into groups of <= limit bytes; a larger item is a group of its own."""
  groups, current, total = [], [], 0
  for i, n in sizes:
    if current and total + n > limit:
      groups.append(current)
      current, total = [], 0
    current.append(i)
    total += n
  return groups + ([current] if current else [])


def _collective(xs: list, leaves: list[LeafPlan]) -> list:
  """A bucket across process boundaries, one packed transfer per destination dtype."""
  out = [None] * len(xs)
  for dtype in dict.fromkeys(leaf.dtype for leaf in leaves):
    idx = [j for j, leaf in enumerate(leaves) if leaf.dtype == dtype]
    for j, z in zip(idx, crossproc.transfer_bucket([xs[j] for j in idx], [leaves[j].dst for j in idx], dtype),
                    strict=True):
      out[j] = z
  return out


def _bits(x: jax.Array) -> jax.Array:
  floating = jnp.issubdtype(x.dtype, jnp.floating)
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")) if floating else x


class TransferPlan:
  """A compiled, bucketed transfer from one pytree layout to another; build once, `run` every step."""

  def __init__(self, treedef, leaves: list[LeafPlan], bucket_bytes: int, mode: str):
    self.treedef, self.leaves, self.mode, self.bucket_bytes = treedef, leaves, mode, bucket_bytes
    self.n_traces = 0  # bumped inside traced functions: constant after build means no retracing
    self._compiled: dict[tuple, tuple] = {}  # bucket signature -> executables (repeated layers share them)
    moved = [i for i, leaf in enumerate(leaves) if leaf.route != "alias"]
    self.buckets = [self._bucket(g) for g in _group([(i, leaves[i].nbytes) for i in moved], bucket_bytes)]
    self.bytes_total = sum(leaves[i].nbytes for i in moved)
    self.bytes_shipped = sum(leaf.shipped for leaf in leaves)
    self.bytes_per_device: dict[int, int] = {}
    for i in moved:
      for dev, n in _device_bytes(leaves[i].dst, leaves[i].src.shape, leaves[i].dtype.itemsize).items():
        self.bytes_per_device[dev] = self.bytes_per_device.get(dev, 0) + n
    self._last: list[Any] | None = None  # delta mode: last-sent cast values per bucket, on the source

  @classmethod
  def build(cls, src_abstract, dst_shardings, *, dst_dtype=jnp.bfloat16, bucket_bytes: int = 64 * 2**20,
            mode: str = "full", route: str = "auto") -> TransferPlan:
    """`src_abstract`: ShapeDtypeStructs with shardings (or the live source arrays); `dst_shardings`: same tree."""
    if mode not in MODES or route not in ROUTES:
      raise ValueError(f"mode={mode!r} route={route!r}; expected a mode in {MODES} and a route in {ROUTES}")
    if bucket_bytes <= 0:
      raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    src, treedef = jax.tree.flatten(src_abstract)
    dst, dst_def = jax.tree.flatten(dst_shardings)
    if treedef != dst_def:
      raise ValueError(f"dst_shardings do not match the source tree:\n  source: {treedef}\n  dest:   {dst_def}")
    if mode == "lora":
      _check_adapters(src_abstract)
      dst_dtype = None  # adapters are tiny: keep fp32, merge in fp32 on the destination
    src = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in src]
    return cls(treedef, [plan_leaf(x, s, dst_dtype, route) for x, s in zip(src, dst, strict=True)],
               bucket_bytes, mode)

  def _bucket(self, index: list[int]) -> Bucket:
    leaves = [self.leaves[i] for i in index]
    key = tuple((leaf.route, leaf.src, leaf.dtype, leaf.mid_src, leaf.mid_dst, leaf.dst) for leaf in leaves)
    if key not in self._compiled:
      self._compiled[key] = self._compile(leaves)
    post_at = tuple(j for j, leaf in enumerate(leaves) if leaf.route == "destination")
    return Bucket(tuple(index), sum(leaf.nbytes for leaf in leaves), *self._compiled[key], post_at)

  def _compile(self, leaves: list[LeafPlan]) -> tuple:
    """(cast, compare, post) compiled ahead of time, so `run` can neither trace nor compile."""
    def cast(xs):
      self.n_traces += 1
      return [x.astype(leaf.dtype) for x, leaf in zip(xs, leaves, strict=True)]

    def compare(xs, last):  # bitwise, so -0.0 vs 0.0 and NaN payloads count as changes
      self.n_traces += 1
      diffs = [jnp.any(_bits(x.astype(leaf.dtype)) != _bits(y)) for x, y, leaf in zip(xs, last, leaves, strict=True)]
      return functools.reduce(jnp.logical_or, diffs)

    def identity(xs):
      self.n_traces += 1
      return xs

    def aot(fn, out, *args):
      return jax.jit(fn, out_shardings=out).lower(*args).compile()

    src = [leaf.src for leaf in leaves]
    cast_fn = aot(cast, [leaf.mid_src for leaf in leaves], src)
    compare_fn = None
    if self.mode == "delta":
      mid = [jax.ShapeDtypeStruct(leaf.src.shape, leaf.dtype, sharding=leaf.mid_src) for leaf in leaves]
      compare_fn = aot(compare, NamedSharding(leaves[0].src.sharding.mesh, PartitionSpec()), src, mid)
    post = [leaf for leaf in leaves if leaf.route == "destination"]
    post_fn = post and aot(identity, [leaf.dst for leaf in post],
                           [jax.ShapeDtypeStruct(leaf.src.shape, leaf.dtype, sharding=leaf.mid_dst) for leaf in post])
    return cast_fn, compare_fn, post_fn or None

  def check(self, src_params, dst_params=None) -> tuple[list, list | None]:
    """Flat (source, destination) leaves, validated against the plan before anything is freed."""
    flat = []
    for what, tree in (("src_params", src_params), ("dst_params", dst_params)):
      leaves, treedef = jax.tree.flatten(tree)
      if tree is not None and treedef != self.treedef:
        raise ValueError(f"{what} does not match the plan's tree:\n  plan: {self.treedef}\n  got:  {treedef}")
      flat.append(None if tree is None else leaves)
    for x, leaf in zip(flat[0], self.leaves, strict=True):
      if (x.shape, x.dtype) != (leaf.src.shape, leaf.src.dtype) or not x.sharding.is_equivalent_to(
          leaf.src.sharding, len(x.shape)):
        raise ValueError(f"source leaf {x.shape} {x.dtype} {x.sharding} differs from the plan's {leaf.src}")
    return flat[0], flat[1]

  def run(self, src_params, dst_params=None, *, on_bucket: Callable[[int], None] | None = None):
    """(new destination pytree, stats). Deletes `dst_params`' arrays bucket by bucket (pass the last result).

    `on_bucket(i)` runs when bucket i has landed, while its temporaries are still alive (its peak).
    """
    t0 = time.perf_counter()
    src, old = self.check(src_params, dst_params)
    out = [x if leaf.route == "alias" else None for x, leaf in zip(src, self.leaves, strict=True)]
    send_all = self.mode != "delta" or old is None or self._last is None
    if self.mode == "delta" and self._last is None:
      self._last = [None] * len(self.buckets)
    keep = {id(x) for x in src}
    sent = [self._run_bucket(b, bucket, src, old, out, send_all, keep, on_bucket)
            for b, bucket in enumerate(self.buckets)]
    jax.block_until_ready(out)
    sent_bytes = sum(bucket.nbytes for bucket, s in zip(self.buckets, sent, strict=True) if s)
    stats = {"bytes_sent": sent_bytes, "buckets_sent": sum(sent), "buckets_total": len(self.buckets),
             "changed_frac": sent_bytes / self.bytes_total if self.bytes_total else 0.0,
             "seconds": time.perf_counter() - t0}
    return jax.tree.unflatten(self.treedef, out), stats

  def _run_bucket(self, b: int, bucket: Bucket, src, old, out, send_all: bool, keep: set, on_bucket=None) -> bool:
    """One bucket: (delta: compare) -> free stale dst -> cast -> copy shards -> (reshard on dst). True if sent."""
    xs = [src[i] for i in bucket.leaves]
    if not send_all and not jax.device_get(bucket.compare(xs, self._last[b])):  # the one host read per bucket
      for i in bucket.leaves:
        out[i] = old[i]
      if on_bucket:
        on_bucket(b)
      return False
    if old is not None:
      for i in bucket.leaves:  # free first: extra memory stays at about one bucket
        if id(old[i]) not in keep and not old[i].is_deleted():
          old[i].delete()
    leaves = [self.leaves[i] for i in bucket.leaves]
    if leaves[0].route == "collective":
      ys = bucket.cast(xs) if self.mode == "delta" else None
      zs = _collective(xs, leaves)
    else:
      ys = bucket.cast(xs)
      zs = jax.device_put(ys, [leaf.mid_dst for leaf in leaves])
    if bucket.post is not None:
      for j, z in zip(bucket.post_at, bucket.post([zs[j] for j in bucket.post_at]), strict=True):
        zs[j] = z
    for i, z in zip(bucket.leaves, zs, strict=True):
      out[i] = z
    if self.mode == "delta":
      self._last[b] = ys
    if on_bucket:
      on_bucket(b)
    return True

  def describe(self) -> str:
    routes = {r: sum(leaf.route == r for leaf in self.leaves) for r in dict.fromkeys(x.route for x in self.leaves)}
    per_dev = max(self.bytes_per_device.values(), default=0)
    return (f"TransferPlan mode={self.mode} leaves={len(self.leaves)} routes={routes} buckets={len(self.buckets)}"
            f"x<={self.bucket_bytes / 2**20:g}MiB bytes_total={self.bytes_total:,} shipped={self.bytes_shipped:,} "
            f"max_per_device={per_dev:,} devices={len(self.bytes_per_device)}")


def _check_adapters(adapters) -> None:
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]]
  bad = [p for p in paths if not (p.endswith("['a']") or p.endswith("['b']"))]
  if bad or not paths:
    raise ValueError(f"mode='lora' takes the LoRA adapter dict ({{name: {{'a', 'b'}}}}); unexpected leaves {bad[:3]}")


def replicated(tree, mesh: Mesh):
  """A fully replicated NamedSharding per leaf: the destination layout for LoRA adapters."""
  return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)


@functools.lru_cache(maxsize=16)
def _merge_fn(lora_cfg, treedef, shardings: tuple):
  merge = lambda base, adapters: merge_lora(base, adapters, lora_cfg)
  return jax.jit(merge, out_shardings=jax.tree.unflatten(treedef, shardings))


def merge_on_destination(base_dst, adapters_dst, lora_cfg):
  """W + (alpha/r) A B on the destination mesh, laid out like `base_dst`; the base copy is kept."""
  leaves, treedef = jax.tree.flatten(base_dst)
  return _merge_fn(lora_cfg, treedef, tuple(x.sharding for x in leaves))(base_dst, adapters_dst)


class WeightSyncError(RuntimeError):
  """A sync failed part-way; the previous weights were partly freed and are now invalid."""


@dataclasses.dataclass
class VersionedWeights:
  """Rollout weights tagged with the trainer version they came from; params None = invalid."""

  params: Any
  gen_id: int
  stats: dict = dataclasses.field(default_factory=dict)


def sync(plan: TransferPlan, src_params, current: VersionedWeights, new_gen_id: int) -> VersionedWeights:
  """The weights of version `new_gen_id`, returned only once every bucket has landed; never a mix.

  `current` is superseded either way (its arrays are freed bucket by bucket): on failure its params
  become None and WeightSyncError is raised, so nothing can sample from half-updated weights.
  """
  if new_gen_id <= current.gen_id:
    raise ValueError(f"gen_id must increase: current {current.gen_id}, new {new_gen_id}")
  plan.check(src_params, current.params)  # bad input: a clear error, and `current` stays valid
  try:
    params, stats = plan.run(src_params, current.params)
    jax.block_until_ready(params)
  except Exception as e:
    current.params = None
    raise WeightSyncError(f"weight sync to gen_id {new_gen_id} failed; the gen_id {current.gen_id} weights "
                          "were partly freed and are now invalid (sync again to recover)") from e
  current.params = None
  return VersionedWeights(params=params, gen_id=new_gen_id, stats=stats)
