"""Reward functions for tests/test_rewards.py. They live in an importable module so that spawned pool workers can
resolve them by import path ("reward_fns_for_tests:length"). No jax here: workers must not import it."""

import math
import os
import sys
import time

NOT_CALLABLE = 3


def length(prompts, completions, metadata):
  return [float(len(c)) for c in completions]


def one(prompts, completions, metadata):
  return [1.0] * len(completions)


def raises(prompts, completions, metadata):
  raise RuntimeError("boom")


def raises_on_bad(prompts, completions, metadata):
  if "bad" in completions:
    raise RuntimeError("bad item")
  return [1.0] * len(completions)


def hangs(prompts, completions, metadata):
  time.sleep(60)
  return [1.0] * len(completions)


def hangs_on_slow(prompts, completions, metadata):
  if "slow" in completions:
    time.sleep(60)
  return [2.0] * len(completions)


def wrong_length(prompts, completions, metadata):
  return [1.0] * (len(completions) + 1)


def nan(prompts, completions, metadata):
  return [math.nan] * len(completions)


def two_args(prompts, completions):  # a reward function is called with three
  return [0.0] * len(completions)


def strings(prompts, completions, metadata):  # float() took these before
  return ["1.0"] * len(completions)


def dies(prompts, completions, metadata):
  os._exit(3)


def imported_jax(prompts, completions, metadata):
  return [float("jax" in sys.modules)] * len(completions)


def slow_length(prompts, completions, metadata):
  """`length` after 0.5 s: a reward that takes long enough to show whether it ran in the background."""
  time.sleep(0.5)
  return [float(len(c)) for c in completions]
