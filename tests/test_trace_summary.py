"""benchmarks/trace_summary.py: the busy-time union by hand, and a real trace of a jitted call summarized."""

import importlib.util
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from jaxrl_topo.review.overlap import union_length

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("trace_summary", os.path.join(_ROOT, "benchmarks", "trace_summary.py"))
trace_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_summary)


def test_busy_time_is_the_union_of_the_intervals():
  # [0, 15) from two overlapping, [20, 31) from two touching, [40, 41), and one inside [0, 15): 15 + 11 + 1.
  assert union_length([(20, 30), (0, 10), (40, 41), (5, 15), (30, 31), (2, 3)]) == 27
  assert union_length([(0, 100), (10, 20)]) == 100
  assert union_length([]) == 0


def _plane(name, lines):
  ev = lambda start, dur, n: SimpleNamespace(name=n, start_ns=start, duration_ns=dur)  # noqa: E731
  return SimpleNamespace(name=name, lines=[SimpleNamespace(name=ln, events=[ev(*e) for e in evs])
                                           for ln, evs in lines])


def test_a_device_plane_is_summarized_by_hand_worked_numbers():
  gpu = _plane("/device:GPU:0", [
      ("Stream #14(Compute)", [(0, 10, "gemm"), (5, 10, "pad"), (20, 5, "gemm")]),  # union [0, 15) + [20, 25)
      ("XLA Ops", [(0, 15, "fusion.1"), (20, 5, "fusion.2"), (30, 1, "fusion.1")]),
      ("Launch Stats", []),  # no events: left out
  ])
  host = _plane("/host:CPU", [("tf_XLAEigen/1", [(0, 100, "ignored")])])  # a device plane exists: host left out
  (plane,) = trace_summary.summarize_planes([host, gpu], top=1)
  assert plane["plane"] == "/device:GPU:0"
  stream, ops = plane["lines"]
  assert stream == {"line": "Stream #14(Compute)", "kernels": True, "events": 3, "sum_s": 25e-9, "busy_s": 20e-9,
                    "span_s": 25e-9}
  assert ops == {"line": "XLA Ops", "kernels": False, "events": 3, "sum_s": 21e-9, "busy_s": 21e-9, "span_s": 31e-9}
  assert plane["top"] == [{"name": "gemm", "sum_s": 15e-9, "count": 2}]  # top=1: the pad's 10 ns left out
  assert plane["top_ops"] == [{"name": "fusion.1", "sum_s": 16e-9, "count": 2}]


def test_without_a_device_plane_the_host_plane_s_xla_threads_are_the_kernels():
  host = _plane("/host:CPU", [("python", [(0, 50, "call")]), ("tf_XLAEigen/7", [(0, 4, "dot"), (4, 2, "add")])])
  (plane,) = trace_summary.summarize_planes([host])
  assert [(ln["line"], ln["kernels"]) for ln in plane["lines"]] == [("python", False), ("tf_XLAEigen/7", True)]
  assert plane["top"] == [{"name": "dot", "sum_s": 4e-9, "count": 1}, {"name": "add", "sum_s": 2e-9, "count": 1}]
  assert plane["top_ops"] == []


def test_a_trace_folder_resolves_to_its_newest_trace(tmp_path):
  for run in ("2026_11_27_14_16_00", "2026_11_27_14_17_05"):
    (tmp_path / "plugins" / "profile" / run).mkdir(parents=True)
    (tmp_path / "plugins" / "profile" / run / "vm.xplane.pb").write_bytes(b"")
  assert trace_summary.trace_file(str(tmp_path)).endswith("14_17_05/vm.xplane.pb")
  assert trace_summary.trace_file("/some/file.xplane.pb") == "/some/file.xplane.pb"


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
