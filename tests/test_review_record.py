"""The decision record: from a config alone, and folded together with a measured run on 8 fake devices."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
from run_fixtures import tiny_cfg

from jaxrl_topo.review import simulator
from jaxrl_topo.review import step_bytes as step_lib
from jaxrl_topo.review.record import Assumptions, memory_fit, sim_params, write_record


def test_record_from_the_config_alone(tmp_path):
  cfg = tiny_cfg("disaggregated", steps=4)
  a = Assumptions(train_s=10.0, decode_tokens_per_s_per_device=500.0, per_seq_tokens_per_s=20.0)
  fig = write_record(cfg, str(tmp_path), assumptions=a)
  for name in ("record.md", "record.json", "timelines.png", "split_sweep.png"):
    assert (tmp_path / name).stat().st_size > 0
  with open(tmp_path / "record.json") as f:
    saved = json.load(f)
  want = step_lib.step_bytes(cfg)
  assert saved["bytes"]["sync_full"] == want.sync_full and saved["bytes"]["payload"] == want.payload
  params = sim_params(cfg, a, want.sync_full)
  assert params.n_devices == 8 and params.rollout_devices == 4 and params.batch_seqs == 16 and params.eta == 1
  sequential = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, max_staleness=0))
  assert sim_params(sequential, a, want.sync_full).eta == 0  # was simulated one step off
  # Its page says it runs on-policy (before: "one step off-policy", a mux job's record beside its eta = 0).
  seq = write_record(sequential, str(tmp_path / "seq"), assumptions=a)
  assert seq["why"].startswith("disjoint pools, strictly on-policy") and seq["overlaps_required"].startswith("none")
  assert fig["steps_per_hour"]["disaggregated"] == pytest.approx(
      simulator.simulate("disaggregated", params, n_steps=24).steps_per_hour(warmup=6))
  page = (tmp_path / "record.md").read_text()
  assert "eta = 1" in page and "train_s=10.0" in page and "Fastest on these figures" in page


def test_record_warns_when_the_state_cannot_fit_a_device(tmp_path):
  """A 7B model trained on one device: fp32 weights, gradients and two moments are 4 x 30.5 GB, plus
  the bf16 rollout copy colocated. Before: the record printed the 30 GB and no warning."""
  from run_fixtures import load_config

  from jaxrl_topo.runtime.config import from_config_dict

  c = load_config("grpo_task", "tiny", **{"model.preset": "qwen2.5-7b"})
  c.topology = dict(mode="colocated", trainer={"fsdp": 1}, rollout={"data": 1})
  fig = write_record(from_config_dict(c), str(tmp_path))
  mem = fig["memory"]
  assert mem["trainer_state_per_device"] == 4 * fig["bytes"]["trainer_param_bytes_per_device"]
  assert mem["largest_per_device"] == mem["trainer_state_per_device"] + fig["bytes"]["rollout_param_bytes_per_device"]
  assert not mem["fits"] and "WARNING: does not fit" in (tmp_path / "record.md").read_text()
  # Device memory is in GiB, as accelerators are sold: 82e9 bytes (76.4 GiB) fit an "80GB" H100.
  step = types.SimpleNamespace(trainer_param_bytes_per_device=20_500_000_000, sync_lora=None,
                               rollout_param_bytes_per_device=0)
  assert memory_fit(step, "disaggregated", 80.0)["fits"] and not memory_fit(step, "disaggregated", 76.0)["fits"]
  tiny = write_record(tiny_cfg("disaggregated", steps=4), str(tmp_path / "tiny"))
  assert tiny["memory"]["fits"] and "WARNING" not in (tmp_path / "tiny" / "record.md").read_text()


@pytest.mark.slow
def test_record_of_a_measured_run_is_consistent(tmp_path):
  from jaxrl_topo.runtime import run as run_lib
  from jaxrl_topo.runtime import spans as spans_lib
  from jaxrl_topo.runtime.metrics import read_metrics

  workdir = tmp_path / "run"
  cfg = tiny_cfg("disaggregated", steps=6, **{"run.eval_every": 2})  # 5 batches fitted: one slowed by the host
  # (a CI run's one batch of 3 took 8x the others) cannot set the rate (calibrate.stream_mean)
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
  # The stream's second batch holds train step 0's compile (dispatched between its decode chunks); its span says
  # so, and the fit leaves it out. Before spans carried compile_s, the predicted rollout was 15x the measured one.
  spans = spans_lib.read_spans(str(workdir))
  stream = {s["step"]: s for s in spans if s["phase"] == "rollout"}
  assert stream[1]["compile_s"] > 0.5 * (stream[1]["end"] - stream[1]["start"])
  rollout = next(c for c in fig["overlap"]["comparisons"] if c["phase"] == "rollout")
  assert 0.5 < rollout["predicted_s"] / rollout["measured_s"] < 2
  # Train step 0's span opens at its dispatch, its compile inside (before: between spans, a colocated trainer idle).
  train0 = next(s for s in spans if s["phase"] == "train" and s["step"] == 0)
  assert train0["compile_s"] > 0.5 * (train0["end"] - train0["start"])
  # The evaluations (after steps 1 and 3) decode after a drain: no rollout span covers them (before: the next
  # batch's span did, and read the evaluation as decoding).
  evals = [s for s in spans if s["phase"] == "eval"]
  assert [e["step"] for e in evals][:2] == [1, 3]
  for ev in evals:
    assert all(s["end"] <= ev["start"] or s["start"] >= ev["end"] for s in stream.values()), (ev, stream)


def _synthetic_run(workdir, spans_of_step, n_steps=8):
  """A run directory with spans, metrics and a staleness histogram (lag 1) of n_steps identical steps."""
  workdir.mkdir()
  spans = [dict(s, role="rollout" if s["phase"] == "rollout" else "trainer", step=k, gen_id=max(k - 1, 0),
                start=10.0 * k + s["start"], end=10.0 * k + s["end"]) for k in range(n_steps) for s in spans_of_step]
  rows = {"spans.jsonl": spans, "metrics.jsonl": [{"step": k, "perf/tokens": 1000.0} for k in range(n_steps)],
          "histograms.jsonl": [{"step": k, "name": "staleness", "counts": {"1": 10}} for k in range(n_steps)]}
  for name, rs in rows.items():
    (workdir / name).write_text("".join(json.dumps(r) + "\n" for r in rs))


def test_record_compares_train_without_the_logprob_pre_pass(tmp_path):
  """A run with a log-prob pre-pass (1 s) before each train step (2 s). The simulator's train phase holds both,
  but the run's train spans hold only the step. Before, the record compared 3 s against 2 s and flagged it."""
  from run_fixtures import load_config

  from jaxrl_topo.runtime.config import from_config_dict

  c = load_config("grpo_task", "tiny")
  c.topology = dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 4})
  c.rollout.continuous = False
  R, T = [0, 1, 2, 3], [4, 5, 6, 7]
  _synthetic_run(tmp_path / "run", [dict(phase="rollout", devices=R, start=0, end=4),
                                    dict(phase="logprobs", devices=T, start=4, end=5),
                                    dict(phase="train", devices=T, start=5, end=7),
                                    dict(phase="sync", devices=T, start=7, end=7.5)])
  fig = write_record(from_config_dict(c), str(tmp_path / "record"), workdir=str(tmp_path / "run"))
  assert fig["sim_params"]["train_s"] == pytest.approx(3.0)
  train = next(cmp for cmp in fig["overlap"]["comparisons"] if cmp["phase"] == "train")
  assert train["predicted_s"] == pytest.approx(2.0) and not train["flagged"]


