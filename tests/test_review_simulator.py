"""The RL-mode throughput simulator: hand-worked step times, tail absorption, staleness, calibration, plots."""

import math

import numpy as np
import pytest

from jaxrl_topo.review import calibrate as C
from jaxrl_topo.review import overlap, plots
from jaxrl_topo.review import simulator as S

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _const(**kw):
  """Constant lengths (sigma=0), B=100 x 1000 tokens = 1e5 tokens/step.

  8 devices, split 4/4: X = 2500 * 4 = 1e4 tok/s -> R = 10 s (per sequence 1e4/100 = 100 tok/s <= p = 1000, so
  the throughput bound binds; the tail bound is 1000/1000 = 1 s). T = 6 s on 4 trainer devices.
  S = 1e9 bytes * 8 / 8e9 bit/s = 1 s.
  """
  base = dict(n_devices=8, rollout_devices=4, batch_seqs=100, median_len=1000.0, tokens_per_s_per_device=2500.0,
              per_seq_tokens_per_s=1000.0, train_s=6.0, train_devices=4, sync_bytes=1e9, link_gbps=8.0, sigma=0.0)
  return S.SimParams(**{**base, **kw})


def _colocated_const(**kw):
  """The same R=10, T=6, S=1 when both phases use all 8 devices: X = 1250 * 8 = 1e4, T = 6 s at 8 devices."""
  return _const(tokens_per_s_per_device=1250.0, train_devices=8, **kw)


def _long_tail(**kw):
  """B=64, median 500, sigma 1.2, clipped at 30x = 15000 tokens; p = 100 tok/s so the longest takes up to 150 s,
  while the throughput bound is ~66k tokens / 16k tok/s ~ 4 s and T + S = 7 s: the tail dominates."""
  base = dict(n_devices=8, rollout_devices=4, batch_seqs=64, median_len=500.0, tokens_per_s_per_device=4000.0,
              per_seq_tokens_per_s=100.0, train_s=6.0, train_devices=4, sync_bytes=1e9, link_gbps=8.0,
              sigma=1.2, max_ratio=30.0)
  return S.SimParams(**{**base, **kw})


def _step_s(mode, params, n_steps=24, warmup=6):
  return 3600.0 / S.simulate(mode, params, n_steps).steps_per_hour(warmup)


def test_rollout_time_by_hand():
  # lengths 1,2,3; X=2, p=1: 3 in flight at min(1, 2/3) -> 1 token in 1.5 s; then 2 at 1 tok/s -> 1 s; then 1 s.
  assert S.rollout_time(np.array([3.0, 1.0, 2.0]), 2.0, 1.0) == pytest.approx(3.5)
  # constant lengths: max(throughput bound, tail bound)
  assert S.rollout_time(np.full(100, 1000.0), 1e4, 1000.0) == pytest.approx(10.0)
  assert S.rollout_time(np.full(100, 1000.0), 1e6, 50.0) == pytest.approx(20.0)


def test_colocated_by_hand_is_r_plus_t_plus_sync():
  tl = S.simulate("colocated", _colocated_const(), 10)
  np.testing.assert_allclose(tl.step_done(), 17.0 * np.arange(1, 11))
  assert tl.steps_per_hour() == pytest.approx(3600 / 17)
  assert tl.steps_per_hour(3) == pytest.approx(3600 / 17)
  assert S.steps_per_hour("colocated", _colocated_const(switch_s=2.0)) == pytest.approx(3600 / 19)
  assert tl.max_staleness() == 0


def test_disaggregated_by_hand_is_max_r_t_plus_sync():
  tl = S.simulate("disaggregated", _const(), 10)
  # step 0 is done at 10 + 6 + 1 = 17; afterwards the rollout (10 s) is the bottleneck.
  np.testing.assert_allclose(tl.step_done(), 17.0 + 10.0 * np.arange(10))
  assert tl.steps_per_hour(2) == pytest.approx(3600 / 10)
  assert tl.max_staleness() == 1
  # trainer-bound: T = 12 s on 4 devices -> max(10, 13) = 13 s/step
  assert _step_s("disaggregated", _const(train_s=12.0)) == pytest.approx(13.0)


def test_async_eta1_equals_disaggregated_without_tail():
  disagg = S.simulate("disaggregated", _const(), 12)
  asyn = S.simulate("async", _const(eta=1), 12)
  for a, b in zip(disagg.spans, asyn.spans, strict=True):
    assert (a.phase, a.step, a.gen_id) == (b.phase, b.step, b.gen_id)
    assert (a.start, a.end) == pytest.approx((b.start, b.end))


