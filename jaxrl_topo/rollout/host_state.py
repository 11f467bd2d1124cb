"""Host-side records of the rollout engine (engine.py): the slot mirror, pending weights, admission
waves and dispatched-but-unread device results; and two pure functions of them, the "window" read's width
for the next chunk and a read chunk's occupancy counts. The engine's logic lives in engine.py."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrl_topo.rollout.requests import MAX_STOP_IDS


@dataclasses.dataclass
class _SlotMirror:
  """The host's view of the per-slot device arrays, as of the last chunk read (admitted slots not
  yet read are assumed live). Kept from the chunk outputs; never read back from the state."""

  last_B: np.ndarray
  pos_B: np.ndarray
  seq_B: np.ndarray
  left_B: np.ndarray
  active_B: np.ndarray
  stop_BX: np.ndarray

  @classmethod
  def zeros(cls, n_slots: int) -> _SlotMirror:
    z = lambda: np.zeros((n_slots,), np.int32)  # noqa: E731
    return cls(z(), z(), z(), z(), np.zeros((n_slots,), bool), np.full((n_slots, MAX_STOP_IDS), -1, np.int32))


@dataclasses.dataclass
class _Pending:
  params: object
  gen_id: int
  policy: str


@dataclasses.dataclass
class _Wave:
  """An admitted group waiting for its prefill: its slots' first tokens come back with a chunk."""

  prompt_ids: list[int]
  slots: list[int]
  seq_ids: list[int]
  max_new_tokens: int
  stop_ids: tuple[int, ...]
  copies: list[tuple[int, int]]
  table_M: np.ndarray  # the prompt's pages (and the first slot's decode pages)
  later: list[tuple[int, int]]  # (seq id, pin id) of samples sampled now, started later from the pin
  start: int = 0  # position of prompt_ids[0]: > 0 continues a slot's pages (an episode's next turn)


@dataclasses.dataclass
class _Dispatched:
  """Device results not yet read: first tokens of prefills (rows -> (slot, epoch, gen_id)) and a chunk."""

  firsts: list[tuple[jax.Array, jax.Array, list[tuple[int, int, int]]]]
  chunk: tuple | None = None  # (tokens_KB, logprobs_KB, emitted_KB, active_B); K = chunk_capacity
  epoch_B: np.ndarray | None = None
  gen_id: int = 0
  queued: bool = False  # requests were waiting for slots when it was dispatched
  rows: int = 0  # rows each step of the chunk computed (live rows packed; all slots when not packed)
  steps: int = 0  # decode steps the chunk was dispatched for (its outputs have EngineConfig.chunk_capacity rows)
  window: int = 0  # impl "window": its window's pages (a live row ends the chunk at their edge)
  live_B: np.ndarray | None = None  # the host's live slots when it was dispatched (a superset of the device's)
  floored: bool = False  # it also ends once a shard's live rows fall below a floor > 1 (generate's live_floor_D)


def _pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def window_pages(host: _SlotMirror, lengths_B: np.ndarray, epoch_B: np.ndarray, after: _Dispatched | None,
                 page_size: int, max_pages: int, min_pages: int = 1) -> int:
  """impl "window": pages, a power of two (at most max_pages, at least min_pages: PagedKVCache.window_min_pages),
  holding the next position any row can write.
  A bound from the host's counts (`lengths_B`: every slot's tokens so far): a row live in the unread chunk
  `after` may be up to its steps further on, but no further than that chunk's own window (its guard stops rows
  at the edge). The chunk ends when a live row outgrows the window (device.generate), and the next one opens
  twice as wide. Never wider than that: the steps at the window's own width read it with no `lax.switch`
  (paged.py), and a window twice the width the rows need ran fixed-length decode up to 1.17x slower than
  ending the chunk at the edge (benchmarks/RESULTS.md; tests/test_engine_chunks.py checks the widths chosen)."""
  S, M, h = page_size, max_pages, host
  ahead, edge, ran = 0, 0, np.zeros(len(h.active_B), bool)
  if after is not None:  # rows live in it (same sequence still in the slot) advance at most its steps, to its edge
    ahead, edge = after.steps, after.window * S or np.iinfo(np.int32).max
    ran = (epoch_B == after.epoch_B) & after.live_B
  after_B = np.where(ran, np.maximum(lengths_B, np.minimum(lengths_B + ahead, edge)), lengths_B)
  return min(M, max(min_pages, _pow2(int(after_B.max()) // S + 1)))


def count_chunk(stats, emitted_KB: np.ndarray, d: _Dispatched, n_slots: int) -> None:
  """Adds a read chunk's counts to the engine's `stats` (a Counter): chunks, slot-steps that emitted, slot-steps
  and row-steps the loop ran (it stops at the first step with no live row), and their share while requests waited."""
  busy = int(emitted_KB.sum())  # slot-steps that emitted (a discarded row's too)
  run_steps = int(emitted_KB.any(axis=1).sum())
  stats["chunks"] += 1
  stats["busy_steps"] += busy
  stats["slot_steps"] += run_steps * n_slots
  stats["row_steps"] += run_steps * d.rows  # what the steps computed: live rows, packed
  if d.queued:  # admission's share: occupancy while requests were waiting for a slot
    stats["busy_steps_queued"] += busy
    stats["slot_steps_queued"] += run_steps * n_slots
