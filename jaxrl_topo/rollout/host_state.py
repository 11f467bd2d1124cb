"""Host-side records of the rollout engine (engine.py): the slot mirror, pending weights, admission
waves and dispatched-but-unread device results. Plain data; the logic lives in engine.py."""

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
