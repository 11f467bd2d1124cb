"""Packing plans (train/batch.py): first-fit-decreasing, row planning, group balancing, by hand and by invariant."""

import numpy as np
import pytest

from jaxrl_topo.train.batch import balance_groups, first_fit_decreasing, plan_rows


def test_first_fit_decreasing_by_hand():
  # longest first into the first row with room: 7 -> row 0; 5 -> row 1; 4 -> row 1 after the 5; 3 -> row 0
  # after the 7 (exactly full); 2 -> fits neither (10, 9 + 2) -> row 2
  assert first_fit_decreasing([3, 7, 2, 5, 4], 10) == [(0, 7), (0, 0), (2, 0), (1, 0), (1, 5)]
  with pytest.raises(ValueError, match="sequence 1 has 11 tokens"):
    first_fit_decreasing([3, 11], 10)


def _check_plan(lengths, n_micro, budget, dp):
  rows, row_len = plan_rows(lengths, n_micro, budget, multiple=dp)
  assert rows % dp == 0 and max(lengths) <= row_len <= budget
  B = len(lengths) // n_micro
  for m in range(n_micro):
    chunk = lengths[m * B : (m + 1) * B]
    placed = first_fit_decreasing(chunk, row_len)
    fill = np.zeros(rows, int)
    for (r, off), n in sorted(zip(placed, chunk, strict=True)):
      assert off == fill[r], "sequences in a row must be contiguous"
      fill[r] += n
    assert fill.max() <= row_len
  return rows, row_len


def test_plan_rows_holds_everything_in_the_fewest_dp_rows_then_shrinks_the_rows():
  rng = np.random.default_rng(0)
  for trial in range(20):
    lengths = (32 + np.clip(rng.lognormal(np.log(64), 1.0, 64), 1, 512)).astype(int).tolist()
    rows, row_len = _check_plan(lengths, 2, 2048, 4)
    full_rows = max(max(r for r, _ in first_fit_decreasing(lengths[m * 32 : (m + 1) * 32], 2048)) + 1
                    for m in range(2))
    assert rows == -(-full_rows // 4) * 4, "more rows than the budget needs"
    if row_len < 2048 and row_len - 64 >= max(lengths):  # one quantum shorter would not hold them in `rows`
      shorter = max(max(r for r, _ in first_fit_decreasing(lengths[m * 32 : (m + 1) * 32], row_len - 64)) + 1
                    for m in range(2))
      assert shorter > rows, f"trial {trial}: rows of {row_len - 64} tokens would do"


def test_balance_groups_keeps_groups_whole_and_evens_the_load():
  tokens = [100, 5, 90, 10, 80, 20, 70, 30]
  order = balance_groups(tokens, 2)
  assert sorted(order) == list(range(8))
  loads = [sum(tokens[g] for g in order[:4]), sum(tokens[g] for g in order[4:])]
  assert abs(loads[0] - loads[1]) <= 20, loads  # contiguous halves would be 205 vs 200; worst order 340 vs 65
  assert balance_groups([3, 1, 2], 1) == [0, 1, 2]
