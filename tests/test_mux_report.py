"""mux/report.py on hand-made spans: busy fractions (overlaps counted once), seconds per step, the PNG."""

import pytest

from jaxrl_topo.mux import report


def _s(job, pool, step, start, end, **kw):
  return {"job": job, "pool": pool, "step": step, "start": start, "end": end, **kw}


SPANS = [_s("a", "rollout", 0, 0, 2), _s("b", "rollout", 0, 1.5, 4, migrated_at=3.0, on_rest=True),
         _s("a", "train", 0, 2, 5), _s("b", "train", 0, 5, 6), _s("a", "train", 1, 7, 8)]


def test_busy_fractions_count_overlapping_phases_once():
  got = report.busy_fractions(SPANS)  # window [0, 8]
  assert got == {"rollout": pytest.approx(4 / 8), "train": pytest.approx(5 / 8)}
  assert report.busy_fractions(SPANS, t_from=5) == {"rollout": 0.0, "train": pytest.approx(2 / 3)}
  with pytest.raises(ValueError, match="no spans"):
    report.busy_fractions([])


def test_steady_state_and_seconds_per_step():
  assert report.steady_start(SPANS) == 6  # both jobs' step 0 trained
  assert report.seconds_per_step(SPANS, "a") == 3.0  # train ends 5 -> 8
  with pytest.raises(ValueError, match="job b"):
    report.seconds_per_step(SPANS, "b")


def test_timeline_png_is_written(tmp_path):
  path = report.plot_timeline(SPANS, str(tmp_path / "t.png"))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_review_of_a_group_workdir_shows_each_jobs_phases(tmp_path):
  """review/group.py and `launchers/review.py --workdir=<a mux workdir>` read mux_spans.jsonl."""
  import json
  import os
  import subprocess
  import sys

  from jaxrl_topo.review import group

  with open(tmp_path / "mux_spans.jsonl", "w") as f:
    f.writelines(json.dumps({**s, "phase": s["pool"], "devices": [0]}) + "\n" for s in SPANS)
  fig = group.summary(group.read_group_spans(str(tmp_path)))
  assert fig["jobs"]["a"]["train"] == {"phases": 2, "busy_s": 4.0, "compile_s": None, "mean_s": 2.0, "migrated": 0,
                                       "moved": 0, "on_free_shards": 0}
  compiled = [{**s, "compile_s": 1.5 if s["pool"] == "train" and s["step"] == 0 else 0.0} for s in SPANS]
  row = group.summary(compiled)["jobs"]["a"]["train"]
  assert (row["busy_s"], row["compile_s"], row["mean_s"]) == (4.0, 1.5, 1.25)  # (4 - 1.5) / 2
  assert [s["compile_s"] for s in group.job_spans(compiled, "a")] == [0.0, 1.5, 0.0]
  assert "| a | train | 2 | 4.000 | 1.500 | 1.250 | 0 | 0 | 0 |" in group.to_markdown(group.summary(compiled))
  assert fig["jobs"]["b"]["rollout"]["migrated"] == 1 and fig["jobs"]["b"]["rollout"]["busy_s"] == 2.5
  assert fig["jobs"]["b"]["rollout"]["on_free_shards"] == 1
  assert [(s["role"], s["step"], s["start"]) for s in group.job_spans(SPANS, "a")] == \
      [("rollout", 0, 0), ("train", 0, 2), ("train", 1, 7)]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, os.path.join(root, "launchers", "review.py"), f"--workdir={tmp_path}",
                        f"--out={tmp_path / 'rev'}"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert "| a | train | 2 | 4.000 | n/a | 2.000 | 0 | 0 | 0 |" in out.stdout
  assert (tmp_path / "rev" / "group_timeline.png").stat().st_size > 0
  with pytest.raises(FileNotFoundError, match="not a co-execution group"):
    group.read_group_spans(str(tmp_path / "rev"))
