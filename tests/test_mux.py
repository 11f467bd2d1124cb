"""Phase-level multiplexing (jaxrl_topo/mux/): jobs of a co-execution group take turns on one rollout and one
train pool (8 fake CPU devices: trainer fsdp=4 on 0-3, rollout data=2 x tensor=2 on 4-7), keep their state in
host memory off the pools, and each job's metrics equal its solo on-policy disaggregated run's bit for bit.

Timing-dependent metrics are excluded from the comparison by `runtime.metrics.comparable` (every "time/..."
and "perf/..." key: seconds, tokens/s, steps/h, overlap tokens, landing flags); everything else (rewards,
lengths, losses, gradients' norms, log-prob gaps, sync bytes, prompt hashes, ...) must match exactly."""

from __future__ import annotations

import os
import threading
import time

import jax
import numpy as np
import pytest

from jaxrl_topo.mux import warm
from jaxrl_topo.mux.group import MUX_SPANS, Group
from jaxrl_topo.mux.pools import RoundRobin
from jaxrl_topo.mux.report import read_spans
from jaxrl_topo.mux.spec import JobSpec, MuxConfig, compile_counts, on_policy
from jaxrl_topo.runtime import experiment, loop
from jaxrl_topo.runtime.config import config_from_file, from_config_dict
from jaxrl_topo.runtime.metrics import comparable
from jaxrl_topo.runtime.spans import CompileLog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
TOPO = dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2})
BASE = {"run.steps": STEPS, "run.eval_every": 0, "run.tensorboard": False, "run.plot": False, "reward.n_workers": 0,
        "run.sft_steps": 10, "run.sft_target_accuracy": 0.0, "data.batch_size": 4, "rl.group_size": 4,
        "rollout.n_slots": 16, "run.deterministic": True,
        # one decode batch per shard (8 slots): packing's other sizes are the engine tests' subject
        "rollout.min_pack_rows": 8,
        # 24-token budgets in 8-step chunks: a rollout has a tail of several chunks for migration to move
        "rollout.max_new_tokens": 24, "rollout.decode_chunk": 2,
        # soft overlong shaping: rewards vary with the length, so advantages and gradients are not zero
        "reward.overlong_buffer": 16, "reward.overlong_penalty": 0.5}
# Three jobs: different algorithms (GRPO, DAPO with dynamic sampling), tasks, seeds and model sizes.
def _task(name: str) -> dict:
  return {"data.source": name, "data.task": {"name": name, "seed": 0, "n_train": 200, "n_heldout": 20,
                                             "max_operand": 20}}


JOBS = {"a": ("grpo_task", {"run.eval_every": 2}),  # one held-out evaluation (after step 1), in its turn
        # b reads pages row by row (rollout.impl=fast): its stragglers merge from both shards (mux/migrate.py); its
        # data seed is one whose prompts leave stragglers in both shards at a migration (data seed 0 does not)
        "b": ("dapo", {**_task("arithmetic"), "run.seed": 3, "data.seed": 1, "rollout.impl": "fast"}),
        "c": ("grpo_task", {**_task("countdown"), "run.seed": 5, "model.overrides": {"n_layers": 3}})}


def job_cfg(jid: str, **extra):
  name, overrides = JOBS[jid]
  c = config_from_file(os.path.join(ROOT, "configs", f"{name}.py"), "tiny")
  for dotted, value in {**BASE, **overrides, **extra}.items():
    node = c
    *path, last = dotted.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  c.topology = TOPO
  return from_config_dict(c)


def _records(ms: list[dict]) -> list[dict]:
  return comparable([{k: v for k, v in m.items() if not k.startswith("_")} | {"step": i} for i, m in enumerate(ms)])


def _diff(got: list[dict], want: list[dict]) -> list:
  """(step, key, got, want) for every metric that differs (a missing key reads None)."""
  return [(i, k, g.get(k), w.get(k)) for i, (g, w) in enumerate(zip(got, want, strict=False))
          for k in sorted(set(g) | set(w)) if g.get(k) != w.get(k)]


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
  """Each job alone: the ordinary loop, disaggregated, eta = 0 (run on first use)."""
  runs = {}

  def get(jid: str):
    if jid not in runs:
      cfg = on_policy(job_cfg(jid))
      exp = experiment.build(cfg, str(tmp_path_factory.mktemp(f"solo_{jid}")))
      ms, every = [], cfg.run.eval_every  # run.py's evaluation cadence
      should_eval = lambda done: bool(every) and done % every == 0 and done < cfg.run.steps  # noqa: E731
      try:
        loop.train_loop(exp, hooks=loop.LoopHooks(on_step=lambda step, m: ms.append(m), should_eval=should_eval))
      finally:
        exp.close()
      runs[jid] = _records(ms)
    return runs[jid]
  return get


