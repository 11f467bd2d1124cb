"""Completion lengths of the long-tail workloads (decode.py, packing.py): lognormal around a median."""

from __future__ import annotations

import math

import numpy as np


def sample_lengths(n: int, median: int, sigma: float, rng: int | np.random.Generator) -> np.ndarray:
  """n lognormal completion lengths with the given median, rounded and clipped to [1, 8 x median]. `rng`: a seed,
  or a generator to draw on from where it stands (np.random.default_rng returns a generator as it is)."""
  x = np.random.default_rng(rng).lognormal(math.log(median), sigma, n)
  return np.clip(np.rint(x), 1, 8 * median).astype(np.int64)
