"""mux/report.py on hand-made spans: busy fractions (overlaps counted once), seconds per step, the PNG."""

import pytest

from jaxrl_topo.mux import report


def _s(job, pool, step, start, end, **kw):
  return {"job": job, "pool": pool, "step": step, "start": start, "end": end, **kw}


SPANS = [_s("a", "rollout", 0, 0, 2), _s("b", "rollout", 0, 1.5, 4, migrated_at=3.0), _s("a", "train", 0, 2, 5),
         _s("b", "train", 0, 5, 6), _s("a", "train", 1, 7, 8)]


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
