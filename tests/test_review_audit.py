"""review/audit.py: staleness and overlap audits on hand-built timelines and histograms (no RL loop runs)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest

from jaxrl_topo.review import audit
from jaxrl_topo.runtime.config import from_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config_dict():
  spec = importlib.util.spec_from_file_location("grpo_task", os.path.join(ROOT, "configs", "grpo_task.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config("tiny")


def _cfg(mode="colocated", eta=1, policy="keep_kv", **rl):
  cfg = from_config_dict(_config_dict())
  cfg = dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology, mode=mode),
                            run=dataclasses.replace(cfg.run, max_staleness=eta),
                            rollout=dataclasses.replace(cfg.rollout, update_policy=policy))
  return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, **rl)) if rl else cfg


def _span(phase, step, start, end, devices):
  role = {"train": "trainer", "sync": "trainer->rollout", "reward": "reward"}.get(phase, "rollout")
  return {"phase": phase, "role": role, "devices": devices, "step": step, "gen_id": step, "start": start, "end": end}


DEV = [0]  # colocated: one device set for both roles
T, R, BOTH = [0, 1], [2, 3], [0, 1, 2, 3]  # disaggregated


def _colocated_timeline():
  """Two steps, strictly sequential: rollout 2 s, reward 0.5, train 2, sync 0.5 (10 s in all)."""
  out = []
  for k, t in ((0, 0.0), (1, 5.0)):
    out += [_span("rollout", k, t, t + 2, DEV), _span("reward", k, t + 2, t + 2.5, []),
            _span("train", k, t + 2.5, t + 4.5, DEV), _span("sync", k, t + 4.5, t + 5, DEV)]
  return out


def _disaggregated_timeline():
  """rollout 0 [0,2], reward 0 [2,2.5]; train 0 dispatched at 2.5 ends 5.5 while rollout 1 [2.5,4.5] and
  reward 1 [4.5,5] run; sync 0 [5.5,6]; train 1 [6,9]; sync 1 [9,9.5]."""
  return [_span("rollout", 0, 0, 2, R), _span("reward", 0, 2, 2.5, []), _span("train", 0, 2.5, 5.5, T),
          _span("rollout", 1, 2.5, 4.5, R), _span("reward", 1, 4.5, 5, []), _span("sync", 0, 5.5, 6, BOTH),
          _span("train", 1, 6, 9, T), _span("sync", 1, 9, 9.5, BOTH)]


# ---------------------------------------------------------------- overlap


def test_colocated_timeline_serialised_and_idle_exact():
  rep = audit.overlap_audit(_colocated_timeline())
  assert rep.makespan_s == pytest.approx(10.0) and rep.n_steps == 2
  assert rep.phases["rollout"].total_s == pytest.approx(4.0)
  assert rep.phases["train"].median_step_s == pytest.approx(2.0)
  assert rep.phases["sync"].median_step_s == pytest.approx(0.5)
  assert rep.overlapped == []
  assert len(rep.serialised) == 6  # every pair of the 4 phases
  assert rep.idle["trainer"].busy_s == pytest.approx(5.0)  # train 4 + sync 1
  assert rep.idle["trainer"].idle_frac == pytest.approx(0.5)
  assert rep.idle["rollout"].idle_frac == pytest.approx(0.5)  # rollout 4 + sync 1
  assert rep.idle["shared"].idle_frac == pytest.approx(0.1)  # only the host-side reward leaves devices idle
  json.dumps(rep.to_dict())
  assert "| rollout |" in rep.to_markdown()


def test_a_phases_compile_seconds_are_shown_and_left_out_of_its_median():
  """A span carries the XLA compile inside it (runtime/spans.py): the phase's total keeps it, shows it, and its
  per-step median leaves it out, as the simulator's prediction does."""
  spans = _colocated_timeline()
  spans[6] = {**spans[6], "end": spans[6]["end"] + 10.0, "compile_s": 10.0}  # train step 1 compiled 10 s
  spans[2] = {**spans[2], "end": spans[2]["end"] + 3.0, "compile_s": 3.0}  # train step 0 too, 3 s
  rep = audit.overlap_audit(spans, {"train": 2.0})
  assert rep.phases["train"].total_s == pytest.approx(17.0) and rep.phases["train"].compile_s == pytest.approx(13.0)
  assert rep.phases["train"].median_step_s == pytest.approx(2.0) and not rep.flagged
  assert "| train | 2 | 17.000 | 13.000 | 2.000 | 2.000 | +0% |" in rep.to_markdown()


