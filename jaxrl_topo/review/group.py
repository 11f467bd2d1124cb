"""The review of a co-execution group (launchers/mux.py workdir): every job's phases from `mux_spans.jsonl`.

A group's spans carry the job id (`job`, `pool`, `step`, `start`, `end`, `devices`, migration fields); this
page splits them per job, in the span format a solo run writes (`job_spans`: phase, role, devices, step,
start, end), so the per-run tools (review/audit.py, review/simulator.py calibration) can read one job's
timeline out of a group, and writes group.md / group.json (per job and pool: phases, busy seconds, mean
phase, migrations; per pool: busy fraction) and group_timeline.png.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from jaxrl_topo.mux import report
from jaxrl_topo.runtime.workdir import MUX_SPANS


def is_group(workdir: str) -> bool:
  return os.path.isfile(os.path.join(workdir, MUX_SPANS))


def read_group_spans(workdir: str) -> list[dict]:
  path = os.path.join(workdir, MUX_SPANS)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: not a co-execution group's workdir (launchers/mux.py writes it)")
  return report.read_spans(path)


def job_spans(spans: Sequence[Mapping], job: str) -> list[dict]:
  """One job's phases in a solo run's span format (runtime/spans.py `read_spans`)."""
  return [{"phase": s.get("phase", s["pool"]), "role": s["pool"], "devices": list(s.get("devices", [])),
           "step": s["step"], "gen_id": s["step"], "start": s["start"], "end": s["end"],
           **({"compile_s": s["compile_s"]} if "compile_s" in s else {})}
          for s in spans if s["job"] == job]


def per_job(spans: Sequence[Mapping]) -> dict[str, dict[str, dict]]:
  """{job: {pool: {phases, busy_s, compile_s, mean_s, migrated, moved, on_free_shards}}}, jobs in order of their
  first phase. busy_s: the pool held (a compile holds it too); compile_s: of it, the job's thread compiling (None:
  the spans predate the field); mean_s: a phase's mean seconds less its compiles. on_free_shards: rollouts run
  beside another job's tail, on the shards it left free (mux.resize)."""
  out: dict[str, dict[str, dict]] = {}
  for s in sorted(spans, key=lambda s: s["start"]):
    row = out.setdefault(s["job"], {}).setdefault(s["pool"], {"phases": 0, "busy_s": 0.0, "compile_s": None,
                                                                 "migrated": 0, "moved": 0, "on_free_shards": 0})
    row["phases"] += 1
    row["busy_s"] += s["end"] - s["start"]
    if "compile_s" in s:
      row["compile_s"] = (row["compile_s"] or 0.0) + s["compile_s"]
    row["migrated"] += s.get("migrated_at") is not None
    row["moved"] += s.get("moved_at") is not None
    row["on_free_shards"] += bool(s.get("on_rest"))
  for pools in out.values():
    for row in pools.values():
      row["mean_s"] = max(0.0, row["busy_s"] - (row["compile_s"] or 0.0)) / row["phases"]
  return out


def summary(spans: Sequence[Mapping]) -> dict:
  if not spans:
    raise ValueError("group review: no spans")
  return {"jobs": per_job(spans), "busy_fraction": report.busy_fractions(spans)}


def to_markdown(fig: Mapping) -> str:
  lines = ["# Co-execution group", "",
           "| job | pool | phases | busy s | of it compiling | mean phase s (less compiles) | migrated | moved | "
           "on free shards |",
           "|---|---|---|---|---|---|---|---|---|"]
  for job, pools in fig["jobs"].items():
    for pool, r in pools.items():
      compiling = "n/a" if r["compile_s"] is None else f"{r['compile_s']:.3f}"
      lines.append(f"| {job} | {pool} | {r['phases']} | {r['busy_s']:.3f} | {compiling} | {r['mean_s']:.3f} | "
                   f"{r['migrated']} | {r['moved']} | {r['on_free_shards']} |")
  lines += ["", "Busy fraction: " + ", ".join(f"{p} pool {v:.2f}" for p, v in fig["busy_fraction"].items()), ""]
  return "\n".join(lines)


def write_group_record(workdir: str, out_dir: str) -> dict:
  """group.md, group.json and group_timeline.png of a group's workdir into `out_dir`; returns the summary."""
  from jaxrl_topo.review import outdir

  outdir.check_out(out_dir, workdir)
  spans = read_group_spans(workdir)
  fig = summary(spans)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "group.json"), "w") as f:
    json.dump(fig, f, indent=2)
  with open(os.path.join(out_dir, "group.md"), "w") as f:
    f.write(to_markdown(fig))
  report.plot_timeline(spans, os.path.join(out_dir, "group_timeline.png"))
  return fig
