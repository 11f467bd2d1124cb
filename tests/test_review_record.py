"""The decision record: from a config alone, and folded together with a measured run on 8 fake devices."""

from __future__ import annotations

import json

import pytest
from test_rl_loop import _cfg

from jaxrl_topo.review import simulator
from jaxrl_topo.review import step_bytes as step_lib
from jaxrl_topo.review.record import Assumptions, sim_params, write_record


def test_record_from_the_config_alone(tmp_path):
  cfg = _cfg("disaggregated", steps=4)
  a = Assumptions(train_s=10.0, decode_tokens_per_s_per_device=500.0, per_seq_tokens_per_s=20.0)
  fig = write_record(cfg, str(tmp_path), assumptions=a)
  for name in ("record.md", "record.json", "timelines.png", "split_sweep.png"):
    assert (tmp_path / name).stat().st_size > 0
  with open(tmp_path / "record.json") as f:
    saved = json.load(f)
  want = step_lib.step_bytes(cfg)
  assert saved["bytes"]["sync_full"] == want.sync_full and saved["bytes"]["payload"] == want.payload
  params = sim_params(cfg, a, want.sync_full)
  assert params.n_devices == 8 and params.rollout_devices == 4 and params.batch_seqs == 16
  assert fig["steps_per_hour"]["disaggregated"] == pytest.approx(
      simulator.simulate("disaggregated", params, n_steps=24).steps_per_hour(warmup=6))
  page = (tmp_path / "record.md").read_text()
  assert "eta = 1" in page and "train_s=10.0" in page and "Fastest on these figures" in page


def test_record_warns_when_the_state_cannot_fit_a_device(tmp_path):
  """A 7B model trained on one device: fp32 weights, gradients and two moments are 4 x 30.5 GB, plus
  the bf16 rollout copy colocated. Before: the record printed the 30 GB and no warning."""
  from test_rl_loop import load_config

  from jaxrl_topo.runtime.config import from_config_dict

  c = load_config("grpo_task", "tiny", **{"model.preset": "qwen2.5-7b"})
  c.topology = dict(mode="colocated", trainer={"fsdp": 1}, rollout={"data": 1})
  fig = write_record(from_config_dict(c), str(tmp_path))
  mem = fig["memory"]
  assert mem["trainer_state_per_device"] == 4 * fig["bytes"]["trainer_param_bytes_per_device"]
  assert mem["largest_per_device"] == mem["trainer_state_per_device"] + fig["bytes"]["rollout_param_bytes_per_device"]
  assert not mem["fits"] and "WARNING: does not fit" in (tmp_path / "record.md").read_text()
  tiny = write_record(_cfg("disaggregated", steps=4), str(tmp_path / "tiny"))
  assert tiny["memory"]["fits"] and "WARNING" not in (tmp_path / "tiny" / "record.md").read_text()


@pytest.mark.slow
def test_record_of_a_measured_run_is_consistent(tmp_path):
  from jaxrl_topo.runtime import run as run_lib
  from jaxrl_topo.runtime.metrics import read_metrics

  workdir = tmp_path / "run"
  cfg = _cfg("disaggregated", steps=4)
  run_lib.train(cfg, str(workdir), progress=False)
  fig = write_record(cfg, str(tmp_path / "record"), workdir=str(workdir))
  measured = read_metrics(str(workdir))
  # Predicted sync bytes equal what the run's weight syncs moved.
  assert {r["sync/bytes"] for r in measured} == {fig["bytes"]["sync_full"]}
  # The observed staleness is within the bound and reaches it (one step off-policy).
  assert fig["staleness"]["max_observed_lag"] == 1
  phases = {p["phase"] for p in fig["overlap"]["phases"]} if isinstance(fig["overlap"]["phases"], list) else set(
      fig["overlap"]["phases"])
  assert {"rollout", "train", "sync"} <= phases
  assert "measured timeline" in (tmp_path / "record" / "record.md").read_text().lower()
  assert fig["simulator_source"].startswith("calibrated")