def _group(tmp_path, jids, migrate_at=0.5, hooks_for=None) -> tuple[Group, dict]:
  group = Group([JobSpec(j, job_cfg(j), str(tmp_path / j)) for j in jids], MuxConfig(migrate_at=migrate_at),
                str(tmp_path))
  group.build()
  for job in group.jobs.values():  # count syncs through the job's own plan (rollout devices): warm ones skip it
    if job.exp is not None:
      job.plan_runs = calls = []
      run = job.exp.sync.inner.plan.run
      job.exp.sync.inner.plan.run = lambda *a, _run=run, _calls=calls, **k: (_calls.append(1), _run(*a, **k))[1]
  with CompileLog() as compiles:
    return group, group.run(hooks_for, compiles)


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
  """One group of the three jobs, shared by the tests below (a group run is most of this file's time)."""
  return _group(tmp_path_factory.mktemp("trio"), ["a", "b", "c"])


def test_three_jobs_multiplexed_equal_their_solo_runs_bit_for_bit(trio, solo):
  group, out = trio
  assert all(r["ok"] for r in out.values()), out
  sizes = {j: warm.tree_bytes(group.jobs[j].exp.engine.params.host) for j in "abc"}
  assert sizes["c"] > sizes["a"], sizes  # a bigger model
  for jid in "abc":
    got, want = comparable(group.jobs[jid].metrics), solo(jid)
    assert [r["step"] for r in got] == list(range(STEPS))
    assert got == want, f"job {jid}: multiplexed metrics differ from its solo run: {_diff(got, want)}"
  # Job a's run.eval_every=2 ran in the group: eval/accuracy after step 1 (weights 2), equal to the solo run's.
  assert [r["step"] for r in solo("a") if "eval/accuracy" in r] == [1]
  assert not np.isnan(solo("a")[1]["eval/accuracy"])
  assert not any("eval/accuracy" in r for r in solo("b"))
  # Not a vacuous comparison: the jobs learn (non-zero gradients), and they differ from each other.
  assert all(r["grad_norm"] > 0 for jid in "ab" for r in solo(jid))
  assert [r["data/prompt_hash"] for r in solo("a")] != [r["data/prompt_hash"] for r in solo("b")]
  # Long-tail migration was on (mux.migrate_at=0.5): stragglers moved to the 8-row tail engine and decoded
  # there in some rollout phase of each job (a tail that ends inside the chunk in flight has nothing to move).
  moved = [s for s in group.spans if s["pool"] == "rollout" and s.get("moved_at") is not None]
  assert {"a", "b"} <= {s["job"] for s in moved}  # job c's tails may end inside the chunk in flight
  assert all(s["tail_slots"] == 8 and s["tail_devices"] == [4, 5] and s["tail_steps"] > 0 and s["freed_kv_bytes"] > 0
             for s in moved), moved
  # Job a (window read, auto on CPU) moves a shard's stragglers as they are; job b (row-exact read) merged both
  # shards' into the tail's one in some phase, and its metrics still equal its solo run's (above).
  assert all(s["moved_from_shards"] == 1 for s in moved if s["job"] == "a")
  assert any(s["moved_from_shards"] == 2 for s in moved if s["job"] == "b"), moved
  # Each job's spans carry what its thread compiled (run(compiles=...)): its first train phase is mostly its train
  # step's compile; the review's mean phase leaves it out (before: group.md counted it as a slow phase).
  from jaxrl_topo.review import group as group_review
  per_job = group_review.per_job(group.spans)
  for jid in "abc":
    first = min((s for s in group.spans if s["job"] == jid and s["pool"] == "train"), key=lambda s: s["step"])
    assert first["compile_s"] > 0.5 * (first["end"] - first["start"]), first
    row = per_job[jid]["train"]
    assert row["compile_s"] >= first["compile_s"]
    assert row["mean_s"] == pytest.approx((row["busy_s"] - row["compile_s"]) / row["phases"])