def test_the_medians_skip_the_steps_the_fit_skips():
  """The review's fit skips step 0 (its programs' first runs); the measured medians compared with it did not, so a
  short run's slow first step moved them. A phase with no later step keeps its own."""
  spans = _colocated_timeline()
  spans[2] = {**spans[2], "end": spans[2]["end"] + 10.0}  # train step 0: 12 s, step 1: 2 s
  spans = [s for s in spans if not (s["phase"] == "sync" and s["step"] == 1)]
  assert audit.overlap_audit(spans).phases["train"].median_step_s == pytest.approx(7.0)
  rep = audit.overlap_audit(spans, {"train": 2.0}, skip_steps=1)
  assert rep.phases["train"].median_step_s == pytest.approx(2.0) and not rep.flagged
  assert rep.phases["train"].total_s == pytest.approx(14.0)  # totals keep every step
  assert rep.phases["sync"].median_step_s == pytest.approx(0.5)  # step 0 only: its own
  assert "| median s/step (from step 1) |" in rep.to_markdown()
  # A stream's empty tile (two batches finished by one drain: the second's span is [t, t]) is no step's time
  spans += [_span("rollout", 2, 12.0, 14.0, DEV), _span("rollout", 3, 14.0, 14.0, DEV),
            _span("rollout", 4, 14.0, 14.0, DEV)]  # counted, the median of 2, 2, 0, 0 was 1
  assert audit.overlap_audit(spans, skip_steps=1).phases["rollout"].median_step_s == pytest.approx(2.0)


def test_disaggregated_rollout_overlaps_train_exactly():
  rep = audit.overlap_audit(_disaggregated_timeline())
  ro_tr = rep.overlap("rollout", "train")
  assert ro_tr.overlap_s == pytest.approx(2.0)  # rollout 1 [2.5, 4.5] inside train 0 [2.5, 5.5]
  assert ro_tr.frac_of_a == pytest.approx(2.0 / 4.0) and ro_tr.frac_of_b == pytest.approx(2.0 / 6.0)
  assert rep.overlap("train", "rollout").frac_of_a == pytest.approx(2.0 / 6.0)
  assert rep.overlap("reward", "train").overlap_s == pytest.approx(0.5)  # reward 1 [4.5, 5]
  assert ("rollout", "reward") in rep.serialised and ("train", "sync") in rep.serialised
  assert rep.makespan_s == pytest.approx(9.5)
  assert rep.idle["trainer"].idle_frac == pytest.approx(1 - 7.0 / 9.5)  # train 6 + sync 1
  assert rep.idle["rollout"].idle_frac == pytest.approx(1 - 5.0 / 9.5)  # rollout 4 + sync 1
  assert rep.idle["trainer"].devices == (0, 1) and rep.idle["rollout"].devices == (2, 3)
  assert "shared" not in rep.idle
  d = json.loads(json.dumps(rep.to_dict()))
  assert ["rollout", "train"] in d["overlapped"]


def test_prediction_flags_30_percent_not_10():
  rep = audit.overlap_audit(_colocated_timeline(), predicted={"train": 2.0 / 1.3, "rollout": 2.0 / 1.1,
                                                              "eval": 1.0})
  by = {c.phase: c for c in rep.comparisons}
  assert by["train"].rel_err == pytest.approx(0.3) and by["train"].flagged
  assert by["rollout"].rel_err == pytest.approx(0.1) and not by["rollout"].flagged
  assert by["eval"].measured_s is None and by["eval"].flagged  # predicted but never ran
  assert rep.flagged == ["train", "eval"]
  assert "**FLAG**" in rep.to_markdown()
  assert audit.overlap_audit(_colocated_timeline(), {"train": 2.0 / 1.3}, tolerance=0.35).flagged == []


def test_overlap_bad_input():
  with pytest.raises(ValueError, match="no spans"):
    audit.overlap_audit([])
  with pytest.raises(ValueError, match="span 0"):
    audit.overlap_audit([_span("train", 0, 3.0, 1.0, T)])
  with pytest.raises(ValueError, match="predicted"):
    audit.overlap_audit(_colocated_timeline(), {"train": -1.0})


# ---------------------------------------------------------------- staleness


def _hist(step, counts):
  return {"step": step, "name": "staleness", "counts": {str(k): v for k, v in counts.items()}}


def test_staleness_within_eta_passes():
  cfg = _cfg("disaggregated", eta=1)
  hists = [_hist(0, {0: 32}), _hist(1, {1: 32}), _hist(2, {1: 30}), {"step": 2, "name": "other", "counts": {"9": 1}}]
  rep = audit.check_staleness(audit.staleness_audit(cfg, hists))
  assert rep.eta == 1 and rep.max_observed_lag == 1
  assert rep.lag_histogram == {0: 32, 1: 62}
  assert rep.step_max_lag == {0: 0, 1: 1, 2: 1} and rep.violations == []
  json.dumps(rep.to_dict())
  assert "within eta" in rep.to_markdown()


