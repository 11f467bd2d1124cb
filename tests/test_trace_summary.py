"""benchmarks/trace_summary.py: the busy-time union by hand, and a real trace of a jitted call summarized."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("trace_summary", os.path.join(_ROOT, "benchmarks", "trace_summary.py"))
trace_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_summary)


def test_busy_time_is_the_union_of_the_intervals():
  # [0, 15) from two overlapping, [20, 31) from two touching, [40, 41), and one inside [0, 15): 15 + 11 + 1.
  assert trace_summary._busy_ns([(20, 30), (0, 10), (40, 41), (5, 15), (30, 31), (2, 3)]) == 27
  assert trace_summary._busy_ns([(0, 100), (10, 20)]) == 100
  assert trace_summary._busy_ns([]) == 0


def test_a_traced_call_is_summarized_per_line_and_kernel(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x) * 2.0 + 1.0)
  x = jnp.ones((256, 256))
  jax.block_until_ready(f(x))
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(3):
      jax.block_until_ready(f(x))
  summary = trace_summary.summarize(str(tmp_path))
  assert summary["file"].endswith(".xplane.pb")
  (plane,) = summary["planes"]  # CPU: the host plane
  kernel_lines = [ln for ln in plane["lines"] if ln["kernels"]]
  assert kernel_lines and sum(ln["events"] for ln in kernel_lines) >= 3
  assert max(ln["busy_s"] for ln in kernel_lines) > 0
  for ln in plane["lines"]:
    assert 0 <= ln["busy_s"] <= ln["span_s"] + 1e-9 and ln["busy_s"] <= ln["sum_s"] + 1e-9
  times = [t["sum_s"] for t in plane["top"]]
  assert times == sorted(times, reverse=True) and len(times) <= 25
  assert sum(t["count"] for t in plane["top"]) >= 3


def test_a_folder_without_a_trace_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no .xplane.pb"):
    trace_summary.summarize(str(tmp_path))