def test_round_robin_alternates_and_fills_one_pool_while_the_other_works(trio):
  group, _ = trio
  cycle = ["a", "b", "c"] * STEPS
  # Job a's evaluation (after step 1) is a rollout-pool phase in a's turn, right before its rollout 2.
  assert group.rollout_pool.history == ["a", "b", "c", "a", "b", "c", "a:eval", "a", "b", "c"]
  assert group.train_pool.history == cycle
  evals = [s for s in group.spans if s["phase"] == "eval"]
  assert [(s["job"], s["pool"], s["step"]) for s in evals] == [("a", "rollout", 1)]
  spans = {(s["job"], s["pool"], s["step"]): s for s in group.spans if s["phase"] != "eval"}
  assert len(spans) == 3 * 2 * STEPS and all(s["devices"] for s in group.spans)
  (ev,) = evals  # after a's train 1 (its weights 2), before a's rollout 2 and b's rollout 2
  assert spans[("a", "train", 1)]["end"] <= ev["start"] and ev["end"] <= spans[("a", "rollout", 2)]["start"]
  assert ev["end"] <= spans[("b", "rollout", 2)]["start"]
  # One phase per pool at a time, except a migrated rollout's tail, which may overlap the next job's rollout.
  trains = sorted((s for s in group.spans if s["pool"] == "train"), key=lambda s: s["start"])
  assert all(x["end"] <= y["start"] for x, y in zip(trains, trains[1:], strict=False))
  # Job a's train k starts after its rollout k ended (on-policy), and job b's rollout k runs meanwhile.
  for k in range(STEPS):
    assert spans[("a", "train", k)]["start"] >= spans[("a", "rollout", k)]["end"]
    assert spans[("b", "rollout", k)]["start"] < spans[("a", "train", k)]["end"]


def test_warm_switches_park_state_in_host_memory_and_never_recompile(trio):
  group, _ = trio
  for job in group.jobs.values():
    assert job.compiled, "no compile counts were taken after the first cycle"
    # The job's own program, of one shape: a warm switch that changed a layout would compile it again. (prefill,
    # generate and patch are shared by the jobs and their tail engines, and keyed by data-dependent static shapes
    # too: the live-row batch and window of a decode step, a held-out evaluation's prompt length and greedy
    # sampling, the first phase whose stragglers move to a tail, so a later phase may meet a new one; they are not
    # compared here.)
    now = compile_counts(job.exp)
    assert now["train_step"] == job.compiled["train_step"], "a warm switch recompiled a program"
    assert now["train_step"] == 1
    for parked in (job.exp.state, job.exp.engine.params):  # both off their pools after the run
      assert isinstance(parked, warm.Parked)
      kinds = {getattr(getattr(x, "sharding", None), "memory_kind", "numpy") for x in jax.tree.leaves(parked.host)}
      assert kinds == {warm.HOST_KIND}, kinds
  assert all(s["load_s"] >= 0 and s["park_s"] >= 0 for s in group.spans)
  # A finished train phase wrote its weights straight into the host copy: never through the rollout devices'
  # plan, and the host copy is laid out for the rollout devices (4-7), which unpark puts it back onto.
  for job in group.jobs.values():
    assert job.plan_runs == [], "a sync went through the rollout devices"
    host = jax.tree.leaves(job.exp.engine.params.host)
    assert {d.id for x in host for d in x.sharding.device_set} == {4, 5, 6, 7}


def test_a_failing_job_is_isolated_and_reported_with_its_id(tmp_path):
  def hooks_for(jid, exp):
    def on_step(step, m):
      if jid == "b" and step == 1:
        raise RuntimeError("job b breaks")
    return loop.LoopHooks(on_step=on_step)

  group, out = _group(tmp_path, ["a", "b"], hooks_for=hooks_for)
  assert out["a"]["ok"] and out["a"]["steps"] == STEPS
  assert not out["b"]["ok"] and "job b breaks" in out["b"]["error"]
  assert group.train_pool.history.count("a") == STEPS


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_ctrl_c_is_no_jobs_failure(tmp_path, monkeypatch):
  """Before: a Ctrl-C while a group ran logged each job's wind-down error (a reward worker's closed pipe, orbax
  refusing a save at shutdown) as 'mux: job ... failed; the group goes on', with its traceback."""
  import signal

  from jaxrl_topo.mux import group as group_lib

  said = []
  for level in ("info", "error"):
    monkeypatch.setattr(group_lib.logging, level, lambda msg, *a, _level=level: said.append((_level, msg % a)))

  def hooks_for(jid, exp):
    def on_step(step, m):
      os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread, which is joining the jobs
      raise RuntimeError("what an interrupted job meets")
    return loop.LoopHooks(on_step=on_step)

  group = Group([JobSpec("a", job_cfg("a"), str(tmp_path / "a"))], MuxConfig(), str(tmp_path))
  group.build()
  with pytest.raises(KeyboardInterrupt):
    group.run(hooks_for)
  t0 = time.time()  # the job's thread winds down after the interrupt reached the main thread
  while any(t.name == "mux-a" for t in threading.enumerate()) and time.time() - t0 < 60:
    time.sleep(0.1)
  group._close()
  assert group.interrupted.is_set() and ("info", "mux: job a stopped by the interrupt") in said, said
  assert not [s for s in said if s[0] == "error"], said