def test_staleness_beyond_eta_raises_naming_the_step():
  rep = audit.staleness_audit(_cfg("async", eta=1), [_hist(0, {0: 8}), _hist(3, {0: 4, 1: 4, 2: 1})])
  assert rep.violations == [(3, 2)]
  with pytest.raises(audit.StalenessViolation, match=r"step 3 trained on tokens 2 weight versions old.*eta=1"):
    audit.check_staleness(rep)
  colocated = audit.staleness_audit(_cfg("colocated"), [_hist(5, {1: 2})])  # colocated: eta is 0
  with pytest.raises(AssertionError, match="step 5"):
    audit.check_staleness(colocated)
  from_metrics = audit.staleness_audit(_cfg("disaggregated", eta=1), [], metrics=[{"step": 7, "staleness/max": 3}])
  assert from_metrics.violations == [(7, 3)]
  # A token from the future is a violation even when the same step also holds valid lags (only the step's
  # largest lag was checked before).
  future = audit.staleness_audit(_cfg("async", eta=1), [_hist(3, {-1: 4, 1: 6})])
  assert future.violations == [(3, -1)]
  with pytest.raises(audit.StalenessViolation, match="step 3 trained on tokens -1"):
    audit.check_staleness(future)


def test_enforcement_text_per_mode():
  co, dis = audit.staleness_audit(_cfg("colocated")), audit.staleness_audit(_cfg("disaggregated", eta=1))
  asy = audit.staleness_audit(_cfg("async", eta=2, policy="abort_and_resume"))
  assert co.eta == 0 and dis.eta == 1 and asy.eta == 2
  for rep in (co, dis, asy):
    assert "runtime/loop.py" in rep.enforcement and "produced <= version + eta" in rep.enforcement
    assert "checked after landing" in rep.enforcement
  assert "one device set" in co.enforcement and "nothing is in flight" in co.in_flight
  assert "one version behind" in dis.enforcement and "between batches" in dis.in_flight
  assert "later batches' sequences" in dis.in_flight  # the continuous stream (the default)
  assert "has no effect" in audit.in_flight_text("disaggregated", "keep_kv", continuous=False)
  assert "land_after_chunks=4" in asy.enforcement and "between decode chunks" in asy.in_flight
  assert "re-prefilled" in asy.in_flight and set(asy.to_dict()["update_policies"]) == set(audit.UPDATE_POLICY_TEXT)
  assert "K/V cached under the old weights" in audit.staleness_audit(_cfg("async", eta=1)).in_flight
  assert "finish on the old weights" in audit.staleness_audit(_cfg("async", eta=1, policy="finish_on_old")).in_flight
  assert audit.staleness_audit(_cfg("async", eta=1), None).max_observed_lag is None


def test_is_correction_on_and_off():
  on = audit.staleness_audit(_cfg("async", eta=1, is_cap=2.0, is_mask_high=5.0))
  assert on.corrected and "min(pi_old/mu, is_cap=2.0)" in on.correction and "[-inf, 5.0]" in on.correction
  assert on.warnings == ()
  seq = audit.staleness_audit(_cfg("async", eta=1, is_cap=2.0, is_mask_high=5.0, is_level="geometric")).correction
  assert "min((prod_t pi_old/mu)^(1/len), is_cap=2.0) per sequence" in seq and "sequences whose ratio" in seq
  off = audit.staleness_audit(_cfg("async", eta=1, is_cap=None))
  assert not off.corrected and off.correction.startswith("not corrected")
  assert any("not corrected" in w and "eta=1" in w for w in off.warnings)
  assert "**Warning**" in off.to_markdown()


def test_read_run(tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    f.write(_config_dict().to_json())
  spans = _colocated_timeline()
  with open(tmp_path / "spans.jsonl", "w") as f:
    f.writelines(json.dumps(s) + "\n" for s in spans)
  cfg, got, metrics, hists = audit.read_run(str(tmp_path))
  assert cfg.topology.mode == "colocated" and got == spans and metrics == [] and hists == []
  with open(tmp_path / "histograms.jsonl", "w") as f:
    f.write(json.dumps(_hist(0, {0: 4})) + "\n")
  assert audit.read_run(str(tmp_path))[3] == [_hist(0, {0: 4})]
  with pytest.raises(FileNotFoundError, match="config.json"):
    audit.read_run(str(tmp_path / "nowhere"))