def _disaggregated_run(workdir, lag: int = 1):
  """A measured disaggregated run (eta=1, batch 4 x 4) with its own config.json, every step's tokens `lag` old."""
  from run_fixtures import load_config

  from jaxrl_topo.runtime import run as run_lib
  from jaxrl_topo.runtime.config import from_config_dict

  c = load_config("grpo_task", "tiny", **{"data.batch_size": 4, "rl.group_size": 4, "rollout.continuous": False})
  c.topology = dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 4})
  R, T = [0, 1, 2, 3], [4, 5, 6, 7]
  _synthetic_run(workdir, [dict(phase="rollout", devices=R, start=0, end=4),
                           dict(phase="train", devices=T, start=4, end=7),
                           dict(phase="sync", devices=T, start=7, end=8)])
  (workdir / "histograms.jsonl").write_text(
      "".join(json.dumps({"step": k, "name": "staleness", "counts": {str(lag): 10}}) + "\n" for k in range(8)))
  run_lib.save_config(run_lib.config_dict(from_config_dict(c)), str(workdir))


def test_a_what_if_in_another_mode_on_the_same_devices_checks_the_run_as_it_ran(tmp_path):
  """A colocated run (8 devices) reviewed with a disaggregated 4 + 4 config at eta 1: the fit's parameters are the
  same either way, and the measured timeline was checked against the disaggregated simulation, flagging every
  phase (+100%). Now it is checked against the run's own mode."""
  from run_fixtures import load_config

  from jaxrl_topo.runtime import run as run_lib
  from jaxrl_topo.runtime.config import from_config_dict

  c = load_config("grpo_task", "tiny", **{"data.batch_size": 4, "rl.group_size": 4})
  c.topology = dict(mode="colocated", trainer={"fsdp": 8}, rollout={"data": 8})
  D = list(range(8))
  _synthetic_run(tmp_path / "run", [dict(phase="rollout", devices=D, start=0, end=4),
                                    dict(phase="train", devices=D, start=4, end=6),
                                    dict(phase="sync", devices=D, start=6, end=6.5)])
  (tmp_path / "run" / "histograms.jsonl").write_text("")  # colocated: every token on-policy
  run_lib.save_config(run_lib.config_dict(from_config_dict(c)), str(tmp_path / "run"))
  c.topology = dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 4})
  fig = write_record(from_config_dict(c), str(tmp_path / "record"), workdir=str(tmp_path / "run"))
  assert fig["mode"] == "disaggregated" and (fig["sim_params"]["n_devices"], fig["sim_params"]["eta"]) == (8, 1)
  assert not fig["overlap"]["flagged"], fig["overlap"]["comparisons"]


