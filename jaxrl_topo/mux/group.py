"""A co-execution group: N RL jobs share one rollout pool and one train pool, phase by phase (RollMux).

Each job is an ordinary run config (its own workdir, model, data, seed, algorithm) built by
`runtime/experiment.build` and driven by the ordinary loop (`runtime/loop.train_loop`) in disaggregated
mode with eta = 0: strictly on-policy, its rollout k uses its weights k. The group adds three things
through the loop's hooks, nothing else:

  turns        before each phase the job waits for its turn on the pool (mux/pools.py RoundRobin: one
               rollout and one train phase per job per cycle, fixed cyclic order), so while job A
               trains, job B rolls out
  warm state   off a pool, a job's train state / rollout weights live in host memory (mux/warm.py); a
               phase starts by loading them onto the pool and ends by parking them again; a finished
               train step writes its weights straight into the job's host-side rollout copy (HostSync)
  spans        every phase is a span carrying the job id (group workdir: mux_spans.jsonl, a line as each ends)
  free shards  with mux.resize (runs not run.deterministic), a rollout that starts while another job's
               stragglers decode on their tail engine runs on the data shards the tails leave free
               (mux/migrate.py)
  evaluation   a job's `run.eval_every` (run.py's cadence) is a rollout-pool phase of its own: the job
               acquires the rollout pool in its turn, loads its host copy (the weights its last train
               phase wrote), evaluates, parks, and keeps the turn for its next rollout (span phase "eval")

Each job runs in a thread of its own (its controller); the pools serialise their phases. A job that
raises is retired from both pools (the others go on) and reported with its id. Since every job
computes exactly what its solo on-policy run computes (same programs, same keys, same order of its
own steps), its metrics equal that run's bit for bit under run.deterministic, timing metrics aside
(tests/test_mux.py); without it, rollouts on the free shards may differ from solo in the last bits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import traceback

from absl import logging

from jaxrl_topo.mux import migrate, resume, warm
from jaxrl_topo.mux.migrate import TailMigration
from jaxrl_topo.mux.pools import RoundRobin
from jaxrl_topo.mux.spec import JobSpec, MuxConfig, compile_counts, on_policy, planned_pools
from jaxrl_topo.rollout.engine import RolloutEngine
from jaxrl_topo.runtime import experiment as experiment_lib
from jaxrl_topo.runtime import loop as loop_lib
from jaxrl_topo.runtime.rollout_side import _devices
from jaxrl_topo.runtime.workdir import MUX_SPANS


@dataclasses.dataclass
class _Job:
  spec: JobSpec
  exp: experiment_lib.Experiment | None = None
  metrics: list[dict] = dataclasses.field(default_factory=list)
  error: str | None = None
  compiled: dict = dataclasses.field(default_factory=dict)  # program -> cache size after the first cycle
  ckpt: object = None  # its Checkpointer (`<workdir>/checkpoints`), when the group checkpoints
  start: int = 0  # the step it resumes at (its newest checkpoint's), 0 for a fresh job
  lost: dict | None = None  # step start - 1's metrics from its checkpoint, its line lost (resume.build_job)
  landed: dict | None = None  # the last step's metrics as its weights landed (a checkpoint keeps them)
  tail: TailMigration | None = None  # its long-tail migration (and tail engine)
  rest: RolloutEngine | None = None  # its engine on the shards no tail uses (mux.resize), built with the group
  full: RolloutEngine | None = None  # its own engine while a rollout phase runs on `rest`
  saving: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # held while a checkpoint is written


class Group:
  """Build with `Group(specs, mux_cfg, workdir)`, then `run()` -> {job id: summary or error}."""

  def __init__(self, specs: list[JobSpec], mux: MuxConfig, workdir: str, checkpoints: bool = False):
    ids = [s.job_id for s in specs]
    if len(set(ids)) != len(ids) or not ids:
      raise ValueError(f"mux: job ids must be distinct and non-empty, got {ids}")
    dirs = [os.path.realpath(s.workdir) for s in specs]
    shared = sorted({d for d in dirs if dirs.count(d) > 1})
    if shared:  # they would share checkpoints, metrics files and the identity record
      raise ValueError(f"mux: jobs {[s.job_id for s, d in zip(specs, dirs, strict=True) if d in shared]} share "
                       f"the workdir {shared[0]}: give each job its own")
    self.mux, self.workdir, self.checkpoints = mux, workdir, checkpoints
    self.jobs = {s.job_id: _Job(dataclasses.replace(s, cfg=on_policy(s.cfg))) for s in specs}
    self.rollout_pool = RoundRobin("rollout", ids)
    self.train_pool = RoundRobin("train", ids)
    self.spans: list[dict] = []
    self._spans_file = None  # MUX_SPANS, open for appending while the group runs
    self._compiles = None  # run(compiles=...): each span's compile seconds (runtime/spans.CompileLog)
    self._lock = threading.Lock()
    self._t0 = time.perf_counter()
    self.pools: dict[str, list[int]] = {}
    self.admitted = self.built = False
    self.interrupted = threading.Event()  # a Ctrl-C while the jobs run (resume.noting_interrupts)

  # ------------------------------------------------------------ admission

  def admit(self) -> None:
    """The group's checks from the configs and the devices alone (nothing built, nothing written; the launcher
    runs them before it writes any job's files): the host-resident state fits, and every job's topology, as the
    group runs it (disaggregated), fits the devices and its model and batch, and carves the same two pools."""
    planned = []
    for jid, job in self.jobs.items():
      try:
        planned.append(warm.planned_residency(jid, job.spec.cfg))
      except Exception:  # noqa: BLE001  (a config that cannot be sized fails at its build, reported there)
        logging.warning("mux: job %s: host residency not sized from its config:\n%s", jid, traceback.format_exc())
    warm.check_residency(planned, self.mux.host_memory_gb)
    first = None
    for jid, job in self.jobs.items():
      pools = planned_pools(jid, job.spec.cfg)
      if first is None:
        first = jid
        self.pools = pools  # each job's build carves the same topology: these are the group's pools
      elif pools != self.pools:
        raise ValueError(f"mux: job {jid} uses pools {pools}, job {first} {self.pools}: every job of a group needs "
                         "the same topology (set --config.topology.* for all jobs)")
    self.admitted = True

  def build(self) -> None:
    """`admit()` (unless done); builds every job (a job that fails to build is reported and left out), checks
    that they share the same two disjoint pools, then parks every job's state. One process is one node: every
    job's state lives here. A group is built once (`run()` builds it when it was not)."""
    self.built = True
    if not self.admitted:
      self.admit()
    for jid, job in self.jobs.items():
      try:
        # the warm-up and every program built now, at the precision the job's loop runs them
        with experiment_lib.matmul_precision(job.spec.cfg):
          resume.build_job(job, self.checkpoints)
      except Exception:  # noqa: BLE001  (isolation: reported with the job id)
        self._fail(jid, traceback.format_exc())
    try:
      self._ready([j for j in self.jobs.values() if j.exp is not None])
    except BaseException:
      self._close()
      raise

  def _ready(self, built: list[_Job]) -> None:
    """The built jobs (on the pools `admit` checked) get their tail (and free-shard) engines warmed; state parked."""
    for job in built:
      job.tail = TailMigration(job.exp, self.rollout_pool, job.spec.job_id, self.mux.migrate_at)
      with experiment_lib.matmul_precision(job.spec.cfg):
        job.tail.warm()  # its tail engine's programs compile now, not in its first migration
    self._build_rest(built)
    for job in built:
      exp = job.exp
      exp.sync = warm.HostSync(exp.sync)
      exp.state = warm.park(exp.state)
      exp.engine.params = warm.park(exp.engine.params)

  def _build_rest(self, built: list[_Job]) -> None:
    """mux.resize: each job's engine on the data shards that no tail uses, warmed now (a request, a patch, a
    page move into its own tail); like any engine it compiles each new batch shape when it first meets it."""
    if not self.mux.resize or not built:
      return
    eng = built[0].exp.engine
    data = eng.pool.n_shards if eng.mesh is not None and "data" in eng.mesh.axis_names else 1
    shards = migrate.rest_shards([j.tail for j in built], data)
    for job in built if shards is not None else ():
      if not job.spec.cfg.run.deterministic:
        job.rest = migrate.sub_engine(job.exp.engine, shards)
        with experiment_lib.matmul_precision(job.spec.cfg):
          migrate.compile_engine(job.rest, job.exp.engine)
          if job.tail.tail is not None:
            migrate.compile_move(job.rest, job.tail.tail)

  def _on_rest(self, job: _Job) -> bool:
    """Whether the job's rollout starting now takes the free shards: another job's stragglers decode on its
    tail engine (on the first shards) at this moment."""
    return job.rest is not None and any(o is not job and o.tail is not None and o.tail.running
                                        for o in self.jobs.values())

  def _fail(self, jid: str, tb: str) -> None:
    self.jobs[jid].error = tb
    self.rollout_pool.retire(jid)
    self.train_pool.retire(jid)
    if self.interrupted.wait(0.5):  # a Ctrl-C reaches the reward workers and this process at once: let it land
      logging.info("mux: job %s stopped by the interrupt", jid)
      return
    logging.error("mux: job %s failed; the group goes on:\n%s", jid, tb)

  # ------------------------------------------------------------ phases

  def _span(self, jid: str, pool: str, step: int, start: float, end: float, phase: str | None = None,
            **extra) -> None:
    entry = {"job": jid, "pool": pool, "phase": phase or pool, "step": step, "start": start - self._t0,
             "end": end - self._t0, "devices": self.pools.get(pool, []), **extra}
    if self._compiles is not None:  # the job's thread, which writes its spans, compiles its programs
      entry["compile_s"] = round(self._compiles.seconds_within(start, end), 6)
    with self._lock:
      self.spans.append(entry)
      if self._spans_file is not None:  # on disk as it happens: a killed group keeps its timeline up to the kill
        self._spans_file.write(json.dumps(entry) + "\n")
        self._spans_file.flush()

  def _hooks(self, job: _Job, extra: loop_lib.LoopHooks) -> loop_lib.LoopHooks:
    jid, exp = job.spec.job_id, job.exp
    held: dict[str, float] = {}
    tail = job.tail

    def on_phase_start(phase: str, step: int) -> None:
      pool = self.rollout_pool if phase == "rollout" else self.train_pool
      pool.acquire(jid)
      t = time.perf_counter()
      if phase == "rollout" and self._on_rest(job):  # its weights copied there; the host copy stays
        job.rest.params, job.rest.gen_id = warm.place(exp.engine.params, job.rest.mesh), exp.engine.gen_id
        job.full, exp.engine = exp.engine, job.rest
        tail.arm()
      elif phase == "rollout":
        exp.engine.params = warm.unpark(exp.engine.params)
        tail.arm()
      else:
        exp.state = warm.unpark(exp.state)
      held[phase] = t
      held[phase + "_load"] = time.perf_counter() - t
      extra.on_phase_start(phase, step)

    def on_produced(step: int) -> None:
      t = time.perf_counter()
      exp.engine.release_kv()
      rest = job.full is not None
      if rest:  # the rest engine's weights go (the host copy is the job's); its own engine is back
        devices = _devices(exp.engine.mesh)
        warm.free(exp.engine.params)
        exp.engine.params = None
      else:
        exp.engine.params = warm.park(exp.engine.params)
      end = time.perf_counter()
      self.rollout_pool.release(jid)
      moved = tail.done()
      if rest:
        job.full.stats.update(exp.engine.stats)
        exp.engine.stats.clear()
        exp.engine, job.full = job.full, None
        moved.update(devices=devices, on_rest=True)
      at = {k: moved.pop(k) for k in ("migrated_at", "moved_at")}
      self._span(jid, "rollout", step, held["rollout"], end, load_s=held["rollout_load"], park_s=end - t,
                 **{k: v - self._t0 if v else None for k, v in at.items()}, **moved)
      extra.on_produced(step)

    def on_landed(step: int, m: dict) -> None:
      job.landed = dict(m)
      extra.on_landed(step, m)

    def on_trained(step: int, traj) -> None:
      extra.on_trained(step, traj)
      resume.save(job, step + 1, traj.data_state, job.landed)  # while the state is on the train pool
      t = time.perf_counter()
      exp.state = warm.park(exp.state)
      end = time.perf_counter()
      self.train_pool.release(jid)
      self._span(jid, "train", step, held["train"], end, load_s=held["train_load"], park_s=end - t)
      if not job.compiled:
        job.compiled = compile_counts(exp)

    every, steps = job.spec.cfg.run.eval_every, job.spec.cfg.run.steps

    def should_eval(done: int) -> bool:
      """The job's own cadence (as run.py's); an evaluation is a rollout-pool phase of the job in its turn,
      on its weights `done` (the host copy its last train phase wrote), ended in on_step."""
      if not (every and done % every == 0 and done < steps):
        return False
      self.rollout_pool.acquire(jid, phase="eval")
      t = time.perf_counter()
      exp.engine.params = warm.unpark(exp.engine.params)
      held["eval"], held["eval_load"] = t, time.perf_counter() - t
      return True

    def end_eval(step: int) -> None:
      t = time.perf_counter()
      exp.engine.release_kv()
      exp.engine.params = warm.park(exp.engine.params)
      end = time.perf_counter()
      self.rollout_pool.release(jid, keep_turn=True)  # the job's rollout of this turn follows
      self._span(jid, "rollout", step, held.pop("eval"), end, phase="eval", load_s=held.pop("eval_load"),
                 park_s=end - t)

    def on_step(step: int, m: dict) -> None:
      if "eval" in held:
        end_eval(step)
      job.metrics.append({k: v for k, v in m.items() if not k.startswith("_")} | {"step": step})
      steps = job.spec.cfg.run.steps
      if (step + 1) % job.spec.cfg.run.log_every == 0 or step + 1 == steps:  # progress: a group runs for hours
        logging.info("mux: %s step %d/%d, reward %.4g", jid, step + 1, steps, m.get("reward/mean", float("nan")))
      extra.on_step(step, m)

    def on_chunk(engine) -> None:
      tail.on_chunk(engine)
      extra.on_chunk(engine)

    return dataclasses.replace(extra, on_phase_start=on_phase_start, on_produced=on_produced, on_landed=on_landed,
                               on_trained=on_trained, on_step=on_step, on_chunk=on_chunk, should_eval=should_eval)

  def _run_job(self, job: _Job, hooks: loop_lib.LoopHooks) -> None:
    jid, cfg = job.spec.job_id, job.spec.cfg
    failure = None
    try:
      with experiment_lib.matmul_precision(cfg):
        loop_lib.train_loop(job.exp, start_step=job.start, hooks=self._hooks(job, hooks), lost=job.lost)
    except Exception:  # noqa: BLE001  (isolation: reported with the job id)
      failure = traceback.format_exc()
    finally:
      if job.tail is not None:  # a job failing while its stragglers decode on its tail: the tail's shards go free
        migrate.restore(job.tail.tail, job.exp.engine)
        job.tail.moved_at = None
      self.rollout_pool.retire(jid)
      self.train_pool.retire(jid)
    if failure is not None:  # reported once the job's pools and tail are free (_fail may wait for an interrupt)
      self._fail(jid, failure)

  def run(self, hooks_for=None, compiles=None) -> dict[str, dict]:
    """Runs every admitted job to its `run.steps`; returns {job id: {"ok", "steps", "error", ...}}.
    `hooks_for(job_id, exp) -> LoopHooks`: a job's own sinks (metrics writer, spans file); the group's
    turn and warm-state hooks wrap them. `compiles`: an open runtime/spans.CompileLog; each span then carries
    the seconds its job's thread compiled in it (`compile_s`), as a solo run's spans do. A KeyboardInterrupt is
    re-raised once any checkpoint being written has committed (resume.finish_saves); the jobs' save locks stay
    held, so the group is not run again after it."""
    if not self.built:  # (not again when every job failed its build: each failure is reported once)
      self.build()
    self._compiles = compiles
    # A resumed group keeps the spans of the steps it does not redo; this session's follow on from their end.
    self.spans[:0] = resume.earlier_spans(self.workdir, MUX_SPANS, {jid: job.start for jid, job in self.jobs.items()},
                                          {jid for jid, job in self.jobs.items() if job.lost is not None})
    self._t0 = time.perf_counter() - max((s["end"] for s in self.spans), default=0.0)
    resume.write_spans(self.workdir, MUX_SPANS, self.spans)
    self._spans_file = open(os.path.join(self.workdir, MUX_SPANS), "a")  # noqa: SIM115 (closed after the jobs)
    with resume.noting_interrupts(self.interrupted):
      threads = []
      try:
        for jid, job in self.jobs.items():
          if job.exp is None:
            continue
          hooks = hooks_for(jid, job.exp) if hooks_for else loop_lib.LoopHooks()
          t = threading.Thread(target=self._run_job, args=(job, hooks), name=f"mux-{jid}", daemon=True)
          threads.append(t)
          t.start()
        for t in threads:
          t.join()
      except KeyboardInterrupt:  # jobs already started may be saving
        resume.finish_saves(self.jobs.values())
        raise
    wall = time.perf_counter() - self._t0
    with self._lock:
      self._spans_file.close()
      self._spans_file = None
    resume.write_spans(self.workdir, MUX_SPANS, self.spans)  # the same spans, in time order
    out = {}
    for jid, job in self.jobs.items():
      trained = sum(r["step"] >= job.start for r in job.metrics)  # not a lost line logged again (job.lost)
      out[jid] = {"ok": job.error is None, "steps": trained, "error": job.error, "wall_s": wall,
                  "resumed_from": job.start, "trained_to": job.start + trained}
    self._close()
    return out

  def _close(self) -> None:
    """Every job's Checkpointer (its saves committed) and experiment closed, before the process may exit: an
    open Checkpointer's background thread fails at interpreter shutdown ('cannot schedule new futures')."""
    for job in self.jobs.values():
      try:
        resume.close_checkpointer(job)
      finally:
        if job.exp is not None:
          job.exp.close()