def test_residency_beyond_host_memory_is_refused_naming_jobs_and_bytes(tmp_path):
  group = Group([JobSpec(j, job_cfg(j, **{"run.sft_steps": 0}), str(tmp_path / j)) for j in "ab"],
                MuxConfig(host_memory_gb=1e-4), str(tmp_path))
  with pytest.raises(ValueError, match=r"mux\.host_memory_gb") as e:
    group.build()
  assert all(j.exp is None for j in group.jobs.values())  # refused from the configs, before anything was built
  msg = str(e.value)
  assert "a: " in msg and "b: " in msg and "train state" in msg
  a = experiment.build(on_policy(job_cfg("a", **{"run.sft_steps": 0})), str(tmp_path / "solo_a"))
  try:  # the planned bytes are the built job's
    assert f"a: {warm.tree_bytes(a.state) + warm.tree_bytes(a.engine.params):,} B" in msg
  finally:
    a.close()


def test_round_robin_pool_passes_over_retired_jobs_and_migrated_tails():
  pool = RoundRobin("rollout", ["a", "b", "c"])
  pool.acquire("a")
  pool.migrate("a")  # a's stragglers go on; b may start
  pool.acquire("b")
  assert pool.holders == {"a", "b"}
  pool.release("a")  # does not move the turn again
  assert pool._current() == "b"
  pool.release("b")
  pool.retire("c")  # c failed: the turn goes back to a
  pool.acquire("a")
  pool.release("a")
  got = []
  t = threading.Thread(target=lambda: (pool.acquire("b"), got.append("b"), pool.release("b")))
  t.start()
  t.join(5)
  assert got == ["b"] and pool.history == ["a", "b", "a", "b"]


def test_a_tail_that_outlives_the_next_jobs_migration_keeps_the_cycle():
  """a migrates, b starts and migrates too (turn back to a) while a's tail still runs: a's release must not
  move the turn again (it would skip a's next phase)."""
  pool = RoundRobin("rollout", ["a", "b"])
  pool.acquire("a")
  pool.migrate("a")
  pool.acquire("b")
  pool.migrate("b")
  pool.release("a")
  assert pool._current() == "a"
  pool.release("b")
  pool.acquire("a")
  assert pool.history == ["a", "b", "a"]


def test_park_and_unpark_round_trip_exactly():
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
  want = np.asarray(x)
  parked = warm.park({"w": x})
  assert x.is_deleted() and parked.host["w"].sharding.memory_kind == warm.HOST_KIND
  back = warm.unpark(parked)["w"]
  assert back.sharding == x.sharding and np.array_equal(np.asarray(back), want)


