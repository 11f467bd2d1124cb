"""Placement across co-execution groups (jaxrl_topo/mux/placement.py) and the trace replay (mux/trace.py):
hand-worked round-robin cycles, the least-added-cost choice, SLO / residency / saturation rejections, the
trace file, and the replayed costs. Pure numpy: no devices."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl_topo.mux import placement as pl
from jaxrl_topo.mux import trace as tr

FREE = pl.Cluster(switch_s=0.0)  # no switch cost: the hand-worked numbers stay round


def job(name, r, t, s=0.0, **kw):
  return pl.JobProfile(job=name, rollout_s=r, train_s=t, sync_s=s, **kw)


def test_one_job_alone_runs_its_solo_iteration_and_pays_no_switch():
  assert pl.cycle_periods([3.0], [2.0], [0.5], [(0,)], w=7.0).tolist() == [5.5]


def test_complementary_pair_shares_both_pools_without_slowing_down():
  # A rolls out while B trains and the other way round: sum R = sum T = max(R + T) = 4 (the theorem's
  # non-overloaded case), so each runs at its solo period 4.
  assert pl.cycle_periods([3.0, 1.0], [1.0, 3.0], [0.0, 0.0], [(0,), (0,)], w=0.0).tolist() == [4.0, 4.0]


def test_two_rollout_heavy_jobs_on_one_node_are_bound_by_its_rollouts():
  # sum R = 6 > solo 4: the rollout node serialises them, every period is 6 (slowdown 1.5)
  assert pl.cycle_periods([3.0, 3.0], [1.0, 1.0], [0.0, 0.0], [(0,), (0,)], w=0.0).tolist() == [6.0, 6.0]
  # on their own rollout nodes only the train pool is shared: sum T = 2 < 4, no slowdown
  assert pl.cycle_periods([3.0, 3.0], [1.0, 1.0], [0.0, 0.0], [(0,), (1,)], w=0.0).tolist() == [4.0, 4.0]


def test_switch_cost_enters_the_bound():
  # each phase pays w = 0.5 in a group: max(sum(R + w), sum(T + w), max(R + T + 2w)) = max(5, 5, 5) = 5
  assert pl.cycle_periods([3.0, 1.0], [1.0, 3.0], [0.0, 0.0], [(0,), (0,)], w=0.5).tolist() == [5.0, 5.0]


def test_non_overloaded_random_groups_run_at_the_longest_solo_iteration():
  rng = np.random.default_rng(0)
  for _ in range(50):
    J = int(rng.integers(2, 5))
    r, t = rng.uniform(0.5, 3.0, J), rng.uniform(0.5, 3.0, J)
    cycle = float(np.max(r + t))
    if r.sum() > cycle or t.sum() > cycle:
      continue
    got = pl.cycle_periods(r.tolist(), t.tolist(), [0.0] * J, [(0,)] * J, w=0.0)
    np.testing.assert_allclose(got, cycle, rtol=1e-12)


def test_a_complementary_job_is_packed_at_no_added_cost():
  placer = pl.Placer(FREE)
  first = placer.place(job("a", 3.0, 1.0, slo=1.0))
  second = placer.place(job("b", 1.0, 3.0, slo=1.0))
  assert (first.kind, first.added_per_h) == ("new", 3.0)  # 1 rollout node at $1 + 1 train node at $2
  assert (second.kind, second.group, second.added_per_h) == ("pack", 0, 0.0)
  assert placer.cost_per_h() == 3.0


def test_a_tight_slo_turns_packing_into_rollout_scaling():
  placer = pl.Placer(FREE)
  placer.place(job("a", 3.0, 1.0, slo=1.0))
  d = placer.place(job("b", 3.0, 1.0, slo=1.2))  # packed: x1.5 > 1.2; its own rollout node: x1.0
  assert (d.kind, d.added_per_h) == ("scale", 1.0)
  loose = pl.Placer(FREE)
  loose.place(job("a", 3.0, 1.0, slo=2.0))
  assert loose.place(job("b", 3.0, 1.0, slo=2.0)).kind == "pack"


def test_a_member_whose_slo_would_break_keeps_the_newcomer_out():
  placer = pl.Placer(FREE)
  placer.place(job("a", 1.0, 3.0, slo=1.0))
  d = placer.place(job("b", 1.0, 3.0, slo=5.0))  # b tolerates it; a (train-bound, sum T = 6 > 4) does not
  assert d.kind == "new"


def test_host_residency_is_checked_per_node():
  tb = 2**40
  cluster = pl.Cluster(switch_s=0.0, host_bytes_per_node=tb)
  placer = pl.Placer(cluster)
  placer.place(job("a", 3.0, 1.0, slo=1.0, host_bytes=tb // 2 + 1))
  assert placer.place(job("b", 1.0, 3.0, slo=1.0, host_bytes=tb // 2)).kind == "new"  # would pack, does not fit
  with pytest.raises(ValueError, match=r"job c: 1,099,511,627,777 B .* exceed one node's 1,099,511,627,776 B"):
    placer.place(job("c", 1.0, 1.0, host_bytes=tb + 1))


def test_a_saturated_group_is_skipped():
  g = pl.GroupPlan((job("a", 1.0, 1.0), job("b", 1.0, 1.0)), 1, 1, ((0,), (0,)))
  assert pl.saturated(g, 0.0)  # its rollout node and train pool are each busy 2 = the solo iteration
  placer = pl.Placer(FREE)
  placer.groups.append(g)
  assert placer.place(job("c", 0.1, 0.1, slo=100.0)).kind == "new"


def test_removal_gives_back_rollout_nodes_nobody_pins():
  placer = pl.Placer(FREE)
  placer.place(job("a", 3.0, 1.0, slo=1.0))
  placer.place(job("b", 3.0, 1.0, slo=1.2))  # scaled: rollout nodes 0 (a) and 1 (b)
  assert placer.cost_per_h() == 4.0
  placer.remove("a")
  g = placer.groups[0]
  assert ([m.job for m in g.members], g.rollout_nodes, g.pins, placer.cost_per_h()) == (["b"], 1, ((0,),), 3.0)
  placer.remove("b")
  assert placer.groups == [None] and placer.cost_per_h() == 0.0


def test_trace_file_round_trip_and_errors(tmp_path):
  path = tmp_path / "trace.jsonl"
  path.write_text("\n".join(json.dumps(d) for d in [
      {"job": "a", "rollout_s": 3.0, "train_s": 1.0, "slo": 1.0, "host_gb": 1},
      {"job": "b", "rollout_s": 1.0, "train_s": 3.0, "slo": 1.0, "arrival_s": 5.0}]) + "\n")
  jobs = pl.load_trace(str(path))
  assert jobs[0].host_bytes == 2**30 and jobs[1].arrival_s == 5.0
  text = pl.plan_file(str(path), FREE)
  assert "a: new -> group 0 (+$3.00/h)" in text and "b: pack -> group 0 (+$0.00/h)" in text
  assert text.endswith("total $3.00/h for 2 jobs in 1 groups")
  path.write_text(json.dumps({"job": "a", "rollout_s": 1.0, "train_s": 1.0, "rollot_nodes": 2}) + "\n")
  with pytest.raises(ValueError, match=r"trace.jsonl:1: job 'a': unknown keys \['rollot_nodes'\]; .* \(or host_gb\)"):
    pl.load_trace(str(path))


@pytest.mark.parametrize("line, error", [
    ({"job": "a", "rollout_s": 1.0}, "job 'a': missing 'train_s' (required: job, rollout_s, train_s)"),
    ({"job": "a", "rollout_s": "x", "train_s": 1.0}, "job 'a': rollout_s=\"x\" must be a number"),
    ({"job": "a", "rollout_s": 1.0, "train_s": 1.0, "rollout_nodes": 1.5}, "job 'a': rollout_nodes=1.5 must be an "
     "integer"),
    ({"job": "a", "rollout_s": 1.0, "train_s": 1.0, "host_gb": "8"}, "job 'a': host_gb=\"8\" must be a number"),
    ({"job": "a", "rollout_s": 0.0, "train_s": 1.0}, "job a: rollout_s and train_s must be > 0, sync_s >= 0"),
    ({"rollout_s": 1.0, "train_s": 1.0}, "missing 'job' (required: job, rollout_s, train_s)"),
    ({"cluster": {"switch_s": None}}, "cluster: switch_s=null must be a number"),
    ([1.0], "expected a JSON object"),
])
def test_a_bad_trace_line_is_named_by_file_line_job_and_key(tmp_path, line, error):
  path = tmp_path / "trace.jsonl"
  path.write_text(json.dumps({"job": "ok", "rollout_s": 1, "train_s": 2, "rollout_nodes": 2.0}) + "\n" +
                  json.dumps(line) + "\n")
  with pytest.raises(ValueError) as e:
    pl.read_trace(str(path))
  assert str(e.value).startswith(f"{path}:2: {error}"), str(e.value)


def test_the_launcher_refuses_a_bad_trace_in_one_line(tmp_path):
  """`mux.py --plan` on a job without train_s, or with "rollout_s": "x": one line naming the file, the job and the
  key (before: a TypeError traceback from JobProfile's constructor)."""
  import subprocess
  import sys

  root = __file__.rsplit("/tests/", 1)[0]
  path, env = tmp_path / "trace.jsonl", {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
  for line, error in [({"job": "a", "rollout_s": 3.0}, "job 'a': missing 'train_s'"),
                      ({"job": "b", "rollout_s": "x", "train_s": 1.0}, "job 'b': rollout_s=\"x\" must be a number")]:
    path.write_text(json.dumps(line) + "\n")
    out = subprocess.run([sys.executable, f"{root}/launchers/mux.py", f"--plan={path}"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stderr.startswith(f"error: {path}:1: {error}"), out.stderr[-2000:]
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_replayed_costs_of_a_complementary_pair():
  jobs = [job("a", 3.0, 1.0, slo=1.0, iters=900), job("b", 1.0, 3.0, slo=1.0, iters=900)]
  mux, dis = tr.multiplexed(jobs, FREE), tr.disaggregated(jobs, FREE)
  assert dis.jct_s == {"a": 3600.0, "b": 3600.0} and dis.cost == 6.0  # two jobs x $3/h x 1 h
  assert mux.jct_s == {"a": 3600.0, "b": 3600.0} and mux.cost == pytest.approx(3.0)  # one group, both at solo speed
  assert mux.slo_met == 1.0 and mux.kinds == {"pack": 1, "scale": 0, "new": 1}
  # colocated: each on its train node, rollout at the same per-device rate: 3 + 1 s a step, $2/h each
  assert tr.colocated(jobs, FREE).cost == pytest.approx(4.0)


def test_a_hundred_job_trace_replays_with_every_kind_of_placement():
  jobs = tr.synthetic_trace(tr.TraceConfig(n_jobs=120))
  assert len(jobs) == 120 and len({j.train_nodes for j in jobs}) == 3
  assert all(0 < j.actual_frac <= 1 for j in jobs)
  cluster = pl.Cluster(switch_s=0.02)
  mux, dis = tr.multiplexed(jobs, cluster), tr.disaggregated(jobs, cluster)
  assert all(mux.kinds[k] > 0 for k in pl.KINDS), mux.kinds
  assert sum(mux.kinds.values()) == 120 and set(mux.jct_s) == {j.job for j in jobs}
  assert mux.cost < dis.cost
  # a job never outruns its own rollout: at least iters x its actual rollout phase
  assert all(mux.jct_s[j.job] >= j.iters * j.rollout_s * j.actual_frac * (1 - 1e-9) for j in jobs)


def test_profile_from_spans_of_a_simulated_run_recovers_its_worst_case():
  from jaxrl_topo.review import simulator

  # a known run: 16 sequences of 10 tokens (sigma 0) decoded at 160 tokens/s (throughput-bound: 1 s),
  # train 2 s, sync 0.5 s; at max tokens 40 the rollout takes 4 s and training 4x as long (8 s)
  known = simulator.SimParams(n_devices=8, rollout_devices=4, batch_seqs=16, median_len=10.0,
                              tokens_per_s_per_device=40.0, per_seq_tokens_per_s=1000.0, train_s=2.0,
                              train_devices=4, sync_latency_s=0.5, sigma=0.0, eta=0)
  spans = simulator.simulate("disaggregated", known, n_steps=6).to_span_dicts()
  prof = tr.profile_from_spans(spans, job="x", batch_seqs=16, max_tokens=40, tokens_per_step=160.0, slo=1.5)
  assert (prof.rollout_s, prof.train_s, prof.sync_s) == pytest.approx((4.0, 8.0, 0.5), rel=1e-3)
  assert prof.actual_frac == pytest.approx(0.25, rel=1e-3) and prof.slo == 1.5


def test_a_synthetic_trace_round_trips_and_the_launcher_plans_it(tmp_path):
  import subprocess
  import sys

  jobs = tr.synthetic_trace(tr.TraceConfig(n_jobs=12, seed=1))
  path = tmp_path / "trace.jsonl"
  cluster = pl.Cluster(switch_s=0.02, check_fracs=(0.75,))
  pl.dump_trace(jobs, str(path), cluster)
  assert pl.read_trace(str(path)) == (jobs, cluster)
  root = __file__.rsplit("/tests/", 1)[0]
  out = subprocess.run([sys.executable, f"{root}/launchers/mux.py", f"--plan={path}"], capture_output=True, text=True,
                       timeout=120, env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": root})
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout == pl.plan_file(str(path)) + "\n" == pl.format_plan(*pl.plan(jobs, cluster)) + "\n"
  assert out.stdout.count(": new -> group") >= 1 and "for 12 jobs in" in out.stdout


def test_rollout_scaling_adds_just_enough_nodes():
  # A on nodes 0-1 and C on node 0: node 0 is busy 2.5 s a cycle, node 1 only 2 s (A's solo iteration: 3 s).
  # B (two nodes) packed on both would load node 0 with 3.5 s and slow A by 3.5/3 > its SLO 1.1; one new
  # node beside node 1 is enough (node 1 then busy 3 s: nobody slower than the cycle of 3 s).
  a = job("a", 2.0, 1.0, rollout_nodes=2, slo=1.1)
  c = job("c", 0.5, 1.0, slo=2.0)
  placer = pl.Placer(FREE)
  placer.groups.append(pl.GroupPlan((a, c), 1, 2, ((0, 1), (0,))))
  d = placer.place(job("b", 1.0, 0.5, rollout_nodes=2, slo=3.0))
  g = placer.groups[0]
  assert (d.kind, d.added_per_h, g.rollout_nodes, g.pins[-1]) == ("scale", 1.0, 3, (1, 2))
  np.testing.assert_allclose(pl.slowdowns(g, 0.0), [1.0, 2.0, 2.0])


def test_mux_trace_calibrates_a_disaggregated_runs_spans_as_the_stream_it_was(tmp_path):
  # benchmarks/mux_trace.py --spans=RUN/spans.jsonl: the loop's disaggregated mode runs a continuous stream, so
  # the run's config.json beside the spans makes the fit a stream fit (review/calibrate.py stream=True)
  import importlib.util
  import os

  from jaxrl_topo.review import calibrate, simulator
  from jaxrl_topo.runtime import run
  from jaxrl_topo.runtime.config import config_from_file

  root = __file__.rsplit("/tests/", 1)[0]
  c = config_from_file(os.path.join(root, "configs", "grpo_task.py"), "tiny")
  c.topology = dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2})
  c.run.max_staleness = 1
  run.save_config(c, str(tmp_path))
  truth = simulator.SimParams(n_devices=8, rollout_devices=4, batch_seqs=16, median_len=10.0, sigma=0.5,
                              tokens_per_s_per_device=40.0, per_seq_tokens_per_s=20.0, train_s=1.0, train_devices=4,
                              sync_latency_s=0.1, eta=1)
  spans = calibrate.tile_rollouts(simulator.simulate("async", truth, n_steps=12).to_span_dicts())
  with open(tmp_path / "spans.jsonl", "w") as f:
    f.writelines(json.dumps(s) + "\n" for s in spans)
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps({"step": k, "perf/tokens": 180.0}) + "\n" for k in range(12))
  spec = importlib.util.spec_from_file_location("mux_trace", os.path.join(root, "benchmarks", "mux_trace.py"))
  mux_trace = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mux_trace)
  p, source = mux_trace.base_params(str(tmp_path / "spans.jsonl"), str(tmp_path / "metrics.jsonl"), batch_seqs=16)
  want = calibrate.calibrate(spans, batch_seqs=16, skip_steps=1, eta=1, stream=True, tokens_per_step=180.0)
  assert "continuous rollout stream" in source
  assert p.tokens_per_s_per_device == pytest.approx(want.tokens_per_s_per_device, rel=1e-9)
