"""What a group run measured: each pool's busy fraction, each job's slowdown, and a timeline PNG.

Input: the group's phase spans (`mux_spans.jsonl`: job, pool, step, start, end in seconds since the group
started). A pool is busy while some job's phase holds it (a migrated rollout's tail and the next job's
rollout may overlap: their union counts once). The window is from the first phase's start to the last
phase's end, or from `t_from` (e.g. after every job's first cycle, which compiles) when given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxrl_topo.review.overlap import union_length
from jaxrl_topo.review.plots import _new_figure
from jaxrl_topo.runtime.metrics import read_jsonl

POOLS = ("rollout", "train")


def read_spans(path: str) -> list[dict]:
  """A group's spans file (MUX_SPANS); a torn last line (a killed group) is skipped, as a run's spans are."""
  return read_jsonl(path)


def busy_fractions(spans: Sequence[Mapping], t_from: float | None = None) -> dict[str, float]:
  """{pool: busy seconds / window seconds} over [t_from or first start, last end]."""
  if not spans:
    raise ValueError("busy_fractions: no spans")
  lo = min(s["start"] for s in spans) if t_from is None else t_from
  hi = max(s["end"] for s in spans)
  if hi <= lo:
    raise ValueError(f"busy_fractions: empty window [{lo}, {hi}]")
  out = {}
  for pool in POOLS:
    ivs = [(max(s["start"], lo), s["end"]) for s in spans if s["pool"] == pool and s["end"] > lo]
    out[pool] = union_length(ivs) / (hi - lo)
  return out


def steady_start(spans: Sequence[Mapping], skip: int = 1) -> float:
  """When every job's first `skip` train phases (compilation) have ended."""
  return max(s["end"] for s in spans if s["pool"] == "train" and s["step"] == skip - 1)


def seconds_per_step(spans: Sequence[Mapping], job: str, skip: int = 1) -> float:
  """A job's seconds per step after its first `skip` steps: between the ends of its train phases."""
  ends = sorted(s["end"] for s in spans if s["job"] == job and s["pool"] == "train")
  if len(ends) <= skip:
    raise ValueError(f"job {job}: {len(ends)} train phases, need more than {skip}")
  return (ends[-1] - ends[skip - 1]) / (len(ends) - skip) if skip else ends[-1] / len(ends)


def plot_timeline(spans: Sequence[Mapping], path: str, title: str = "") -> str:
  """Gantt chart: one row per pool, bars coloured by job and labelled with the step."""
  jobs = list(dict.fromkeys(s["job"] for s in sorted(spans, key=lambda s: s["start"])))
  colors = {j: f"C{i % 10}" for i, j in enumerate(jobs)}
  fig = _new_figure((11, 2.6))
  ax = fig.add_subplot(1, 1, 1)
  for s in spans:
    y = POOLS.index(s["pool"])
    ax.broken_barh([(s["start"], s["end"] - s["start"])], (y - 0.35, 0.7), facecolors=colors[s["job"]],
                   edgecolors="black", linewidth=0.5)
    ax.text((s["start"] + s["end"]) / 2, y, str(s["step"]), ha="center", va="center", fontsize=7)
    if s.get("migrated_at") is not None:  # the rollout turn passed on here (long-tail migration)
      ax.plot([s["migrated_at"]] * 2, [y - 0.35, y + 0.35], color="black", linewidth=1.5)
  ax.set_yticks(range(len(POOLS)), [f"{p} pool" for p in POOLS])
  ax.invert_yaxis()
  ax.set_xlabel("seconds")
  ax.set_title(title or "co-execution group: phases by job (bars: step; tick: rollout turn passed on)", fontsize=10)
  ax.legend(handles=[_patch(colors[j], j) for j in jobs], loc="upper right", fontsize=8)
  ax.grid(True, axis="x", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, format="png")
  return path


def _patch(color: str, label: str):
  from matplotlib.patches import Patch

  return Patch(facecolor=color, edgecolor="black", label=label)
