"""What the host sends with `device.prefill` and `device.patch`: small int32 row arrays, packed per data shard.

With D data shards (kv_pool.py) an array of R rows is D equal parts, part d holding shard d's rows
(device.py runs each part on its shard): a slot's row goes into its shard's part, with the slot index
local to the shard (slots_per_shard = padding, dropped); page ids stay global (the device makes them
local). With D = 1 this is one part and local = global. Sizes are powers of two or fixed multiples
of the slot count, so the device functions compile a bounded number of times.
Alphabet: B slots, G prompts, N sample rows, C page copies, X stop ids, M pages per slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl_topo.rollout.host_state import _pow2, _Wave
from jaxrl_topo.rollout.kv_pool import PagePool


def _rows_in_parts(shards: Sequence[int], per_part: int) -> list[int]:
  """Row of each item, in order, in its shard's part (part d = rows [d * per_part, (d + 1) * per_part))."""
  used: dict[int, int] = {}
  rows = []
  for d in shards:
    rows.append(d * per_part + used.get(d, 0))
    used[d] = used.get(d, 0) + 1
  return rows


def patch_arrays(pool: PagePool, rows: dict[int, tuple], copies: dict[int, tuple[int, int]], n_stop_ids: int):
  """(src_C, dst_C, slot_N, last_N, pos_N, seq_N, left_N, active_N, stop_NX) for `device.patch`:
  rows[slot] = (last, pos, seq, left, active, stop ids), copies[slot] = (src page, dst page); at most
  one of each per slot, so B rows hold them (a shard's part holds its B/D slots)."""
  B, Bd = pool.n_slots, pool.slots_per_shard
  slot_N, vals_5N = np.full((B,), Bd, np.int32), np.zeros((5, B), np.int32)
  stop_NX = np.full((B, n_stop_ids), -1, np.int32)
  items = sorted(rows.items())
  for n, (slot, row) in zip(_rows_in_parts([s // Bd for s, _ in items], Bd), items, strict=True):
    slot_N[n], vals_5N[:, n] = slot % Bd, row[:5]
    stop_NX[n, : len(row[5])] = row[5]
  src_C, dst_C = np.zeros((B,), np.int32), np.full((B,), pool.n_pages, np.int32)  # dst = n_pages: no copy
  pairs = sorted(copies.items())
  for c, (_, (src, dst)) in zip(_rows_in_parts([s // Bd for s, _ in pairs], Bd), pairs, strict=True):
    src_C[c], dst_C[c] = src, dst
  return src_C, dst_C, slot_N, *vals_5N[:4], vals_5N[4].astype(bool), stop_NX


def _part_size(waves: Sequence[_Wave], shard_w: Sequence[int], n_shards: int, count) -> int:
  """The most `count(wave)` summed over one shard's waves."""
  per = [0] * n_shards
  for w, d in zip(waves, shard_w, strict=True):
    per[d] += count(w)
  return max(per)


def prefill_width(pool: PagePool, waves: Sequence[_Wave], T: int) -> int:
  """Page-table columns a prefill wave of bucket T attends over. New prompts (start 0) see only their own
  T positions, so ceil(T / S) pages rounded up to a power of two instead of all M: the prefill's attention
  then costs T x T, not T x max_len (Qwen2.5 prompts of 128 tokens in 2,176-token slots read 8 pages, not
  136). A wave that continues a slot (an episode's next turn, start > 0) attends to its earlier positions
  too and keeps all M. So a bucket compiles once for new prompts and, in multi-turn runs, once more for
  continuations (at most two widths per bucket; before, one)."""
  M = pool.max_pages_per_seq
  if any(w.start for w in waves):
    return M
  return min(M, _pow2(-(-T // pool.page_size)))


def prefill_arrays(pool: PagePool, waves: Sequence[_Wave], T: int, pad_id: int, n_stop_ids: int, epoch_B, gen_id: int):
  """The row arrays of `device.prefill` for one prompt-length bucket T, and rows: {sample row n: (slot
  or n_slots (no slot yet), slot epoch or (seq id, pin id), gen_id)} to read its first token back."""
  B, D, Bd = pool.n_slots, pool.n_shards, pool.slots_per_shard
  shard_w = [pool.shard_of_slot(w.slots[0]) for w in waves]  # a group's slots share one shard
  Gd = _pow2(_part_size(waves, shard_w, D, lambda w: 1))
  rows_d = _part_size(waves, shard_w, D, lambda w: len(w.slots) + len(w.later))
  Nd = Bd if rows_d <= Bd else max(Bd + B, _pow2(rows_d))  # slotted rows <= B/D, later ones < B
  Cd = _pow2(max(1, _part_size(waves, shard_w, D, lambda w: len(w.copies))))
  tokens_GT, lengths_G = np.full((D * Gd, T), pad_id, np.int32), np.ones((D * Gd,), np.int32)
  start_G = np.zeros((D * Gd,), np.int32)
  table_GM = np.full((D * Gd, prefill_width(pool, waves, T)), -1, np.int32)
  src_C, dst_C = np.zeros((D * Cd,), np.int32), np.full((D * Cd,), pool.n_pages, np.int32)
  prompt_N, slot_N = np.zeros((D * Nd,), np.int32), np.full((D * Nd,), Bd, np.int32)
  seq_N, left_N = np.zeros((2, D * Nd), np.int32)
  stop_NX = np.full((D * Nd, n_stop_ids), -1, np.int32)
  g_w = _rows_in_parts(shard_w, Gd)
  n_rows = iter(_rows_in_parts([d for w, d in zip(waves, shard_w, strict=True) for _ in (*w.slots, *w.later)], Nd))
  c_rows = iter(_rows_in_parts([d for w, d in zip(waves, shard_w, strict=True) for _ in w.copies], Cd))
  rows = {}
  for w, d, g in zip(waves, shard_w, g_w, strict=True):
    tokens_GT[g, : len(w.prompt_ids)], lengths_G[g] = w.prompt_ids, len(w.prompt_ids)
    table_GM[g] = w.table_M[: table_GM.shape[1]]
    start_G[g] = w.start
    for src, dst in w.copies:
      c = next(c_rows)
      src_C[c], dst_C[c] = src, dst
    for slot, sid, tag in [*((s, i, None) for s, i in zip(w.slots, w.seq_ids, strict=True)),
                           *((B, i, (i, pin)) for i, pin in w.later)]:
      n = next(n_rows)
      prompt_N[n], slot_N[n], seq_N[n], left_N[n] = g - d * Gd, slot % Bd if slot < B else Bd, sid, w.max_new_tokens - 1
      stop_NX[n, : len(w.stop_ids)] = w.stop_ids
      rows[n] = (slot, int(epoch_B[slot]) if slot < B else tag, gen_id)
  return (tokens_GT, lengths_G, start_G, table_GM, src_C, dst_C, prompt_N, slot_N, seq_N, left_N, stop_NX), rows