def test_async_eta0_is_the_sequential_loop():
  assert _step_s("async", _const(eta=0)) == pytest.approx(17.0)
  assert _step_s("async", _const(eta=0, reward_s=0.5)) == pytest.approx(17.5)
  assert S.simulate("async", _long_tail(eta=0), 12).max_staleness() == 0
  # Disaggregated at run.max_staleness = 0 is sequential too (it was simulated one step off: 10 s a step).
  assert _step_s("disaggregated", _const(eta=0)) == pytest.approx(17.0)
  assert S.simulate("disaggregated", _const(eta=0), 12).max_staleness() == 0


def test_long_tail_bounds_disaggregated_and_async_absorbs_it():
  p = _long_tail()
  tl = S.simulate("disaggregated", p, 24)
  X = p.tokens_per_s_per_device * p.rollout_devices
  for s in tl.of("rollout"):
    L = tl.lengths[s.step]
    assert s.end - s.start >= L.max() / p.per_seq_tokens_per_s - 1e-9  # the tail bound
    assert s.end - s.start >= L.sum() / X - 1e-9  # the throughput bound
    assert s.end - s.start == pytest.approx(S.rollout_time(L, X, p.per_seq_tokens_per_s))
  assert tl.lengths.max() == pytest.approx(30 * p.median_len)  # the clip is reached
  disagg, eta1, eta4 = (_step_s("disaggregated", p), _step_s("async", _long_tail(eta=1)),
                        _step_s("async", _long_tail(eta=4)))
  assert eta1 < 0.75 * disagg, (eta1, disagg)
  assert eta4 < eta1
  assert eta4 > 7.0  # never faster than the trainer's T + S


def test_async_staleness_never_exceeds_eta():
  for eta in (0, 1, 2, 3):
    tl = S.simulate("async", _long_tail(eta=eta), 30)
    train = {s.step: s for s in tl.of("train")}
    sync = {s.step: s for s in tl.of("sync")}
    for r in tl.of("rollout"):
      j = r.step - 1 - eta
      if j >= 0:
        assert r.start >= train[j].end, f"eta={eta}: rollout {r.step} starts before train {j} ended"
        assert r.start >= sync[j].end - 1e-9  # and its weights (version step - eta) have landed
      assert r.step - r.gen_id <= eta
    assert tl.max_staleness() == eta  # the bound is reached: the producer runs ahead as far as allowed


def test_calibrate_recovers_synthetic_spans():
  rng = np.random.default_rng(0)
  spans, t = [], 0.0
  for k in range(9):
    r = 30.0 if k == 0 else 10.0 + rng.uniform(-0.2, 0.2)  # step 0 compiles: the median ignores it
    for proc, devs in ((0, [0, 1]), (1, [2, 3])):  # two processes write a span each, slightly offset
      spans.append(dict(phase="rollout", role="rollout", devices=devs, step=k, gen_id=k, start=t + 0.01 * proc,
                        end=t + r, tokens=5e4))
    spans.append(dict(phase="reward", role="reward", devices=[], step=k, gen_id=k, start=t + r, end=t + r + 0.5))
    spans.append(dict(phase="train", role="trainer", devices=[4, 5, 6, 7], step=k, gen_id=k, start=t + r + 0.5,
                      end=t + r + 6.5))
    spans.append(dict(phase="sync", role="trainer", devices=list(range(8)), step=k, gen_id=k, start=t + r + 6.5,
                      end=t + r + 7.5))
    spans.append(dict(phase="eval", role="trainer", devices=[4], step=k, gen_id=k, start=t, end=t + 3))
    t += r + 7.5
  # A run that died in step 0 (a new user's trial): before, "calibrate needs rollout and train spans at step >= 1".
  with pytest.raises(ValueError, match=r"^no step from step 1 on has both a rollout and a train span \(rollout spans: "
                                       r"steps \[0\]; train spans: steps \[0\]; the fit skips the first 1, .*"
                                       r"review a run that has finished at least 2 step"):
    C.calibrate([s for s in spans if s["step"] == 0], batch_seqs=100, skip_steps=1)
  p = C.calibrate(spans, batch_seqs=100, sync_bytes=1e9)
  assert (p.n_devices, p.rollout_devices, p.trainer_devices, p.train_devices) == (8, 4, 4, 4)
  assert p.median_len == pytest.approx(1000.0)  # 1e5 tokens / 100 sequences, sigma=0
  assert p.train_s == pytest.approx(6.0)
  assert p.reward_s == pytest.approx(0.5)
  assert p.sync_s() == pytest.approx(1.0)
  assert p.link_gbps == pytest.approx(8.0)
  tl = S.simulate("disaggregated", p, 4)
  rollout_s = [s.end - s.start for s in tl.of("rollout")]
  measured = np.median([s["end"] - s["start"] for s in spans if s["phase"] == "rollout" and s["devices"] == [0, 1]])
  np.testing.assert_allclose(rollout_s, measured, rtol=1e-9)


