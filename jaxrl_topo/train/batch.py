"""The trainer's batch: model rows (padded or packed) plus a sequence view for the RL math.

Two layouts of the same data live side by side:
  model rows   tokens/positions/segment_ids [M, R, S]: M microbatches of R rows of S tokens. A row
               holds one sequence (padded) or several (packed, segment ids 1, 2, ...; 0 = padding).
  sequences    [M, B, T]: B sequences per microbatch, T response tokens each, with `gather_MBT`
               pointing at the row position r*S + s whose logits predict response token t.
The loss gathers per-token log-probs from rows into the sequence view, so every RL function works
on plain [B, T] arrays and packing never reaches the algorithm code. Sequences are group-major
(G completions of a prompt are consecutive) across the flattened [M*B] order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from flax import struct


@struct.dataclass
class TrainBatch:
  tokens_MRS: np.ndarray  # int32
  positions_MRS: np.ndarray  # int32, restart at 0 for each packed sequence
  segment_ids_MRS: np.ndarray  # int32, 0 = padding
  gather_MBT: np.ndarray  # int32 index into the microbatch's flattened [R*S] rows
  targets_MBT: np.ndarray  # int32 response tokens
  mask_MBT: np.ndarray  # float32, 1 = a response token that counts in the loss
  rewards_MB: np.ndarray  # float32 outcome reward per sequence
  sampler_logp_MBT: np.ndarray  # float32 log-probs the rollout sampled with (mu)
  old_logp_MBT: np.ndarray | None = None  # proximal/old policy; None = on-policy (this step's params)
  # Filled by the "logprobs" phase (train/step.py make_logprobs_fn) when it runs as its own program;
  # None: the train step computes what its loss needs itself.
  ref_logp_MBT: np.ndarray | None = None  # float32 reference-policy log-probs (KL)
  old_values_MBT: np.ndarray | None = None  # float32 critic values before the update (GAE, value clip)
  # float32, 1 = a response token sampled under the very weights this step starts from: the sampler-vs-
  # trainer log-prob gap (`logprob_gap/*`) is measured on these (None: every masked token)
  onpolicy_MBT: np.ndarray | None = None

  @property
  def n_micro(self) -> int:
    return self.tokens_MRS.shape[0]


@dataclasses.dataclass(frozen=True)
class Completion:
  """One sampled sequence as the trainer needs it."""

  prompt: Sequence[int]
  response: Sequence[int]
  reward: float
  sampler_logp: Sequence[float]  # one per response token
  # one per response token, 0 = not the model's (an episode's environment tokens: no loss, advantage 0);
  # empty = every token counts
  loss_mask: Sequence[float] = ()

  def __post_init__(self):
    if len(self.sampler_logp) != len(self.response):
      raise ValueError(f"sampler_logp has {len(self.sampler_logp)} entries for {len(self.response)} response tokens")
    if len(self.loss_mask) not in (0, len(self.response)):
      raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(self.response)} response tokens")
    if len(self.prompt) == 0:  # (an array prompt has no truth value)
      raise ValueError("a completion needs a non-empty prompt (the first response token is predicted from it)")


def first_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[tuple[int, int]]:
  """(row, offset) per sequence, packing the longest first into the first row with room: at most
  11/9 OPT + 6/9 rows (Dosa 2007). Rows are opened as needed; their number is max(row) + 1."""
  fill: list[int] = []
  out: list[tuple[int, int]] = [(0, 0)] * len(lengths)
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    n = lengths[i]
    if n > row_len:
      raise ValueError(f"sequence {i} has {n} tokens; rows hold {row_len}")
    row = next((r for r, f in enumerate(fill) if f + n <= row_len), len(fill))
    if row == len(fill):
      fill.append(0)
    out[i] = (row, fill[row])
    fill[row] += n
  return out


def balance_groups(group_tokens: Sequence[int], n_micro: int, minibatches: int = 1) -> list[int]:
  """A group order whose `n_micro` consecutive equal slices carry nearly equal tokens (longest group first
  into the lightest microbatch with room). Whole groups move, so the order stays group-major, and the
  loss, normalised over the global batch, does not depend on which microbatch holds which group. With
  several optimizer updates a step (`minibatches`, each on its consecutive microbatches), groups move only
  within their minibatch: each update sees the groups it would unbalanced. Groups that do not divide over
  the microbatches keep their order (a group then spans two microbatches, as in the padded layout)."""
  n = len(group_tokens)
  if n % n_micro or n_micro % minibatches:
    return list(range(n))
  per, micro_per = n // n_micro, n_micro // minibatches
  order = []
  for first in range(0, n, n // minibatches):
    load, members = [0] * micro_per, [[] for _ in range(micro_per)]
    for g in sorted(range(first, first + n // minibatches), key=lambda g: -group_tokens[g]):
      m = min((m for m in range(micro_per) if len(members[m]) < per), key=lambda m: load[m])
      members[m].append(g)
      load[m] += group_tokens[g]
    order += [g for m in members for g in sorted(m)]
  return order


def _rows_needed(lengths: Sequence[int], n_micro: int, row_len: int) -> int:
  B = len(lengths) // n_micro
  return max(max(r for r, _ in first_fit_decreasing(lengths[m * B : (m + 1) * B], row_len)) + 1
             for m in range(n_micro))


def plan_rows(lengths: Sequence[int], n_micro: int, max_row_len: int, multiple: int = 1,
              quantum: int = 64) -> tuple[int, int]:
  """(rows per microbatch, row length) for packing `lengths` (group-major, `n_micro` equal microbatches).

  Rows: the fewest, as a multiple of `multiple` (the data-parallel width), that hold every microbatch in
  rows of `max_row_len` tokens. Row length: then shrunk to the shortest multiple of `quantum` (at most
  `max_row_len`) that still holds them in that many rows, so rounding the row count up to the data-parallel
  width costs little padding. Each distinct (rows, row length) pair compiles the train step once.
  """
  rows = -(-_rows_needed(lengths, n_micro, max_row_len) // multiple) * multiple
  B = len(lengths) // n_micro
  most = max(sum(lengths[m * B : (m + 1) * B]) for m in range(n_micro))
  row_len = min(max_row_len, -(-max(max(lengths), -(-most // rows)) // quantum) * quantum)
  while row_len < max_row_len and _rows_needed(lengths, n_micro, row_len) > rows:
    row_len = min(max_row_len, row_len + quantum)
  return rows, row_len


def _place_rows(seqs: Sequence[Completion], rows: int, row_len: int, pack: bool) -> list[tuple[int, int]]:
  """(row, offset) per sequence: one row each when padding, first-fit-decreasing when packing."""
  lengths = [len(c.prompt) + len(c.response) for c in seqs]
  if pack:
    out = first_fit_decreasing(lengths, row_len)
    used = max((r for r, _ in out), default=-1) + 1
  else:
    for i, n in enumerate(lengths):
      if n > row_len:
        raise ValueError(f"sequence {i} has {n} tokens; rows hold {row_len}")
    out, used = [(i, 0) for i in range(len(seqs))], len(seqs)
  if used > rows:
    raise ValueError(f"{len(seqs)} sequences do not fit {rows} rows of {row_len} tokens"
                     f" ({'packed' if pack else 'one per row'}); raise rows or row_len")
  return out


def _check_completion(i: int, c: Completion, old) -> None:
  """Its old log-probs match the response (Completion checks its own fields), and its reward is a number (None
  became a NaN reward). A NaN or infinite reward passes: the step rejects it and counts the rejection."""
  if old is not None and len(old) != len(c.response):
    raise ValueError(f"sequence {i}: old_logp has {len(old)} entries for {len(c.response)} response tokens")
  try:
    float(c.reward)
  except (TypeError, ValueError):
    raise ValueError(f"sequence {i}: reward {c.reward!r} is not a number") from None


def build_batch(completions: Sequence[Completion], *, n_micro: int, rows: int, row_len: int, resp_len: int,
                pack: bool = True, old_logp: Sequence[Sequence[float]] | None = None) -> TrainBatch:
  """Lays `completions` (group-major) out as M = `n_micro` microbatches of `rows` rows; numpy, on the host.

  rows      model rows per microbatch (R); padded: one completion per row, so len(completions) / n_micro
  row_len   tokens per row (S): must hold a prompt plus its response (packed: several of them)
  resp_len  response tokens per sequence in the [M, B, T] view (T): at least the longest response
  pack      first-fit-decreasing packing into the rows (`plan_rows(...)` gives a row count and length that hold
            them); False: one completion per row, padded
  old_logp  per completion, one log-prob per response token of a proximal policy; None: the step's own weights
  """
  n = len(completions)
  if n_micro < 1 or rows < 1 or row_len < 1 or resp_len < 1:
    raise ValueError(f"n_micro={n_micro}, rows={rows}, row_len={row_len}, resp_len={resp_len}: each must be >= 1")
  if old_logp is not None and len(old_logp) != n:
    raise ValueError(f"old_logp has {len(old_logp)} sequences for {n} completions")
  if n % n_micro:
    raise ValueError(f"{n} sequences do not split into n_micro={n_micro} equal microbatches")
  B = n // n_micro
  M, R, S, T = n_micro, rows, row_len, resp_len
  out = dict(tokens_MRS=np.zeros((M, R, S), np.int32), positions_MRS=np.zeros((M, R, S), np.int32),
             segment_ids_MRS=np.zeros((M, R, S), np.int32), gather_MBT=np.zeros((M, B, T), np.int32),
             targets_MBT=np.zeros((M, B, T), np.int32), mask_MBT=np.zeros((M, B, T), np.float32),
             rewards_MB=np.zeros((M, B), np.float32), sampler_logp_MBT=np.zeros((M, B, T), np.float32))
  old = np.zeros((M, B, T), np.float32) if old_logp is not None else None
  for m in range(M):
    chunk = completions[m * B : (m + 1) * B]
    placed = _place_rows(chunk, R, S, pack)
    segment_of_row = [0] * R
    for b in sorted(range(len(chunk)), key=lambda b: placed[b]):  # left to right in each row: segment ids ascend
      c, (r, off) = chunk[b], placed[b]
      if len(c.response) > T:
        raise ValueError(f"sequence {m * B + b} has {len(c.response)} response tokens; resp_len is {T}")
      _check_completion(m * B + b, c, None if old is None else old_logp[m * B + b])
      seq = np.asarray([*c.prompt, *c.response], np.int32)
      segment_of_row[r] += 1
      sl = slice(off, off + len(seq))
      out["tokens_MRS"][m, r, sl] = seq
      out["positions_MRS"][m, r, sl] = np.arange(len(seq))
      out["segment_ids_MRS"][m, r, sl] = segment_of_row[r]
      k = len(c.response)
      # Response token t sits at off + len(prompt) + t; the logits one position earlier predict it.
      out["gather_MBT"][m, b, :k] = r * S + off + len(c.prompt) - 1 + np.arange(k)
      out["targets_MBT"][m, b, :k] = c.response
      out["mask_MBT"][m, b, :k] = c.loss_mask if len(c.loss_mask) else 1.0
      out["rewards_MB"][m, b] = c.reward
      out["sampler_logp_MBT"][m, b, :k] = c.sampler_logp
      if old is not None:
        old[m, b, :k] = old_logp[m * B + b]
  return TrainBatch(**out, old_logp_MBT=old)