def test_a_what_if_config_checks_the_runs_lags_against_the_runs_own_bound(tmp_path):
  """review.py --config=<colocated> --workdir=<a disaggregated run> is a what-if on the run's phase times. Before:
  the run's lag-1 tokens were checked against the colocated config's eta=0, and the review died with
  StalenessViolation ("this is a bug, not a setting"). Now they are checked against the run's own eta=1 (its
  config.json), the record shows both bounds, and the spans are fitted at the run's batch (16 sequences, not 256)."""
  from run_fixtures import load_config

  from jaxrl_topo.review.audit import StalenessViolation
  from jaxrl_topo.runtime import run as run_lib
  from jaxrl_topo.runtime.config import from_config_dict

  _disaggregated_run(tmp_path / "run")
  what_if = from_config_dict(load_config("grpo_task", "tiny"))  # colocated, eta 0, batch 16 x 16
  fig = write_record(what_if, str(tmp_path / "record"), workdir=str(tmp_path / "run"))
  assert fig["staleness"]["eta"] == 0 and fig["staleness"]["max_observed_lag"] is None
  assert fig["run_staleness"]["eta"] == 1 and fig["run_staleness"]["max_observed_lag"] == 1
  assert fig["sim_params"]["batch_seqs"] == 16 and fig["sim_params"]["eta"] == 1  # colocated's rows simulate eta 1
  page = (tmp_path / "record" / "record.md").read_text()
  assert "Measured under the run's own bound (disaggregated, eta = 1)" in page
  assert fig["sim_params"]["n_devices"] == 1 and not fig["overlap"]["flagged"]  # the config's one device
  # Another mesh: simulated on the config's devices (before: the run's 4 + 4, whatever --config said), at the
  # run's per-device rates; the measured timeline is still checked against the run as it ran (nothing flagged).
  c = load_config("grpo_task", "tiny", **{"data.batch_size": 4, "rl.group_size": 4, "rollout.continuous": False})
  c.topology = dict(mode="disaggregated", trainer={"fsdp": 2}, rollout={"data": 2})
  four = write_record(from_config_dict(c), str(tmp_path / "four"), workdir=str(tmp_path / "run"))
  own = write_record(run_lib.load_config(str(tmp_path / "run")), str(tmp_path / "own"), workdir=str(tmp_path / "run"))
  assert (four["sim_params"]["n_devices"], four["sim_params"]["rollout_devices"]) == (4, 2)
  assert (own["sim_params"]["n_devices"], own["sim_params"]["rollout_devices"]) == (8, 4)
  assert four["sim_params"]["tokens_per_s_per_device"] == own["sim_params"]["tokens_per_s_per_device"]
  assert four["steps_per_hour"]["disaggregated"] < own["steps_per_hour"]["disaggregated"]  # half the devices
  assert not four["overlap"]["flagged"] and not own["overlap"]["flagged"]
  assert "simulated on this config's 4 devices" in four["simulator_source"]
  assert own["simulator_source"] == f"calibrated from the spans of {tmp_path / 'run'}"
  _disaggregated_run(tmp_path / "bad", lag=2)  # past the run's own bound: still a loud failure
  with pytest.raises(StalenessViolation, match="eta=1"):
    write_record(what_if, str(tmp_path / "record2"), workdir=str(tmp_path / "bad"))
  # A run recorded under an older schema (a key since removed): its bound is unknown, so its lags go unchecked.
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  saved["run"]["retired_key"] = 1
  (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
  fig = write_record(what_if, str(tmp_path / "record3"), workdir=str(tmp_path / "run"))
  assert "run_staleness" not in fig and fig["staleness"]["eta"] == 0