def test_calibrate_round_trip_from_a_simulated_run():
  # p = 400 tok/s: 64 in flight could do 25.6k tok/s > X = 16k, so X is identifiable (with B * p < X it is not:
  # the fit then returns the smallest consistent X); the tail (~1.7k tokens / 400 = 4 s) and throughput both matter.
  truth = _long_tail(sigma=0.5, reward_s=0.3, per_seq_tokens_per_s=400.0)
  tl = S.simulate("disaggregated", truth, 64)
  p = C.calibrate(tl.to_span_dicts(), batch_seqs=64, median_len=500.0, sigma=0.5,
                  per_seq_tokens_per_s=400.0, sync_bytes=1e9, link_gbps=8.0)
  assert p.tokens_per_s_per_device == pytest.approx(truth.tokens_per_s_per_device, rel=1e-3)
  assert (p.train_s, p.train_devices, p.reward_s) == pytest.approx((6.0, 4, 0.3))
  assert p.sync_latency_s == pytest.approx(0.0, abs=1e-9)
  assert _step_s("disaggregated", p) == pytest.approx(_step_s("disaggregated", truth), rel=1e-3)


def test_tile_rollouts_by_hand():
  # batch 1 joined at 1 while batch 0 ran to 3; batch 2 finished (at 4) before batch 1 (at 5): returned in order
  spans = [dict(phase="rollout", step=k, start=a, end=b) for k, (a, b) in enumerate([(0, 3), (1, 5), (2, 4), (6, 7)])]
  spans.append(dict(phase="train", step=0, start=3, end=4))
  tiled = C.tile_rollouts(spans)
  assert [(s["start"], s["end"]) for s in tiled if s["phase"] == "rollout"] == [(0, 3), (3, 5), (5, 5), (6, 7)]
  assert [s for s in tiled if s["phase"] == "train"] == [spans[-1]]


def test_calibrate_a_continuous_stream_round_trip():
  # A stream's rollout spans are each batch's share of its busy time, the tail overlapping the next batch.
  # Fitted as a stream (the simulator's async mode, spans tiled alike), the rate comes back; read as batches
  # decoded alone, the same spans are shorter than the tail alone allows.
  truth = _long_tail(sigma=0.5, reward_s=0.3, per_seq_tokens_per_s=400.0, train_s=1.0, eta=2)
  spans = C.tile_rollouts(S.simulate("async", truth, 48).to_span_dicts())
  kw = dict(batch_seqs=64, median_len=500.0, sigma=0.5, per_seq_tokens_per_s=400.0, sync_bytes=1e9, link_gbps=8.0,
            eta=2, skip_steps=12)
  p = C.calibrate(spans, stream=True, **kw)
  assert p.tokens_per_s_per_device == pytest.approx(truth.tokens_per_s_per_device, rel=1e-6)
  assert S.steps_per_hour("async", p) == pytest.approx(S.steps_per_hour("async", truth), rel=1e-6)
  with pytest.raises(ValueError, match="tail alone"):
    C.calibrate(spans, **kw)
  with pytest.raises(ValueError, match="own devices"):
    C.calibrate(S.simulate("colocated", _colocated_const(), 6).to_span_dicts(), batch_seqs=100, median_len=1000.0,
                stream=True)


def _stalled(spans: list[dict], at: float, secs: float) -> list[dict]:
  """The spans of a run whose one thread stalled `secs` at time `at` compiling a new program: every span open then
  lasts `secs` longer and carries the compile (runtime/spans.py), and every later one starts `secs` later."""
  out = []
  for s in spans:
    if s["start"] <= at < s["end"]:
      out.append({**s, "end": s["end"] + secs, "compile_s": secs})
    else:
      out.append({**s, **({"start": s["start"] + secs, "end": s["end"] + secs} if s["start"] > at else {})})
  return out


