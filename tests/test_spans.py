"""runtime/spans.py: the compile seconds a span carries (CompileLog) and the spans file a run writes."""

import json
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from jaxrl_topo.runtime import spans as spans_lib


@jax.jit
def _program(x):
  return jnp.cumsum(jnp.sin(x) * 3)


def _compile_something(n: int) -> None:
  _program(jnp.ones(n + 17)).block_until_ready()  # a new shape, a new program, for each n


def test_the_compile_log_counts_this_threads_compiles_inside_a_window():
  with spans_lib.CompileLog() as log:
    t0 = time.perf_counter()
    _compile_something(1)
    t1 = time.perf_counter()
    time.sleep(0.05)
    t2 = time.perf_counter()
    _compile_something(1)  # cached: no compile
    t3 = time.perf_counter()
    other = threading.Thread(target=_compile_something, args=(2,))
    other.start()
    other.join()
    t4 = time.perf_counter()
  _compile_something(3)  # after the log closed: not recorded
  t5 = time.perf_counter()
  assert log.seconds_within(t0, t5) == log.seconds_within(t0, t4)
  compiled = log.seconds_within(t0, t1)
  assert 0 < compiled <= t1 - t0
  assert log.seconds_within(t1, t2) == 0.0  # the sleep
  assert log.seconds_within(t2, t3) == 0.0  # a cached call
  assert log.seconds_within(t3, t4) == 0.0  # another thread's compile (a multiplexed group's other job)
  assert log.seconds_within(t4, t5) == 0.0
  assert log.seconds_within(t0, t5) == compiled
  half = (t0 + t1) / 2  # a window clips the intervals
  assert log.seconds_within(t0, half) + log.seconds_within(half, t1) == pytest.approx(compiled, abs=1e-9)


def test_a_span_written_carries_the_compile_seconds_inside_it(tmp_path):
  with spans_lib.CompileLog() as log:
    on_span = spans_lib.span_writer(str(tmp_path), log)
    t0 = time.perf_counter()
    _compile_something(4)
    t1 = time.perf_counter()
    on_span({"phase": "rollout", "step": 0, "start": t0, "end": t1})
    on_span({"phase": "train", "step": 0, "start": t1, "end": time.perf_counter()})
    on_span({"phase": "train", "step": 1, "start": t0, "end": t1, "compile_until": t0})  # queued before it compiled
  rollout, train, queued = spans_lib.read_spans(str(tmp_path))
  assert 0 < rollout["compile_s"] <= rollout["end"] - rollout["start"] + 1e-6
  assert train["compile_s"] == 0.0
  assert queued["compile_s"] == 0.0 and "compile_until" not in queued
  # A resumed run keeps the spans `keep` accepts, and its clock goes on from the last one's end.
  with spans_lib.CompileLog() as log:
    on_span = spans_lib.span_writer(str(tmp_path), log, start=1, keep=lambda r: r["step"] == 0)
    t = time.perf_counter()
    on_span({"phase": "train", "step": 1, "start": t, "end": t + 1.0})
  *kept, new = spans_lib.read_spans(str(tmp_path))
  assert kept == [rollout, train] and new["start"] >= train["end"] and json.dumps(new)
