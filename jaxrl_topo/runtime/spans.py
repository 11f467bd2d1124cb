"""The run's timeline on disk: `<workdir>/spans.jsonl`, one line per span of every step (rollout, reward, logprobs,
train, sync, eval; runtime/rollout_side.span), seconds since the run started.

Each span also carries `compile_s`: the seconds inside it that the process spent tracing, lowering and compiling
XLA programs (`CompileLog`, from jax.monitoring's compile events). A program compiles in the thread that
dispatches it, and the controller's one thread drives every phase, so a compile stalls every phase open at the
time that waits on that thread: a continuous rollout stream's span holds the train step's first compile,
dispatched between decode chunks. A train (or logprobs) span counts only the compiles before its step was queued
(`compile_until`): after that its devices run on their own.
The review's calibration (review/calibrate.py) takes it out, so a new shape's compile in a late step is not read
as slow decoding.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
from collections.abc import Callable

import jax

from jaxrl_topo.runtime.metrics import read_jsonl

SPANS_FILE = "spans.jsonl"
# jax's compile events (jax/_src/dispatch.py): tracing to a jaxpr, lowering to MLIR, XLA's compile. A nested jit
# traced inside another's trace reports its own event too: the intervals are merged before they are counted.
COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                            "/jax/core/compile/jaxpr_to_mlir_module_duration",
                            "/jax/core/compile/backend_compile_duration"})


def read_spans(workdir: str) -> list[dict]:
  """The run's timeline: {phase, role, devices, step, gen_id, start, end, compile_s} per line, seconds since the
  start (`compile_s` absent from runs recorded before it was kept)."""
  path = os.path.join(workdir, SPANS_FILE)
  return read_jsonl(path) if os.path.isfile(path) else []  # a torn last line (killed mid-write) skipped


def kept_span(r: dict, start: int, lost: bool) -> bool:
  """Whether a run resumed at `start` keeps an earlier session's span `r`: one of a step it does not redo, except
  the evaluation after step start - 1 when that step's line was `lost` (train_loop runs that evaluation again)."""
  return r["step"] < start and not (lost and r["phase"] == "eval" and r["step"] == start - 1)


class CompileLog:
  """While open (a context manager), the wall intervals (time.perf_counter) each thread of this process spent
  compiling, from jax.monitoring's duration events; `seconds_within(start, end)` is their merged length inside a
  window, on the calling thread (a multiplexed group's jobs compile in their own threads, each its own programs)."""

  def __init__(self):
    self._ends: list[float] = []  # in the order recorded, so ascending: a window's intervals are found by bisection
    self._intervals: list[tuple[float, int]] = []  # (start, thread) of each
    self._lock = threading.Lock()

  def _on_event(self, event: str, secs: float, **_) -> None:
    if event in COMPILE_EVENTS:
      with self._lock:
        t = time.perf_counter()  # the event is recorded as it ends
        self._ends.append(t)
        self._intervals.append((t - secs, threading.get_ident()))

  def __enter__(self) -> CompileLog:
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_event)

  def seconds_within(self, start: float, end: float) -> float:
    me = threading.get_ident()
    with self._lock:
      first = bisect.bisect_right(self._ends, start)  # those ending after the window opened (a long run's spans
      inside = sorted((max(s, start), min(e, end))  # are written as they end: this is the log's short tail)
                      for e, (s, t) in zip(self._ends[first:], self._intervals[first:], strict=True)
                      if s < end and t == me)
    total, reach = 0.0, start
    for s, e in inside:  # merged: a nested trace counts once
      total += max(0.0, e - max(s, reach))
      reach = max(reach, e)
    return total


def span_writer(workdir: str, compiles: CompileLog, *, start: int = 0, keep: Callable[[dict], bool] = lambda r: False,
                write: bool = True) -> Callable[[dict], None]:
  """`on_span` for train_loop's hooks: appends each span to `workdir`'s spans.jsonl (when `write`: process 0) with
  its times moved to seconds since the run started and its `compile_s`. A run resumed at `start` > 0 first keeps
  the earlier session's spans that `keep` accepts, and its clock goes on from their last end."""
  path = os.path.join(workdir, SPANS_FILE)
  kept = [r for r in read_spans(workdir) if keep(r)] if start else []
  if write:
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
  t_origin = time.perf_counter() - (max(r["end"] for r in kept) if kept else 0.0)

  def on_span(entry: dict) -> None:
    if write:
      entry = dict(entry)
      until = min(entry["end"], entry.pop("compile_until", entry["end"]))  # a train span: until the step is queued
      compile_s = round(compiles.seconds_within(entry["start"], until), 6)
      entry.update(start=entry["start"] - t_origin, end=entry["end"] - t_origin, compile_s=compile_s)
      with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")

  return on_span
