"""Data-path review: the overlap audit of a run's timeline (re-exported by review/audit.py).

  overlap_audit(spans, predicted)    per-phase seconds (total and per-step median), which phase pairs overlapped
                                     in time and by how much, which ran serialised, each side's idle fraction,
                                     and measured per-step medians against a prediction (phases > tolerance off
                                     are flagged).

Span times are seconds since the run's start. Host Python only: no JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

PHASES = ("rollout", "reward", "logprobs", "train", "sync", "eval")  # the loop's span phases, in data-flow order
TRAINER_PHASES = ("logprobs", "train", "sync")  # what keeps the trainer's devices busy
ROLLOUT_PHASES = ("rollout", "eval", "sync")  # ... and the rollout's
_EPS = 1e-9  # seconds: less overlap than this is "serialised"


# ---------------------------------------------------------------- §3 overlap: interval arithmetic


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
  """Sorted, merged, disjoint intervals covering the same points."""
  merged: list[list[float]] = []
  for s, e in sorted(intervals):
    if merged and s <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], e)
    else:
      merged.append([s, e])
  return [(s, e) for s, e in merged]


def _length(merged: Iterable[tuple[float, float]]) -> float:
  return sum(e - s for s, e in merged)


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
  """Length covered by (start, end) intervals, overlaps counted once (busy time; mux reports, trace summaries)."""
  return _length(_union(intervals))


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
  """Seconds covered by both merged interval lists (two-pointer sweep)."""
  i = j = 0
  total = 0.0
  while i < len(a) and j < len(b):
    total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return total


def _check_spans(spans: list[dict]) -> None:
  if not spans:
    raise ValueError("no spans: the run wrote no spans.jsonl (or it is empty), so there is no timeline to audit")
  for i, sp in enumerate(spans):
    missing = [k for k in ("phase", "step", "start", "end") if k not in sp]
    if missing:
      raise ValueError(f"span {i}: missing {missing}; expected {{phase, role, devices, step, gen_id, start, end}}")
    if not (math.isfinite(sp["start"]) and math.isfinite(sp["end"]) and sp["end"] >= sp["start"]):
      raise ValueError(f"span {i} ({sp['phase']}, step {sp['step']}): needs finite start <= end, got "
                       f"[{sp['start']}, {sp['end']}]")


def _phase_order(phases: Iterable[str]) -> list[str]:
  return sorted(set(phases), key=lambda p: (PHASES.index(p) if p in PHASES else len(PHASES), p))


# ---------------------------------------------------------------- §3 overlap: the report


@dataclasses.dataclass(frozen=True)
class PhaseStats:
  count: int  # spans
  steps: int  # distinct steps with this phase
  total_s: float  # sum of span durations
  busy_s: float  # union of the spans (<= total_s when spans of one phase overlap)
  median_step_s: float  # median over steps (from skip_steps) of the phase's seconds in a step, less its compiles
  # of total_s, the seconds its spans spent compiling (a span's compile_s, runtime/spans.py); None: not recorded
  compile_s: float | None = None


@dataclasses.dataclass(frozen=True)
class PairOverlap:
  a: str
  b: str
  overlap_s: float  # seconds during which both phases were running
  frac_of_a: float  # overlap_s / busy_s of a
  frac_of_b: float


@dataclasses.dataclass(frozen=True)
class SideIdle:
  phases: tuple[str, ...]  # the phases counted as busy
  devices: tuple[int, ...]
  busy_s: float
  idle_frac: float  # 1 - busy_s / makespan


@dataclasses.dataclass(frozen=True)
class Comparison:
  phase: str
  predicted_s: float
  measured_s: float | None  # the per-step median; None: the phase never ran
  rel_err: float | None  # (measured - predicted) / predicted; None when undefined
  flagged: bool


@dataclasses.dataclass(frozen=True)
class OverlapReport:
  """The measured timeline of a run: per-phase seconds, overlaps, idle fractions, prediction check."""

  start_s: float
  makespan_s: float  # from the first span's start to the last span's end
  n_steps: int
  phases: dict[str, PhaseStats]
  pairs: tuple[PairOverlap, ...]  # every pair of phases present
  idle: dict[str, SideIdle]  # "trainer", "rollout" (and "shared" when both sides use the same devices)
  comparisons: tuple[Comparison, ...] = ()
  tolerance: float = 0.2
  skip_steps: int = 0  # the medians start at this step (where a phase has one)

  @property
  def overlapped(self) -> list[PairOverlap]:
    return [p for p in self.pairs if p.overlap_s > _EPS]

  @property
  def serialised(self) -> list[tuple[str, str]]:
    return [(p.a, p.b) for p in self.pairs if p.overlap_s <= _EPS]

  @property
  def flagged(self) -> list[str]:
    return [c.phase for c in self.comparisons if c.flagged]

  def overlap(self, a: str, b: str) -> PairOverlap:
    for p in self.pairs:
      if {p.a, p.b} == {a, b}:
        return p if p.a == a else PairOverlap(a, b, p.overlap_s, p.frac_of_b, p.frac_of_a)
    raise KeyError(f"no pair ({a}, {b}) in the timeline; phases present: {list(self.phases)}")

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["pairs"] = [dataclasses.asdict(p) for p in self.pairs]
    d["comparisons"] = [dataclasses.asdict(c) for c in self.comparisons]
    d["overlapped"] = [[p.a, p.b] for p in self.overlapped]
    d["serialised"] = [list(p) for p in self.serialised]
    d["flagged"] = self.flagged
    return d

  def to_markdown(self) -> str:
    pred = {c.phase: c for c in self.comparisons}
    med = f"median s/step (from step {self.skip_steps})" if self.skip_steps else "median s/step"
    lines = [f"### Timeline: {self.makespan_s:.3f} s over {self.n_steps} steps", "",
             f"| phase | spans | total s | of it compiling | {med} | predicted s/step | off |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, st in self.phases.items():
      c = pred.get(name)
      off = "" if c is None or c.rel_err is None else f"{c.rel_err:+.0%}" + (" **FLAG**" if c.flagged else "")
      compiling = "n/a" if st.compile_s is None else f"{st.compile_s:.3f}"
      lines.append(f"| {name} | {st.count} | {st.total_s:.3f} | {compiling} | {st.median_step_s:.3f} | "
                   f"{'' if c is None else f'{c.predicted_s:.3f}'} | {off} |")
    for c in self.comparisons:
      if c.measured_s is None:
        lines.append(f"| {c.phase} | 0 | | | | {c.predicted_s:.3f} | not measured **FLAG** |")
    lines += ["", "| overlap | seconds | of first | of second |", "|---|---:|---:|---:|"]
    lines += [f"| {p.a} / {p.b} | {p.overlap_s:.3f} | {p.frac_of_a:.0%} | {p.frac_of_b:.0%} |" for p in self.overlapped]
    lines += ["", f"Serialised: {', '.join(f'{a}/{b}' for a, b in self.serialised) or 'none'}", "",
              "| side | busy s | idle |", "|---|---:|---:|"]
    lines += [f"| {side} | {s.busy_s:.3f} | {s.idle_frac:.0%} |" for side, s in self.idle.items()]
    return "\n".join(lines) + "\n"


def step_seconds(spans: Iterable[Mapping]) -> float:
  """The seconds one phase ran in one step, from that step's spans of it: spans that overlap (processes' spans of
  the same work) count once, less the most any of them compiled (`compile_s`, runtime/spans.py: a new shape's
  compile is not read as a slow phase); spans one after another (DAPO's up to three rounds of decoding and
  scoring a step) add up, so the gaps between them (the other phase's rounds) do not count."""
  total, lo, hi, comp = 0.0, None, -math.inf, 0.0
  for sp in sorted(spans, key=lambda sp: sp["start"]):
    if lo is not None and sp["start"] < hi:  # overlaps the group so far
      hi, comp = max(hi, sp["end"]), max(comp, float(sp.get("compile_s", 0.0)))
      continue
    if lo is not None:
      total += max(0.0, hi - lo - comp)
    lo, hi, comp = sp["start"], sp["end"], float(sp.get("compile_s", 0.0))
  return total + (max(0.0, hi - lo - comp) if lo is not None else 0.0)


def seconds_by_step(spans: Iterable[Mapping], skip_steps: int = 0) -> dict[int, float]:
  """{step: `step_seconds` of its spans}, in step order, for the steps >= skip_steps of one phase's spans."""
  by_step: dict[int, list[Mapping]] = {}
  for sp in spans:
    if sp["step"] >= skip_steps:
      by_step.setdefault(sp["step"], []).append(sp)
  return {k: step_seconds(by_step[k]) for k in sorted(by_step)}


def _phase_stats(spans: list[dict], skip_steps: int = 0) -> dict[str, PhaseStats]:
  out = {}
  for phase in _phase_order(sp["phase"] for sp in spans):
    mine = [sp for sp in spans if sp["phase"] == phase]
    later = any(sp["step"] >= skip_steps for sp in mine)  # else (a phase only in early steps) all of them
    per_step = seconds_by_step(mine, skip_steps if later else 0)
    out[phase] = PhaseStats(count=len(mine), steps=len(per_step), total_s=sum(sp["end"] - sp["start"] for sp in mine),
                            busy_s=_length(_union((sp["start"], sp["end"]) for sp in mine)),
                            # a stream's empty tile (a batch finished inside another's, or by the same drain)
                            median_step_s=statistics.median([v for v in per_step.values() if v > 0] or [0.0]),
                            compile_s=sum(sp.get("compile_s", 0.0) for sp in mine)
                            if any("compile_s" in sp for sp in mine) else None)
  return out


def _busy(spans: list[dict], phases: Iterable[str]) -> list[tuple[float, float]]:
  phases = set(phases)
  return _union((sp["start"], sp["end"]) for sp in spans if sp["phase"] in phases)


def _side(spans: list[dict], phases: tuple[str, ...], device_phase: str, makespan: float) -> SideIdle:
  busy = _length(_busy(spans, phases))
  devices = sorted({int(d) for sp in spans if sp["phase"] == device_phase for d in sp.get("devices", ())})
  return SideIdle(phases=phases, devices=tuple(devices), busy_s=busy,
                  idle_frac=1.0 - busy / makespan if makespan > 0 else 0.0)


def _compare(phases: dict[str, PhaseStats], predicted: Mapping[str, float], tolerance: float) -> tuple[Comparison, ...]:
  out = []
  for phase, want in predicted.items():
    if not (isinstance(want, int | float) and math.isfinite(want) and want >= 0):
      raise ValueError(f"predicted[{phase!r}]={want!r}: expected finite seconds per step >= 0")
    got = phases[phase].median_step_s if phase in phases else None
    if got is None:
      out.append(Comparison(phase, float(want), None, None, True))
    elif want == 0:
      out.append(Comparison(phase, 0.0, got, None, got > _EPS))
    else:
      rel = (got - want) / want
      out.append(Comparison(phase, float(want), got, rel, abs(rel) > tolerance))
  return tuple(out)


def overlap_audit(spans: list[dict], predicted: dict[str, float] | None = None, tolerance: float = 0.2,
                  skip_steps: int = 0) -> OverlapReport:
  """Audits a run's timeline (spans.jsonl records). `predicted`: phase -> predicted seconds per step, compared with
  the measured per-step medians; a phase more than `tolerance` (relative) off is flagged, as is one never measured.
  The medians leave out steps before `skip_steps` where a phase has later ones (the review's fit skips the first
  step: its programs' first runs are slower, compiles aside).

  Idle fractions are over the makespan: the trainer's devices are busy during train and sync spans, the rollout's
  during rollout, eval and sync spans (reward spans run on the host and count for neither)."""
  if not tolerance >= 0:
    raise ValueError(f"tolerance={tolerance}: expected a relative error >= 0 (0.2 = 20%)")
  _check_spans(spans)
  start = min(sp["start"] for sp in spans)
  makespan = max(sp["end"] for sp in spans) - start
  phases = _phase_stats(spans, skip_steps)
  unions = {p: _busy(spans, (p,)) for p in phases}
  pairs = []
  for a, b in itertools.combinations(phases, 2):
    both = _intersection(unions[a], unions[b])
    pairs.append(PairOverlap(a, b, both, both / phases[a].busy_s if phases[a].busy_s else 0.0,
                             both / phases[b].busy_s if phases[b].busy_s else 0.0))
  idle = {"trainer": _side(spans, TRAINER_PHASES, "train", makespan),
          "rollout": _side(spans, ROLLOUT_PHASES, "rollout", makespan)}
  if idle["trainer"].devices and idle["trainer"].devices == idle["rollout"].devices:  # colocated: one device set
    idle["shared"] = _side(spans, tuple(dict.fromkeys(TRAINER_PHASES + ROLLOUT_PHASES)), "train", makespan)
  steps = {sp["step"] for sp in spans if sp["phase"] == "train"} or {sp["step"] for sp in spans}
  return OverlapReport(start_s=start, makespan_s=makespan, n_steps=len(steps), phases=phases, pairs=tuple(pairs),
                       idle=idle, comparisons=_compare(phases, predicted or {}, tolerance), tolerance=tolerance,
                       skip_steps=skip_steps)
