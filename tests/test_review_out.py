"""Where launchers/review.py may write its record: --out is refused, before anything is read or written, when it is a
file, a run's workdir or one of the run's own folders, a multiplexed group's directory or a model directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from run_fixtures import ROOT, tiny_cfg
from subproc import cpu_env

from jaxrl_topo.review import group
from jaxrl_topo.review.outdir import check_out
from jaxrl_topo.review.record import write_record


def _run(workdir, n_steps: int = 4):
  """A run's workdir as train.py leaves it: config.json, a checkpoint, and the spans, metrics and staleness
  histograms a review reads (a disaggregated run on 4 + 4 devices, one step off-policy)."""
  from jaxrl_topo.runtime import run as run_lib

  run_lib.save_config(run_lib.config_dict(tiny_cfg("disaggregated", steps=n_steps)), str(workdir))
  os.makedirs(workdir / "checkpoints" / str(n_steps))
  phases = (("rollout", [0, 1, 2, 3], 0, 4), ("train", [4, 5, 6, 7], 4, 7), ("sync", [4, 5, 6, 7], 7, 8))
  rows = {"spans.jsonl": [{"phase": p, "role": "rollout" if p == "rollout" else "trainer", "devices": d, "step": k,
                           "gen_id": max(k - 1, 0), "start": 10.0 * k + a, "end": 10.0 * k + b}
                          for k in range(n_steps) for p, d, a, b in phases],
          "metrics.jsonl": [{"step": k, "perf/tokens": 200.0} for k in range(n_steps)],
          "histograms.jsonl": [{"step": k, "name": "staleness", "counts": {"1": 10}} for k in range(n_steps)]}
  for name, rs in rows.items():
    (workdir / name).write_text("".join(json.dumps(r) + "\n" for r in rs))
  return workdir


def _model(directory):
  """A Hugging Face model directory: its config.json and weights."""
  os.makedirs(directory)
  (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
  (directory / "model.safetensors").write_bytes(b"0")
  return directory


def _listing(root) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


def test_the_record_is_not_written_into_a_run_a_model_or_over_a_file(tmp_path):
  """Before: --out=<the run's workdir>, its checkpoints/ or a model directory got record.md, record.json and
  timelines.png (files in checkpoints/ then made train.py --fresh refuse the workdir); --out=<a file> died on a raw
  [Errno 17]. Each is now one ValueError, and nothing is written."""
  run, model = _run(tmp_path / "run"), _model(tmp_path / "model")
  (tmp_path / "file.txt").write_text("x")
  cfg = tiny_cfg("disaggregated", steps=4)
  cases = [(run, "is a run's workdir"), (run / "checkpoints", "own checkpoints/"),
           (run / "checkpoints" / "4", "own checkpoints/"), (run / "tb", "own tb/"),
           (model, "a model directory"), (tmp_path / "file.txt", "is a file")]
  before = _listing(tmp_path)
  for out, words in cases:
    with pytest.raises(ValueError, match=words):
      write_record(cfg, str(out))
    with pytest.raises(ValueError, match=words):
      check_out(str(out), str(run))
  assert _listing(tmp_path) == before
  with pytest.raises(ValueError, match="is a run's workdir"):  # the --workdir given, even without a config.json
    check_out(str(tmp_path / "bare"), str(tmp_path / "bare"))


def test_a_group_review_is_not_written_into_the_group(tmp_path):
  """Before: --out=<a mux group's workdir> put group.md and group.json among the group's own files."""
  span = {"job": "a", "pool": "train", "phase": "train", "role": "train", "step": 0, "start": 0.0, "end": 1.0,
          "devices": [0]}
  (tmp_path / "mux_spans.jsonl").write_text(json.dumps(span) + "\n")
  group.write_group_record(str(tmp_path), str(tmp_path / "rv"))  # the group's review beside its files: fine
  with pytest.raises(ValueError, match="multiplexed group's directory"):
    group.write_group_record(str(tmp_path), str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ["mux_spans.jsonl", "rv"]


def test_a_folder_of_its_own_inside_a_run_is_fine(tmp_path):
  """The README's `--workdir=runs/grpo --out=runs/grpo/review`, a new folder, and the same folder again."""
  run = _run(tmp_path / "run")
  cfg = tiny_cfg("disaggregated", steps=4)
  for out in (run / "review", tmp_path / "new" / "rv", run / "review"):
    check_out(str(out), str(run))
    write_record(cfg, str(out))
    assert (out / "record.md").stat().st_size > 0


def test_the_launcher_refuses_in_one_line_before_reading_the_run(tmp_path):
  """`review.py --workdir=RUN --out=RUN/checkpoints`: status 2, one error line (no traceback), RUN's checkpoints/
  untouched."""
  run = _run(tmp_path / "run")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "review.py"), f"--workdir={run}",
                      f"--out={run / 'checkpoints'}"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                     env=cpu_env())
  assert r.returncode == 2 and r.stderr.startswith("error: --out=") and "own checkpoints/" in r.stderr, r.stderr[-3000:]
  assert "Traceback" not in r.stderr and os.listdir(run / "checkpoints") == ["4"]
  # A group with --config (a what-if): one line naming the group. Before: "no metrics file at ...: was a
  # MetricsWriter created with workdir=...?"
  (tmp_path / "group").mkdir()
  (tmp_path / "group" / "mux_spans.jsonl").write_text("")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "review.py"), f"--workdir={tmp_path / 'group'}",
                      "--config=configs/grpo_task.py:tiny", f"--out={tmp_path / 'rv'}"], capture_output=True,
                     text=True, cwd=ROOT, timeout=300, env=cpu_env())
  assert r.returncode == 2 and "is a multiplexed group: its review takes no --config" in r.stderr, r.stderr[-3000:]
  assert not (tmp_path / "rv").exists()
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "review.py"), f"--workdir={run}",
                      f"--out={run / 'review'}"], capture_output=True, text=True, cwd=ROOT, timeout=300, env=cpu_env())
  assert r.returncode == 0 and (run / "review" / "record.md").is_file(), r.stderr[-3000:]
