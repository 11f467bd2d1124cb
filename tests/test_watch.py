"""The loop's clocks (runtime/watch.py) on a fake clock: wall-clock rates, chunk brackets, device stamps."""

from __future__ import annotations

import collections

import jax.numpy as jnp
import pytest

from jaxrl_topo.runtime import watch


@pytest.fixture
def clock(monkeypatch):
  now = [100.0]
  monkeypatch.setattr(watch.time, "perf_counter", lambda: now[0])
  return now


def test_wall_clock_rates_come_from_wall_time_with_evaluation_excluded(clock):
  wall = watch.WallClock()
  clock[0] += 4.0  # step 0: build-up and compilation
  first = wall.step(tokens=400)
  assert first == {"time/step_s": 4.0, "perf/tokens_per_s": 100.0, "perf/steps_per_hour": 900.0}
  clock[0] += 3.0  # a held-out evaluation after step 0
  wall.exclude(3.0)
  clock[0] += 2.0
  second = wall.step(tokens=300)
  assert second["time/step_s"] == 2.0 and second["perf/tokens_per_s"] == 150.0
  assert second["perf/run_steps_per_hour"] == 1800.0 and second["perf/run_tokens_per_s"] == 150.0
  clock[0] += 1.0
  third = wall.step(tokens=300)
  assert third["perf/steps_per_hour"] == 3600.0
  assert third["perf/run_steps_per_hour"] == 2400.0 and third["perf/run_tokens_per_s"] == 200.0  # 600 tokens / 3 s


def test_chunk_brackets_start_two_ticks_back_and_count_only_whole_chunks(clock):
  engine = type("Engine", (), {"stats": collections.Counter()})()
  chunks = watch.ChunkClock(engine)  # ticks exit at 100
  clock[0] = 101.0
  chunks.reset()  # a training rollout starts: its chunks are dispatched after 101
  for t, tokens in ((102.0, 8), (103.0, 8), (104.0, 4)):
    clock[0] = t
    engine.stats["tokens"] += tokens
    chunks.chunk()  # tick entry: the chunk just read
    clock[0] = t + 0.5
    chunks.resume()  # tick exit
  assert list(chunks.chunks) == [(101.0, 102.0, 8), (101.0, 103.0, 8), (102.5, 104.0, 4)]
  assert chunks.tokens_within(100.5, 104.0) == 20
  assert chunks.tokens_within(101.5, 104.0) == 4  # the first two may have started before 101.5
  assert chunks.tokens_within(101.0, 103.5) == 16
  engine.stats["tokens"] += 50  # evaluation between rollouts: not a training chunk
  chunks.reset()
  clock[0] = 105.0
  chunks.chunk()
  assert chunks.chunks[-1][2] == 0


def test_step_watch_stamps_completion_and_reraises_errors():
  w = watch.StepWatch(None, {"loss": jnp.ones(())})
  w.wait()
  assert w.done.is_set() and w.done_at is not None and w.pre_done_at is None

  class Broken:
    def block_until_ready(self):
      raise RuntimeError("device lost")

  bad = watch.StepWatch(None, Broken())
  with pytest.raises(RuntimeError, match="device lost"):
    bad.wait()
