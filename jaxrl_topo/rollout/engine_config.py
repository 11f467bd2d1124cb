"""EngineConfig: the rollout engine's static sizes and its chunking knobs (engine.py, scheduler.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxrl_topo.rollout.host_state import _pow2
from jaxrl_topo.rollout.paged import check_read
from jaxrl_topo.rollout.requests import token_ids
from jaxrl_topo.rollout.sampling import SamplingConfig
from jaxrl_topo.runtime.dataclass_io import check_types

KV_DTYPES = ("float32", "bfloat16", "float16")  # what the KV pool may hold
UPDATE_POLICIES = ("keep_kv", "finish_on_old", "abort_and_resume")  # RolloutEngine.update_weights


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  n_slots: int = 8  # decode rows
  page_size: int = 16
  n_pages: int = 256  # pages per layer in the pool
  max_len: int = 512  # prompt + completion tokens per sequence
  decode_chunk: int = 8  # decode steps per generate() call (K); run() admits with pages for this many ahead
  min_bucket: int = 16  # prompts are padded to a power of two >= this
  # paged decode read (paged.py); auto = window on CPU, the Pallas kernel on GPU where it works, else bucketed
  impl: str = "auto"
  # impl "window": no window (or read) narrower than this many tokens, so a config compiles fewer window programs
  # (one per width: at 4-token pages and 64-token rows, one instead of five); 0 = bucketed's widths from 1 page
  min_window_tokens: int = 64
  # impl "pallas": programs each row's page walk is divided over (pallas_paged.decode_attention's splits); 0 = the
  # kernel's default
  pallas_splits: int = 0
  sampling: SamplingConfig = SamplingConfig(greedy=True)
  eos_ids: tuple[int, ...] = ()  # one int is read as one id; a list becomes a tuple
  pad_id: int = 0
  kv_dtype: str | None = None  # KV pool dtype; None = the model's compute dtype
  overlap: bool = True  # run(): dispatch chunk k+1 before reading chunk k (scheduler.py)
  tail_chunk: int = 0  # run(): steps per chunk (0 = 4 x decode_chunk); ends early for waiting requests
  # run() with nobody watching chunk boundaries (no on_chunk, no episodes, no pending update): a chunk
  # doubles from tail_chunk up to this many steps while the longest live row needs it and the pool has
  # the pages (0 = never past tail_chunk). Chunk lengths are traced: they share one program
  max_chunk: int = 256
  # run(): the live rows of a chunk are packed into a power-of-two batch per shard, no smaller than this (at most
  # all of a shard's slots); each size met is a decode program to compile. Raise it where compiles cost more than
  # the smaller batches save (on the CPU's tiny long-tail workload, 8 instead of 2 ran 10-20% slower at batches 4
  # and 16: benchmarks/RESULTS.md). At least 2: XLA:CPU computes a 1-row matmul on another path, and a row's bits
  # must not follow the rows beside it.
  min_pack_rows: int = 2

  def __post_init__(self):
    check_types("EngineConfig", self)  # the scalar fields' types (n_slots=8.0 would fail deep in a jit)
    for name in ("n_slots", "page_size", "n_pages", "max_len", "decode_chunk", "min_bucket"):
      if getattr(self, name) <= 0:
        raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be positive")
    check_read(self.impl, "EngineConfig.impl")
    if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
      raise ValueError(f"EngineConfig.kv_dtype={self.kv_dtype!r}; expected one of {KV_DTYPES} or None")
    for name, zero in (("min_window_tokens", "no floor"), ("pallas_splits", "the kernel's default"),
                       ("tail_chunk", "4 x decode_chunk"), ("max_chunk", "chunks never grow")):
      if getattr(self, name) < 0:
        raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be >= 0 (0: {zero})")
    if self.min_pack_rows < 2:
      raise ValueError(f"EngineConfig.min_pack_rows={self.min_pack_rows} must be >= 2")
    object.__setattr__(self, "eos_ids", token_ids(self.eos_ids, "EngineConfig.eos_ids"))

  @property
  def max_pages_per_seq(self) -> int:
    return -(-self.max_len // self.page_size)

  @property
  def window_min_pages(self) -> int:
    """impl "window": the narrowest window and read, min_window_tokens' pages rounded up to a power of two (one of
    bucketed's widths), at most max_pages_per_seq."""
    return min(self.max_pages_per_seq, _pow2(-(-self.min_window_tokens // self.page_size)))

  @property
  def tail_steps(self) -> int:
    return self.tail_chunk or 4 * self.decode_chunk

  @property
  def chunk_capacity(self) -> int:
    """Rows of a chunk's outputs: the longest chunk the engine dispatches (every length runs one program)."""
    return max(self.decode_chunk, self.tail_steps, self.max_chunk)


# The rollout config section's keys that are EngineConfig fields of the same name and meaning (runtime/sections.py).
SHARED_FIELDS = ("n_slots", "page_size", "decode_chunk", "min_bucket", "kv_dtype", "min_window_tokens", "pallas_splits",
                 "min_pack_rows", "tail_chunk", "max_chunk", "overlap")


def check_fields(values: Mapping[str, Any], prefix: str) -> None:
  """EngineConfig's own checks of `values` (fields by name), its errors naming each field `prefix` + name: a config
  section that holds engine fields is checked by the same code as the engine, when it is built."""
  try:
    EngineConfig(**values)
  except (ValueError, TypeError) as e:
    raise type(e)(str(e).replace("EngineConfig.", prefix)) from None


def check_fits_model(ecfg: EngineConfig, cfg) -> None:
  """Refuses a max_len past the model's position limit (ModelConfig.max_position, config.json's
  max_position_embeddings; no check where it is None). A max_len the limit rounded up to a page passes: a run's
  prompt + completion tokens rounded to pages; `check_requests` holds every request to the limit itself."""
  limit = getattr(cfg, "max_position", None)
  if limit and ecfg.max_len > -(-limit // ecfg.page_size) * ecfg.page_size:
    raise ValueError(f"EngineConfig.max_len={ecfg.max_len} > the model's position limit {limit} "
                     f"(max_position_embeddings): lower max_len to {limit} or less")


def check_update(old, new, policy: str) -> None:
  """RolloutEngine.update_weights' `policy`, and its `new` params against the engine's `old` ones from metadata only
  (nothing is read or waited for): the same tree, each leaf's shape and dtype, an array on the same devices. The
  first difference is a ValueError naming the leaf's path."""
  if policy not in UPDATE_POLICIES:
    raise ValueError(f"update policy {policy!r}; expected one of {UPDATE_POLICIES}")
  if old is None:  # the engine's weights were handed away (mux): nothing to compare
    return
  have, got = ({jax.tree_util.keystr(p) or "(the root)": x for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
               for t in (old, new))
  for path, a in have.items():
    if path not in got:
      raise ValueError(f"update_weights: the new params lack {path}")
    b = got[path]
    meta = [(getattr(x, "shape", None), getattr(x, "dtype", None)) for x in (a, b)]
    if meta[0] != meta[1]:
      raise ValueError(f"update_weights: {path} is {_spell(*meta[1])} in the new params, {_spell(*meta[0])} in the "
                       "engine's")
    if isinstance(a, jax.Array) and isinstance(b, jax.Array) and a.sharding.device_set != b.sharding.device_set:
      raise ValueError(f"update_weights: {path} lies on devices {_ids(b)} in the new params, on {_ids(a)} in the "
                       "engine's: put them on the engine's devices (e.g. jax.device_put(params, shardings))")
    if isinstance(a, jax.Array) and isinstance(b, jax.Array) and not a.sharding.is_equivalent_to(b.sharding, a.ndim):
      raise ValueError(f"update_weights: {path} is laid out as {b.sharding} in the new params, {a.sharding} in the "
                       "engine's (every generate program would compile again): put them in the engine's layout "
                       "(e.g. jax.device_put(params, jax.tree.map(lambda x: x.sharding, engine.params)))")
  extra = [path for path in got if path not in have]
  if extra:
    raise ValueError(f"update_weights: the new params hold {extra[0]}, which the engine's do not")


def check_on_mesh(params, mesh: jax.sharding.Mesh | None) -> None:
  """RolloutEngine's `params` on its `mesh`'s devices (each array placed on devices, not left to the default one):
  else every generate program fails at the first call, in JAX's words. The first leaf elsewhere is a ValueError."""
  if mesh is None:
    return
  want = set(mesh.devices.flat)
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if isinstance(x, jax.Array) and x.committed and x.sharding.device_set != want:
      raise ValueError(f"RolloutEngine: params{jax.tree_util.keystr(path)} lies on devices {_ids(x)}, the engine's "
                       f"mesh on {sorted(d.id for d in want)}: load or put the params on the rollout mesh (e.g. "
                       "hf_io.load_model(path, mesh, ROLLOUT_RULES) or a TransferPlan from the trainer's layout)")


def _spell(shape, dtype) -> str:
  return f"{dtype} {list(shape)}" if shape is not None else f"{dtype} (no shape)"


def _ids(x: jax.Array) -> list[int]:
  return sorted(d.id for d in x.sharding.device_set)


def engine_options(options: Mapping[str, Any] | None, set_by_caller: Sequence[str], who: str) -> dict[str, Any]:
  """`options` checked before any work: EngineConfig fields by name that `who` (generation, serving) leaves to its
  user, i.e. none of `set_by_caller`; their values go through EngineConfig's own checks."""
  options = dict(options or {})
  free = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in set_by_caller]
  names = {f.name for f in dataclasses.fields(EngineConfig)}
  unknown = sorted(set(options) - names)
  if unknown:
    raise ValueError(f"engine options {unknown}: no such EngineConfig field; {who} takes {free}")
  taken = sorted(set(options) - set(free))
  if taken:
    raise ValueError(f"engine options {taken}: {who} sets {list(set_by_caller)} itself; the others are {free}")
  dataclasses.replace(EngineConfig(), **options)  # raises here, with the field's name, on a bad value
  return options