def test_calibrate_takes_a_late_compile_out_of_a_stream():
  """A continuous stream's rollout span holds what the controller's thread compiled in it (the train step's first
  compile, a new shape later on). Stalls of 2 s in 9 of 36 batches (median 2.5 s): their compile_s is taken
  out and the rate comes back; unmarked (spans without compile_s), they read as slow decoding."""
  truth = _long_tail(sigma=0.5, reward_s=0.3, per_seq_tokens_per_s=400.0, train_s=1.0, eta=2)
  spans = C.tile_rollouts(S.simulate("async", truth, 48).to_span_dicts())
  kw = dict(batch_seqs=64, median_len=500.0, sigma=0.5, per_seq_tokens_per_s=400.0, sync_bytes=1e9, link_gbps=8.0,
            eta=2, skip_steps=12, stream=True)
  stalled = spans
  for k in range(14, 48, 4):  # each stall delays what follows: find the batch afresh
    r = next(s for s in stalled if s["phase"] == "rollout" and s["step"] == k)
    stalled = _stalled(stalled, (r["start"] + r["end"]) / 2, 2.0)
  assert sum(s.get("compile_s", 0) > 0 for s in stalled if s["phase"] == "rollout") == 9
  p = C.calibrate(stalled, **kw)
  assert p.tokens_per_s_per_device == pytest.approx(truth.tokens_per_s_per_device, rel=1e-6)
  assert p.train_s == pytest.approx(C.calibrate(spans, **kw).train_s)
  unmarked = C.calibrate([{k: v for k, v in s.items() if k != "compile_s"} for s in stalled], **kw)
  assert unmarked.tokens_per_s_per_device < 0.9 * truth.tokens_per_s_per_device


def test_one_slowed_batch_does_not_set_a_streams_rate():
  """A batch slowed by something the spans do not mark (host work, another process on the cores): a 2-minute stall
  in one of 36 batches (median 2.5 s). The stream's mean counts it at three times the median batch
  (`stream_mean`), so the fit keeps 91% of the true rate; with the plain mean (a CI run once tripped on such a
  batch), it fitted 38%."""
  truth = _long_tail(sigma=0.5, reward_s=0.3, per_seq_tokens_per_s=400.0, train_s=1.0, eta=2)
  spans = C.tile_rollouts(S.simulate("async", truth, 48).to_span_dicts())
  r20 = next(s for s in spans if s["phase"] == "rollout" and s["step"] == 20)
  unmarked = [{k: v for k, v in s.items() if k != "compile_s"}
              for s in _stalled(spans, (r20["start"] + r20["end"]) / 2, 120.0)]
  p = C.calibrate(unmarked, batch_seqs=64, median_len=500.0, sigma=0.5, per_seq_tokens_per_s=400.0,
                  sync_bytes=1e9, link_gbps=8.0, eta=2, skip_steps=12, stream=True)
  assert p.tokens_per_s_per_device > 0.85 * truth.tokens_per_s_per_device
  assert C.stream_mean([1.0, 1.0, 0.0, 50.0]) == pytest.approx((1 + 1 + 0 + 3) / 4)
  assert C.stream_mean([0.0, 0.0]) == 0.0


def test_a_dapo_step_of_three_rounds_is_read_as_its_rounds():
  """DAPO's dynamic sampling decodes and scores up to three rounds a step: rollout 1 s, reward 0.5 s, three times,
  then train 2 s (the first rollout compiling 0.25 s more). Each phase's seconds are the sum of its spans, as the
  overlap audit reads them. Before: the step's extent, so reward read 3.5 s (it spans two rollouts) and rollout
  4.0 s (4.25 less the compile)."""
  spans = []
  for k in range(4):
    t = 10.0 * k
    for r in range(3):
      extra = 0.25 if r == 0 else 0.0
      spans.append(dict(phase="rollout", role="rollout", devices=[0], step=k, gen_id=k, start=t, end=t + 1 + extra,
                        compile_s=extra))
      t += 1 + extra
      spans.append(dict(phase="reward", role="rollout", devices=[0], step=k, gen_id=k, start=t, end=t + 0.5))
      t += 0.5
    spans.append(dict(phase="train", role="trainer", devices=[1], step=k, gen_id=k, start=t, end=t + 2))
  assert C.phase_median(spans, "rollout") == pytest.approx(3.0)
  assert C.phase_median(spans, "reward") == pytest.approx(1.5)
  phases = overlap.overlap_audit(spans).phases  # the audit reads the same seconds
  assert (phases["rollout"].median_step_s, phases["reward"].median_step_s) == (pytest.approx(3.0), pytest.approx(1.5))
  # Two processes' spans of the same round overlap: counted once, less the most either compiled.
  twin = [dict(spans[0], start=0.01, end=1.2, compile_s=0.1), spans[0]]
  assert overlap.step_seconds(twin) == pytest.approx(1.25 - 0.25)
  p = C.calibrate(spans, batch_seqs=8, median_len=100.0)
  assert (p.reward_s, p.train_s) == (pytest.approx(1.5), pytest.approx(2.0))


