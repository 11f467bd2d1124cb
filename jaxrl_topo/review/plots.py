"""PNG plots of the simulator's output: a timeline (Gantt) per mode and steps/hour against the device split.

matplotlib's object API on the Agg canvas: no pyplot, no global backend state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl_topo.review.simulator import Span, Timeline

_COLORS = {"rollout": "tab:blue", "reward": "tab:olive", "switch": "tab:gray", "logprobs": "tab:red",
           "train": "tab:orange",
           "sync": "tab:green"}


def _new_figure(size: tuple[float, float]):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=size, dpi=100)
  FigureCanvasAgg(fig)
  return fig


def _lanes(spans: Sequence[Span]) -> dict[Span, tuple[int, int]]:
  """(lane, lanes in its row) per span: overlapping spans of one phase (async rollouts) get separate lanes."""
  lane_of, ends = {}, {}
  for s in sorted(spans, key=lambda s: (s.start, s.step)):
    row = ends.setdefault(s.phase, [])
    lane = next((i for i, e in enumerate(row) if e <= s.start), len(row))
    row[lane:lane + 1] = [s.end]
    lane_of[s] = lane
  return {s: (lane, len(ends[s.phase])) for s, lane in lane_of.items()}


def plot_timelines(timelines: Mapping[str, Timeline], path: str, max_steps: int = 6) -> str:
  """A Gantt chart per mode (rows: the phases present; bars labelled with the step) of the first steps."""
  if not timelines:
    raise ValueError("plot_timelines needs at least one timeline")
  fig = _new_figure((11, 2.2 * len(timelines) + 0.6))
  for i, (mode, tl) in enumerate(timelines.items()):
    ax = fig.add_subplot(len(timelines), 1, i + 1)
    spans = [s for s in tl.spans if s.step < max_steps]
    rows = [p for p in _COLORS if any(s.phase == p for s in spans)]
    lanes = _lanes(spans)
    for s in spans:
      y, (lane, n_lanes) = rows.index(s.phase), lanes[s]
      h = 0.8 / n_lanes
      lo = y - 0.4 + lane * h
      ax.broken_barh([(s.start, s.end - s.start)], (lo, h), facecolors=_COLORS[s.phase], edgecolors="black",
                     linewidth=0.5)
      ax.text((s.start + s.end) / 2, lo + h / 2, str(s.step), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    sph = tl.steps_per_hour(min(tl.n_steps // 4, tl.n_steps - 1))
    ax.set_title(f"{mode}: {sph:.1f} steps/h (steady state)", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
  fig.axes[-1].set_xlabel("seconds")
  fig.tight_layout()
  fig.savefig(path, format="png")
  return path


def plot_split_sweep(sweep: Mapping[int, Mapping[str, float]], path: str) -> str:
  """Steps/hour against the rollout device count, one line per mode."""
  if not sweep:
    raise ValueError("plot_split_sweep needs a non-empty sweep")
  splits = sorted(sweep)
  fig = _new_figure((7, 4.5))
  ax = fig.add_subplot(1, 1, 1)
  for mode in dict.fromkeys(m for s in splits for m in sweep[s]):
    ax.plot(splits, [sweep[s].get(mode, np.nan) for s in splits], marker="o", label=mode,
            linestyle="--" if mode == "colocated" else "-")
  ax.set_xlabel("rollout devices (trainer gets the rest)")
  ax.set_ylabel("steps / hour")
  ax.grid(True, alpha=0.3)
  ax.legend(loc="best")
  fig.tight_layout()
  fig.savefig(path, format="png")
  return path
