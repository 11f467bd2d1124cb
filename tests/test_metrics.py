"""MetricsWriter: JSONL records, NaN -> null, resume truncation, histograms, TensorBoard events, the PNG."""

import glob
import json
import math
import os
import struct

import numpy as np
import pytest

from jaxrl_topo.runtime import metrics as M


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _tb_events(workdir):
  """Every Event proto in <workdir>/tb, in file order (TFRecord framing: len, crc, data, crc)."""
  from tensorboardX.proto import event_pb2

  events = []
  for path in sorted(glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      ev = event_pb2.Event()
      ev.ParseFromString(data[pos + 12:pos + 12 + n])
      events.append(ev)
      pos += 12 + n + 4
  return events


def _writer(workdir, **kw):
  kw.setdefault("tensorboard", False)
  kw.setdefault("progress", False)
  kw.setdefault("total_steps", 10)
  return M.MetricsWriter(str(workdir), **kw)


def test_jsonl_exact_and_numpy_conversion(tmp_path):
  w = _writer(tmp_path)
  w.log(0, {"reward_mean": 0.5, "n": np.int64(3), "loss": np.float32(0.25), "ok": True, "arr": np.array(2.0)})
  w.log(1, {"reward_mean": 1.0, "mode": "async", "missing": None})
  # Flushed per line: readable before close.
  assert _lines(tmp_path / "metrics.jsonl") == [
    {"step": 0, "reward_mean": 0.5, "n": 3, "loss": 0.25, "ok": True, "arr": 2.0},
    {"step": 1, "reward_mean": 1.0, "mode": "async", "missing": None},
  ]
  rec = M.read_metrics(str(tmp_path))[0]
  assert type(rec["n"]) is int and type(rec["loss"]) is float
  assert w.close(plot=False) is None
  assert w.close() is None  # idempotent


def test_nonfinite_written_as_null(tmp_path):
  w = _writer(tmp_path)
  w.log(0, {"a": float("nan"), "b": np.float32(np.inf), "c": -math.inf, "d": 1.5})
  w.close(plot=False)
  text = (tmp_path / "metrics.jsonl").read_text()
  assert "NaN" not in text and "Infinity" not in text
  assert M.read_metrics(str(tmp_path)) == [{"step": 0, "a": None, "b": None, "c": None, "d": 1.5}]


def test_fresh_run_overwrites(tmp_path):
  w = _writer(tmp_path)
  w.log(0, {"x": 1})
  w.close(plot=False)
  w = _writer(tmp_path)
  w.log(0, {"x": 2})
  w.close(plot=False)
  assert M.read_metrics(str(tmp_path)) == [{"step": 0, "x": 2}]


def test_resume_truncates_later_steps(tmp_path):
  w = _writer(tmp_path)
  for s in range(5):
    w.log(s, {"x": s, "reward_mean": float(s)})
    w.log_histogram(s, "staleness", [0, 1, 1])
  w.close(plot=False)
  # Simulate a process killed mid-write: a truncated last line is ignored on read and dropped on resume.
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 5, "x"')
  assert [r["step"] for r in M.read_metrics(str(tmp_path))] == [0, 1, 2, 3, 4]

  w = _writer(tmp_path, start_step=3, resume=True)
  for s in range(3, 6):
    w.log(s, {"x": 100 + s, "reward_mean": float(s)})
    w.log_histogram(s, "staleness", [2])
  with pytest.raises(ValueError, match="start_step"):
    w.log(2, {"x": 0})
  w.close(plot=False)
  recs = M.read_metrics(str(tmp_path))
  assert [r["step"] for r in recs] == [0, 1, 2, 3, 4, 5]
  assert [r["x"] for r in recs] == [0, 1, 2, 103, 104, 105]
  hists = M.read_histograms(str(tmp_path))
  assert [(h["step"], h["counts"]) for h in hists] == [(s, {"0": 1, "1": 2}) for s in range(3)] + [
    (s, {"2": 1}) for s in range(3, 6)]


def test_malformed_middle_line_raises(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
  with pytest.raises(ValueError, match="malformed"):
    M.read_metrics(str(tmp_path))
  with pytest.raises(FileNotFoundError):
    M.read_metrics(str(tmp_path / "nope"))


def test_spans_skip_a_torn_last_line_as_metrics_do(tmp_path):
  """A run killed while writing a span left a torn last line; every relaunch then failed with a bare
  "Unterminated string" (read_spans parsed every line)."""
  from jaxrl_topo.runtime.spans import read_spans

  span = {"phase": "train", "role": "trainer", "devices": [0], "step": 0, "gen_id": 0, "start": 0.0, "end": 1.0}
  (tmp_path / "spans.jsonl").write_text(json.dumps(span) + '\n{"phase": "rollout", "role": "rol')
  assert read_spans(str(tmp_path)) == [span]
  (tmp_path / "spans.jsonl").write_text('not json\n' + json.dumps(span) + "\n")
  with pytest.raises(ValueError, match=r"spans.jsonl:1: malformed"):
    read_spans(str(tmp_path))


def test_histogram_file(tmp_path):
  w = _writer(tmp_path)
  w.log_histogram(0, "staleness", [1, 0, 1, 2, 1])
  w.log_histogram(1, "staleness", np.array([0.0, 0.0, 3.0]))
  w.log_histogram(1, "frac", [0.5, 0.5])
  w.log_histogram(2, "empty", [])
  with pytest.raises(ValueError, match="finite"):
    w.log_histogram(3, "bad", [1.0, float("nan")])
  w.close(plot=False)
  assert _lines(tmp_path / "histograms.jsonl") == [
    {"step": 0, "name": "staleness", "counts": {"0": 1, "1": 3, "2": 1}},
    {"step": 1, "name": "staleness", "counts": {"0": 2, "3": 1}},
    {"step": 1, "name": "frac", "counts": {"0.5": 2}},
    {"step": 2, "name": "empty", "counts": {}},
  ]


def test_tensorboard_scalars_and_histogram(tmp_path):
  w = _writer(tmp_path, tensorboard=True)
  w.log(0, {"reward_mean": 0.25, "mode": "x"})
  w.log(1, {"reward_mean": 0.75, "perf/tokens_per_s": np.float32(10.0)})
  w.log_histogram(1, "staleness", [0, 1, 1])
  w.close(plot=False)
  events = _tb_events(str(tmp_path))
  scalars = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value if v.HasField("simple_value")]
  assert scalars == [(0, "reward_mean", 0.25), (1, "reward_mean", 0.75), (1, "perf/tokens_per_s", 10.0)]
  histos = [(e.step, v.tag, v.histo) for e in events for v in e.summary.value if v.HasField("histo")]
  assert len(histos) == 1 and histos[0][:2] == (1, "staleness")
  assert histos[0][2].num == 3 and [c for c in histos[0][2].bucket if c] == [1, 2]


def test_tensorboard_resume_purges(tmp_path):
  w = _writer(tmp_path, tensorboard=True)
  w.log(0, {"x": 1.0})
  w.close(plot=False)
  w = _writer(tmp_path, tensorboard=True, start_step=3, resume=True)
  w.close(plot=False)
  from tensorboardX.proto import event_pb2

  starts = [e.step for e in _tb_events(str(tmp_path)) if e.session_log.status == event_pb2.SessionLog.START]
  assert 3 in starts


def test_png_written(tmp_path):
  w = _writer(tmp_path, progress=True)
  for s in range(6):
    rec = {"reward_mean": 0.1 * s, "reward_std": 0.05, "time/step_s": 0.01}
    if s % 2 == 0:
      rec["eval/accuracy"] = 0.2 + 0.1 * s
    w.log(s, rec)
  path = w.close()
  assert path == os.path.join(str(tmp_path), "reward_curve.png")
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(path) > 1000


def test_reward_curve_shows_accuracy_before_and_after_on_a_fixed_axis():
  records = [{"step": s, "reward_mean": 0.1 * s} for s in range(4)]
  records[1]["eval/accuracy"] = 0.5  # measured after step 1's update: drawn at 2
  fig = M.reward_curve_figure(records, "run", accuracy=(0.363, 0.9))
  ax, ax2 = fig.axes
  (line,) = ax2.get_lines()
  assert line.get_xdata().tolist() == [0, 2, 4] and line.get_ydata().tolist() == [0.363, 0.5, 0.9]
  assert ax2.get_ylim() == (-0.02, 1.02)  # not zoomed on the points
  assert "0.363 -> 0.900" in ax.get_title()


def test_png_none_without_reward(tmp_path):
  w = _writer(tmp_path)
  w.log(0, {"loss": 1.0})
  assert w.close() is None
  assert not os.path.exists(tmp_path / "reward_curve.png")


def test_comparable_drops_timing_keys():
  recs = [{"step": 0, "reward_mean": 0.5, "time/step_s": 1.2, "perf/mfu": 0.3, "wall_s": 9.0, "tokens_per_s": 5.0,
           "rollout/tokens_per_s": 7.0, "loss": 0.1}]
  assert M.comparable(recs) == [{"step": 0, "reward_mean": 0.5, "loss": 0.1}]
  assert M.comparable(recs, drop_prefixes=(), drop_keys=()) == recs


def test_errors(tmp_path):
  with pytest.raises(ValueError, match="start_step"):
    _writer(tmp_path, total_steps=3, start_step=4)
  w = _writer(tmp_path)
  with pytest.raises(ValueError, match="'step'"):
    w.log(0, {"step": 1})
  with pytest.raises(TypeError, match="scalar"):
    w.log(0, {"v": np.zeros(3)})
  with pytest.raises(TypeError, match="number"):
    w.log(0, {"v": [1, 2]})
  w.close(plot=False)
  with pytest.raises(RuntimeError, match="close"):
    w.log(1, {"x": 1})


def test_eval_scores_by_hand():
  """3 prompts x 3 samples, scores [[1, 0, 0], [0, 0, 0], [1, 1, 0.5]]: accuracy 3.5/9; pass@3 = mean of the
  best (1, 0, 1) = 2/3. One sample a prompt: accuracy only."""
  from jaxrl_topo.runtime.rollout_side import eval_scores

  got = eval_scores(np.array([[1, 0, 0], [0, 0, 0], [1, 1, 0.5]]))
  assert got.keys() == {"eval/accuracy", "eval/pass@3"}
  np.testing.assert_allclose([got["eval/accuracy"], got["eval/pass@3"]], [3.5 / 9, 2 / 3])
  assert eval_scores(np.array([[1.0], [0.0]])) == {"eval/accuracy": 0.5}
  # no held-out prompts (e.g. all over data.max_prompt_len): every key the summary reads, unmeasured (before: the
  # summary's pass@k raised a KeyError after the last step)
  from types import SimpleNamespace

  from jaxrl_topo.runtime.rollout_side import evaluate_metrics

  none = evaluate_metrics(SimpleNamespace(heldout=[], cfg=SimpleNamespace(run=SimpleNamespace(eval_samples=3))))
  assert none.keys() == {"eval/accuracy", "eval/pass@3"} and all(np.isnan(v) for v in none.values())


def test_a_kill_between_a_steps_histogram_and_its_line_redoes_both(tmp_path, monkeypatch):
  """Before: the metrics line went first; a Ctrl-C before the staleness histogram lost it for good (lost_line reads
  metrics.jsonl only: a resume went on from the next step, histograms.jsonl short of the step)."""
  from run_fixtures import tiny_cfg

  from jaxrl_topo.runtime import run

  cfg = tiny_cfg("async", 8)
  m = {"loss": 0.5, "_lags": [0, 1, 1]}
  landed = run.landed_meta(m)
  writer = M.MetricsWriter(str(tmp_path), total_steps=8, tensorboard=False, progress=False)

  def killed(*a, **k):
    raise KeyboardInterrupt

  monkeypatch.setattr(writer, "log_histogram", killed)
  with pytest.raises(KeyboardInterrupt):
    run._log_step(cfg, writer, 7, dict(m))
  writer.close(plot=False)
  assert run.lost_line(cfg, str(tmp_path), 8, landed)  # the resume logs step 7 again: its histogram and its line
  monkeypatch.undo()
  writer = M.MetricsWriter(str(tmp_path), total_steps=8, tensorboard=False, progress=False, start_step=7, resume=True)
  run._log_step(cfg, writer, 7, run.landed_metrics(landed))
  writer.close(plot=False)
  assert not run.lost_line(cfg, str(tmp_path), 8, landed)
  assert [r["step"] for r in M.read_jsonl(str(tmp_path / "histograms.jsonl"))] == [7]