def test_calibrate_colocated_run_and_bad_spans():
  tl = S.simulate("colocated", _colocated_const(), 6)
  p = C.calibrate(tl.to_span_dicts(), batch_seqs=100, median_len=1000.0)
  assert (p.n_devices, p.rollout_devices, p.train_devices) == (8, 4, 8)  # split defaults to half
  assert _step_s("colocated", p, 8, 2) == pytest.approx(17.0)  # sync became a pure 1 s latency
  good = tl.to_span_dicts()
  with pytest.raises(ValueError, match="lacks"):
    C.calibrate([{k: v for k, v in good[0].items() if k != "end"}], batch_seqs=100, median_len=1.0)
  with pytest.raises(ValueError, match=r"has both a rollout and a train span \(rollout spans: steps \[0, .*"
                                       r"train spans: steps none\)"):
    C.calibrate([s for s in good if s["phase"] != "train"], batch_seqs=100, median_len=1.0)
  with pytest.raises(ValueError, match="tokens_per_step"):
    C.calibrate(good, batch_seqs=100)
  with pytest.raises(ValueError, match="tail alone"):
    C.calibrate(good, batch_seqs=100, median_len=1000.0, per_seq_tokens_per_s=1.0)


def test_split_sweep_peaks_in_the_interior():
  # rollout 40 device-seconds, train 24 device-seconds, sync 1 s: disaggregated max(40/r, 24/(8-r) + 1)
  # -> r=4: 10, r=5: max(8, 9) = 9 (best), r=6: 13.
  sweep = S.sweep_split(_const(), range(1, 8), n_steps=16)
  for mode in ("disaggregated", "async"):
    best = max(sweep, key=lambda r: sweep[r][mode])
    assert best == 5, (mode, {r: round(v[mode], 1) for r, v in sweep.items()})
    assert sweep[5][mode] == pytest.approx(3600 / 9, rel=1e-6)
  colocated = [v["colocated"] for v in sweep.values()]
  assert colocated == pytest.approx([colocated[0]] * 7)  # the split does not apply


def test_plots_write_pngs(tmp_path):
  p = _long_tail(reward_s=1.0, switch_s=2.0)
  tls = {mode: S.simulate(mode, p, 10) for mode in S.MODES}
  paths = [plots.plot_timelines(tls, str(tmp_path / "timelines.png")),
           plots.plot_split_sweep(S.sweep_split(p, [2, 4, 6], n_steps=8), str(tmp_path / "sweep.png"))]
  for path in paths:
    with open(path, "rb") as f:
      assert f.read(8) == PNG_MAGIC


def test_params_and_modes_are_validated():
  with pytest.raises(ValueError, match="unknown mode"):
    S.simulate("pipelined", _const(), 2)
  with pytest.raises(ValueError, match="no trainer device"):
    S.simulate("disaggregated", _const(rollout_devices=8), 2)
  assert S.simulate("colocated", _colocated_const(rollout_devices=8), 2).n_steps == 2
  with pytest.raises(ValueError, match="train_s"):
    _const(train_s=-1.0)
  with pytest.raises(TypeError, match="batch_seqs"):
    _const(batch_seqs=10.5)
  with pytest.raises(ValueError, match="max_ratio"):
    _const(max_ratio=0.5)
  p = _const()
  assert p.train_s_per_step_at(2) == pytest.approx(12.0)
  assert p.sync_s() == pytest.approx(1.0) and _const(local_link_gbps=80.0).sync_s(local=True) == pytest.approx(0.1)


def test_clipped_lognormal_mean_ratio_matches_sampling():
  p = _long_tail(batch_seqs=4000)
  L = S.sample_lengths(p, 50)
  assert np.median(L) == pytest.approx(p.median_len, rel=0.02)
  assert S.clipped_lognormal_mean_ratio(1.2, 30.0) == pytest.approx(L.mean() / p.median_len, rel=0.01)
  assert math.isclose(S.clipped_lognormal_mean_ratio(0.0, 30.0), 1.0)
