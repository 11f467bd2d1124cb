"""EngineConfig: the rollout engine's static sizes and its chunking knobs (engine.py, scheduler.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_topo.rollout.host_state import _pow2
from jaxrl_topo.rollout.sampling import SamplingConfig

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
  sampling: SamplingConfig = SamplingConfig(greedy=True)
  eos_ids: tuple[int, ...] = ()
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
    for name in ("n_slots", "page_size", "n_pages", "max_len", "decode_chunk", "min_bucket"):
      if getattr(self, name) <= 0:
        raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be positive")
    if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
      raise ValueError(f"EngineConfig.kv_dtype={self.kv_dtype!r}; expected one of {KV_DTYPES} or None")
    if self.min_window_tokens < 0:
      raise ValueError(f"EngineConfig.min_window_tokens={self.min_window_tokens} must be >= 0")
    if self.min_pack_rows < 2:
      raise ValueError(f"EngineConfig.min_pack_rows={self.min_pack_rows} must be >= 2")
    if self.tail_chunk < 0 or self.max_chunk < 0:
      raise ValueError(f"EngineConfig.tail_chunk={self.tail_chunk} and max_chunk={self.max_chunk} must be >= 0")

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


def engine_options(options: Mapping[str, Any] | None, set_by_caller: Sequence[str], who: str) -> dict[str, Any]:
  """`options` checked before any work: EngineConfig fields by name that `who` (generation, serving) leaves to its
  user, i.e. none of `set_by_caller`; their values go through EngineConfig's own checks."""
  options = dict(options or {})
  free = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in set_by_caller]
  unknown = sorted(set(options) - set(free))
  if unknown:
    raise ValueError(f"engine options {unknown}: {who} sets {list(set_by_caller)} itself; the others are {free}")
  dataclasses.replace(EngineConfig(), **options)  # raises here, with the field's name, on a bad value
  return options