@pytest.mark.slow
def test_a_group_run_again_on_its_workdir_resumes_every_job_and_matches_an_uninterrupted_group(tmp_path, solo):
  """Both jobs checkpoint each step; both break after step 1's checkpoint, before its line is logged (as a group
  killed there would stop); the group run again on the same workdir resumes each from its step-2 checkpoint, logs
  step 1's line from it first (job a's with its held-out evaluation, due after step 1, run again in its rollout
  turn), and both lines equal the solo (= uninterrupted group, test above) steps 1 and 2 bit for bit."""
  def make(hooks_for=None):
    specs = [JobSpec(j, job_cfg(j, **{"run.checkpoint_every": 1}), str(tmp_path / j)) for j in "ab"]
    group = Group(specs, MuxConfig(migrate_at=0.5), str(tmp_path), checkpoints=True)
    return group, group.run(hooks_for)

  on_disk = {}

  def breaks(jid, exp):
    def on_step(step, m):
      if step == 1:
        on_disk[jid] = read_spans(str(tmp_path / MUX_SPANS))  # what a kill here would leave
        raise RuntimeError("killed")
    return loop.LoopHooks(on_step=on_step)

  _, first = make(breaks)
  assert not first["a"]["ok"] and not first["b"]["ok"]
  for jid in "ab":  # before: the file was written once the group ended, so a killed group left none
    assert {0, 1} <= {s["step"] for s in on_disk[jid] if s["job"] == jid and s["phase"] == "train"}, on_disk[jid]
  first_spans = read_spans(str(tmp_path / MUX_SPANS))
  group, again = make()
  for jid in "ab":
    assert again[jid]["ok"] and again[jid]["resumed_from"] == 2 and again[jid]["steps"] == 1, again
    got = comparable(group.jobs[jid].metrics)
    assert [r["step"] for r in got] == [1, 2] and got == solo(jid)[1:], f"job {jid}"
  assert "eval/accuracy" in group.jobs["a"].metrics[0]
  history = group.rollout_pool.history  # the redone evaluation is job a's first phase, in the turn of its rollout
  assert history[history.index("a:eval") + 1] == "a" and "a" not in history[:history.index("a:eval")], history
  # The group's timeline keeps the first session's spans of steps 0-1 and adds step 2's after them (before: the
  # second session's file held its own spans only).
  spans = read_spans(str(tmp_path / MUX_SPANS))
  kept = [s for s in first_spans if s["step"] < 2 and (s["job"], s["phase"], s["step"]) != ("a", "eval", 1)]
  assert spans[: len(kept)] == sorted(kept, key=lambda s: s["start"])
  assert {(s["job"], s["step"]) for s in spans if s["phase"] == "train"} == {(j, k) for j in "ab" for k in range(3)}
  assert [(s["job"], s["step"]) for s in spans if s["phase"] == "eval"] == [("a", 1)]  # the first session's is dropped
  assert min(s["start"] for s in spans[len(kept):]) >= max(s["end"] for s in kept)


def test_a_rollout_beside_another_jobs_tail_runs_on_the_shards_the_tail_left_free(tmp_path):
  """mux.resize (not deterministic): a job whose rollout starts while the other job's stragglers decode on their
  tail engine (data shard 0: devices 4-5) runs on data shard 1 alone (devices 6-7). With the row-exact `fast`
  read the stragglers move at migrate_at and the turn passes after the move. Without mux.resize, or with
  run.deterministic, every rollout spans devices 4-7 and this fails."""
  own = {"run.deterministic": False, "run.eval_every": 0, "rollout.impl": "fast"}
  group = Group([JobSpec(j, job_cfg(j, **own), str(tmp_path / j))
                 for j in "ab"], MuxConfig(migrate_at=0.5), str(tmp_path))
  out = group.run()
  assert all(r["ok"] and r["steps"] == STEPS for r in out.values()), out
  rollouts = [s for s in group.spans if s["pool"] == "rollout"]
  tails = [s for s in rollouts if s.get("moved_at") is not None]
  rest = [s for s in rollouts if s.get("on_rest")]
  assert rest, f"no rollout ran on the free shards: {rollouts}"
  for s in rest:
    assert s["devices"] == [6, 7], s
    beside = [t for t in tails if t["job"] != s["job"] and t["moved_at"] <= s["start"] < t["end"]]
    assert beside and all(t["tail_devices"] == [4, 5] for t in beside), (s, tails)
  assert all(s["devices"] == [4, 5, 6, 7] for s in rollouts if not s.get("on_rest"))
  for job in group.jobs.values():
    assert all(np.isfinite(m["loss"]) and m["perf/tokens"] > 0 for m in job.metrics)


def test_a_job_builds_under_its_precision_and_refuses_an_off_policy_checkpoint(tmp_path, monkeypatch):
  """Found by a helper's review. (1) The group built each job (its supervised warm-up, its tail engine's
  compiles) at the default matmul precision; only the job's loop ran under its model.matmul_precision, as a
  solo run.train runs everything. (2) A job folder whose checkpoint holds batches generated but not trained (a
  solo run with max_staleness > 0) resumed and skipped those batches' prompts: now refused, naming the job."""
  import jax.numpy as jnp

  from jaxrl_topo.runtime.checkpoint import Checkpointer

  seen = []
  real = experiment.build

  def build(cfg, workdir, **kw):
    seen.append(jax.config.jax_default_matmul_precision)
    return real(cfg, workdir, **kw)

  monkeypatch.setattr(experiment, "build", build)
  ckpt = Checkpointer(str(tmp_path / "a" / "checkpoints"))
  ckpt.save(1, {"x": jnp.zeros(1)}, meta={"step": 1, "data_state": {}, "in_flight": [{"step": 1}]})
  ckpt.close()
  cfg = job_cfg("a", **{"model.matmul_precision": "highest", "run.sft_steps": 2, "run.steps": 2})
  group = Group([JobSpec("a", cfg, str(tmp_path / "a")), JobSpec("b", cfg, str(tmp_path / "b"))], MuxConfig(),
                str(tmp_path), checkpoints=True)
  try:
    group.build()
  finally:
    group._close()
  assert "job a: checkpoint 1 in" in group.jobs["a"].error and "1 batches generated but not trained" in \
      group.jobs["a"].error  # refused before its build
  assert seen == ["highest"] and group.jobs["b"].error is None  # job b built, under its precision


