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

  def __post_init__(self):
    if len(self.sampler_logp) != len(self.response):
      raise ValueError(f"sampler_logp has {len(self.sampler_logp)} entries for {len(self.response)} response tokens")
    if not self.prompt:
      raise ValueError("a completion needs a non-empty prompt (the first response token is predicted from it)")


def _place_rows(seqs: Sequence[Completion], rows: int, row_len: int, pack: bool) -> list[tuple[int, int]]:
  """(row, offset) per sequence: one row each when padding, first-fit when packing."""
  fill = [0] * rows
  out = []
  for i, c in enumerate(seqs):
    n = len(c.prompt) + len(c.response)
    if n > row_len:
      raise ValueError(f"sequence {i} has {n} tokens; rows hold {row_len}")
    candidates = range(rows) if pack else [i] if i < rows else []
    row = next((r for r in candidates if fill[r] + n <= row_len), None)
    if row is None:
      raise ValueError(f"{len(seqs)} sequences do not fit {rows} rows of {row_len} tokens"
                       f" ({'packed' if pack else 'one per row'}); raise rows or row_len")
    out.append((row, fill[row]))
    fill[row] += n
  return out


def build_batch(completions: Sequence[Completion], *, n_micro: int, rows: int, row_len: int, resp_len: int,
                pack: bool = True, old_logp: Sequence[Sequence[float]] | None = None) -> TrainBatch:
  """Lays `completions` (group-major) out as M microbatches of `rows` rows; numpy, on the host."""
  n = len(completions)
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
    segment_of_row = [0] * R
    for b, (c, (r, off)) in enumerate(zip(chunk, _place_rows(chunk, R, S, pack), strict=True)):
      if len(c.response) > T:
        raise ValueError(f"sequence {m * B + b} has {len(c.response)} response tokens; resp_len is {T}")
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
      out["mask_MBT"][m, b, :k] = 1.0
      out["rewards_MB"][m, b] = c.reward
      out["sampler_logp_MBT"][m, b, :k] = c.sampler_logp
      if old is not None:
        old[m, b, :k] = old_logp[m * B + b]
  return TrainBatch(**out, old_logp_MBT=old)