def test_the_turn_passes_when_the_batch_is_nearly_done_not_when_few_slots_are_live(tmp_path, monkeypatch):
  """Found by a helper's review: migrate_at compared the live slots with (1 - migrate_at) x the batch, so with 64
  sequences on 16 slots the next job's turn came at 5 of 64 finished, 48 still queued. Now it counts every
  sequence not finished (live, queued or waiting on a pinned prompt): each pass comes at >= 0.8 x 64 done."""
  from jaxrl_topo.mux import migrate

  passed = []
  real = migrate.TailMigration.on_chunk

  def on_chunk(self, engine):
    armed = self.armed
    real(self, engine)
    if armed and not self.armed and engine._stream is not None:
      passed.append((self.job, self.batch - sum(engine._stream.loop.left), self.batch))

  monkeypatch.setattr(migrate.TailMigration, "on_chunk", on_chunk)
  over = {"data.batch_size": 16, "rl.group_size": 4, "rollout.n_slots": 16, "rollout.max_new_tokens": 12,
          "run.steps": 1, "run.sft_steps": 2}
  group = Group([JobSpec(j, job_cfg(j, **over), str(tmp_path / j)) for j in "ac"], MuxConfig(migrate_at=0.8),
                str(tmp_path))
  out = group.run()
  assert all(r["ok"] for r in out.values()), out
  assert {j for j, _, _ in passed} == {"a", "c"} and all(done >= 0.8 * n for _, done, n in passed), passed


def test_a_job_failing_on_its_tail_frees_the_tails_shards(tmp_path):
  """Found by a helper's review: job a raised while its stragglers decoded on its tail engine; the tail stayed
  'running' with its KV pool held, so every later rollout of job b went to the free shards (half the slots).
  Now the failed job's tail is released and b's later rollouts take the whole pool."""
  from jaxrl_topo.mux import migrate

  own = {"run.deterministic": False, "rollout.impl": "fast", "run.sft_steps": 4, "run.eval_every": 0}
  group = Group([JobSpec("a", job_cfg("a", **own, **{"run.steps": 3}), str(tmp_path / "a")),
                 JobSpec("c", job_cfg("a", **own, **{"run.steps": 4, "run.seed": 3}), str(tmp_path / "c"))],
                MuxConfig(migrate_at=0.5, resize=True), str(tmp_path))
  group.build()
  failed = {}

  def hooks_for(jid, exp):
    def on_chunk(engine):
      if jid == "a" and engine is group.jobs["a"].tail.tail:
        failed["at"] = time.perf_counter() - group._t0
        raise RuntimeError("job a breaks while its tail decodes")
    return loop.LoopHooks(on_chunk=on_chunk)

  out = group.run(hooks_for)
  assert not out["a"]["ok"] and out["c"]["ok"] and "at" in failed
  tail = group.jobs["a"].tail
  assert not tail.running and migrate.kv_bytes(tail.tail) == 0
  later = [s for s in group.spans if s["job"] == "c" and s["pool"] == "rollout" and s["start"] > failed["at"]]
  assert later and not any(s.get("on_rest") for s in later), later


def test_jobs_sharing_a_workdir_are_refused(tmp_path):
  """Found by a helper's review: ids were checked distinct, workdirs not; two jobs of one folder would share
  checkpoints, metrics.jsonl and identity.json (the launcher names folders <i>-<name>, the API did not check)."""
  cfg = job_cfg("a")
  with pytest.raises(ValueError, match=r"mux: jobs \['a', 'b'\] share the workdir .*/w: give each job its own"):
    Group([JobSpec("a", cfg, str(tmp_path / "w")), JobSpec("b", cfg, str(tmp_path / "w" / "."))], MuxConfig(),
          str(tmp_path))
  Group([JobSpec("a", cfg, str(tmp_path / "a")), JobSpec("b", cfg, str(tmp_path / "b"))], MuxConfig(), str(tmp_path))
