"""The RL controller: one loop, three modes, the same algorithm code.

A rollout batch k is produced by the engine under some weight version, scored, and consumed by train
step k; after step k the trainer's weights are version k + 1 and are synced to the rollout side.
The modes differ only in what may overlap, which the loop expresses with one bound, eta
(`run.max_staleness`), and one switch (weights land between decode chunks or between batches):

  colocated      eta = 0: rollout k, train k, sync; one set of devices, the KV pool released while training
  disaggregated  eta = 1: rollout k+1 runs on its own devices while train k (dispatched, not awaited) runs;
                 weights land between batches (under rollout.continuous, while later batches' sequences
                 may be live: the update policy applies), so batch k+1 is one version behind (eta = 0:
                 sequential)
  async          eta >= 1: rollout batches run back to back; a finished train step's weights land between
                 decode chunks under the engine's update policy, so a sequence can mix versions

Pacing, never discarding: batch k is only started once the trainer has reached version k - eta, so
every token of batch k was sampled at most eta versions before the step that trains on it. The loss
corrects the gap with truncated importance weights against the sampler's log-probs (rl.is_cap).

When async weights land: by default (`run.deterministic=False`) as soon as the step has finished on
its devices, at the next decode-chunk boundary; the rollout waits for the trainer only when eta
forces it. `run.deterministic=True` keeps the counter schedule (land after `run.land_after_chunks`
chunks, waiting for the step if needed): every decision is then a function of step and chunk counters,
never of readiness, so a run is bit-reproducible. A multi-process run always takes the counter
schedule, so every process takes the same decisions without exchanging readiness.

Timeline: a watcher thread per train step blocks on the step's outputs and stamps their device
completion (runtime/watch.py), so the "train" span ends when the devices finished, not at the next host
check; every decode chunk's tokens are bracketed by host times, which gives `perf/overlap_tokens`:
rollout tokens provably generated while the step ran.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxrl_topo.rollout.engine import RolloutEngine
from jaxrl_topo.runtime.experiment import Experiment
from jaxrl_topo.runtime.rollout_side import Feed, Trajectories, _devices, evaluate_metrics, rollout, span
from jaxrl_topo.runtime.watch import ChunkClock, StepWatch, WallClock
from jaxrl_topo.topology import hostcomm
from jaxrl_topo.topology.hostcomm import to_host
from jaxrl_topo.topology.rules import TRAIN_RULES
from jaxrl_topo.train.batch import Completion, TrainBatch, balance_groups, build_batch, plan_rows
from jaxrl_topo.train.step import batch_sharding_for, check_batch, with_logprobs

__all__ = ["LoopHooks", "Trajectories", "make_batch", "restored_weights", "rollout", "sync_weights",
           "train_loop"]


@dataclasses.dataclass
class _InFlight:
  step: int
  traj: Trajectories
  metrics: dict  # device scalars
  t0: float
  queued_at: float  # the step's program is enqueued on its devices (after compilation, on the first step)
  watch: StepWatch  # device-completion stamps of the logprobs phase and the step
  pre: dict | None = None  # the logprobs phase's device outputs (None: the step computes them itself)
  chunks: int = 0  # decode chunks run since dispatch (deterministic async landing rule)


# ---------------------------------------------------------------- train side


def make_batch(exp: Experiment, traj: Trajectories, version: int | None = None) -> tuple[TrainBatch, dict]:
  """(the step's TrainBatch, layout metrics). Packed into rows of at most `train.max_tokens_per_row` tokens
  when set (train/batch.py plan_rows), else one completion per row. `version`: the weights the step
  starts from; tokens sampled under them are marked `onpolicy_MBT` (the log-prob gap is measured on those)."""
  cfg = exp.cfg
  G, n_micro, budget = cfg.rl.group_size, cfg.run.n_micro, cfg.train.max_tokens_per_row
  samples, rewards = traj.samples, traj.rewards_N
  prompts = [traj.examples[i // G]["prompt_ids"] for i in range(len(samples))]
  if budget and n_micro > 1:  # even out the microbatches' tokens, so none needs more rows than the others
    order = [g * G + j for g in balance_groups([sum(len(prompts[g * G]) + len(s.tokens) for s in
                                                    samples[g * G : (g + 1) * G]) for g in range(len(samples) // G)],
                                                n_micro, cfg.rl.minibatches) for j in range(G)]
    samples, rewards, prompts = [samples[i] for i in order], rewards[order], [prompts[i] for i in order]
  comps = [Completion(p, s.tokens, float(r), s.logprobs, s.loss_mask) for p, s, r in zip(prompts, samples, rewards,
                                                                                        strict=True)]
  if budget:
    rows, row_len = plan_rows([len(c.prompt) + len(c.response) for c in comps], n_micro, budget,
                              multiple=exp.dp_width)
  else:
    row_len, rows = exp.row_len, len(comps) // n_micro
  batch = build_batch(comps, n_micro=n_micro, rows=rows, row_len=row_len, resp_len=exp.resp_len, pack=bool(budget))
  if cfg.reward.overlong_filter:  # DAPO: completions cut by the length limit carry no loss
    cut = np.array([s.finish_reason == "length" for s in samples]).reshape(batch.mask_MBT.shape[:2])
    batch.mask_MBT[cut] = 0.0
  if version is not None:
    fresh = np.zeros_like(batch.mask_MBT)
    for i, s in enumerate(samples):
      fresh.reshape(-1, fresh.shape[-1])[i, : len(s.gen_ids)] = np.asarray(s.gen_ids) == version
    batch = batch.replace(onpolicy_MBT=fresh * batch.mask_MBT)
  real = sum(len(c.prompt) + len(c.response) for c in comps)
  layout = {"train/rows": int(batch.tokens_MRS.shape[0] * batch.tokens_MRS.shape[1]), "train/row_len": row_len,
            "train/pad_frac": 1.0 - real / batch.tokens_MRS.size}
  return batch, layout


def sync_weights(exp: Experiment, version: int, policy: str = "keep_kv") -> dict:
  """Trainer weights (version `version`) -> the rollout layout (sync.mode) -> the engine. The engine's
  current weights are freed bucket by bucket as the new ones land, except under finish_on_old, where
  live sequences keep decoding on them until the swap."""
  # The old destination is the newest weights the engine holds, a pending update's if one has not swapped in yet:
  # delta reuses its unchanged buckets (the plan compares against the last weights sent, which are those).
  params, stats = exp.sync(exp.state, None if policy == "finish_on_old" else exp.engine.newest_params)
  exp.engine.update_weights(params, version, policy)
  return stats


def restored_weights(exp: Experiment, start: int) -> None:
  """After a checkpoint of step `start` restored exp.state: its weights to the engine, built from the initial ones.
  Step 0 (the warm-up's checkpoint) is the engine's own version 0, so it is replaced in place, not versioned; the
  old weights are freed bucket by bucket as the new ones land, as in every sync."""
  if start > 0:
    sync_weights(exp, start)
  else:
    exp.engine.params = exp.sync(exp.state, exp.engine.newest_params)[0]


# ---------------------------------------------------------------- the loop


def _no_chunk_hook(engine: RolloutEngine) -> None:
  """LoopHooks.on_chunk's default: with it a colocated rollout needs no chunk boundaries (chunks may grow)."""


@dataclasses.dataclass
class LoopHooks:
  """What the launcher plugs in: metrics sink, checkpointing, eval cadence."""

  # Each step's metrics, with `_lags` (each token's staleness, an array; run.py logs it as a histogram)
  on_step: Callable[[int, dict], None] = lambda step, metrics: None
  on_trained: Callable[[int, Trajectories], None] = lambda step, traj: None  # after step's weights landed
  # Right before on_trained: the step's metrics as they stand when its weights land (its evaluation and wall-clock
  # figures come later, in on_step), so a checkpoint taken in on_trained can keep them (run.py, mux/resume.py)
  on_landed: Callable[[int, dict], None] = lambda step, metrics: None
  # Right before each on_trained: the batches produced but not trained yet (exact resume saves them).
  in_flight: Callable[[list[Trajectories]], None] = lambda trajs: None
  should_eval: Callable[[int], bool] = lambda done: False  # evaluate after `done` steps (trained in all)?
  on_produced: Callable[[int], None] = lambda step: None  # a rollout batch is ready
  on_span: Callable[[dict], None] = lambda span: None  # timeline entries (review/ audits them)
  # ("rollout", k) before a batch-mode rollout of batch k, ("train", k) before step k goes to the trainer:
  # a co-execution group (jaxrl_topo/mux/) waits there for its turn on the pool and warm-loads the job's state.
  on_phase_start: Callable[[str, int], None] = lambda phase, step: None
  on_chunk: Callable[[RolloutEngine], None] = _no_chunk_hook  # between decode chunks (mux: tail migration)


def needs_chunk_boundaries(mode: str, hooks: LoopHooks) -> bool:
  """Whether the loop's between-chunk hook must run at every decode chunk's end (else the engine may grow
  chunks, EngineConfig.max_chunk): yes wherever weights land or batches join between chunks (disaggregated,
  async) or a caller hooks in (a mux group's tail migration); a colocated batch has no such use."""
  return mode != "colocated" or hooks.on_chunk is not _no_chunk_hook


def _step_metrics(traj: Trajectories, train: dict, version_at_train: int, G: int) -> dict:
  lens = np.array([len(s.tokens) for s in traj.samples])
  lags = np.array([version_at_train - g for s in traj.samples for g in s.gen_ids])
  out = {"reward_mean": float(traj.rewards_N.mean()), "reward_std": float(traj.rewards_N.std()),
         "reward/correct": float(traj.correct_N.mean()), "response/length_mean": float(lens.mean()),
         "response/length_max": int(lens.max()), "response/truncated_frac": float(
             np.mean([s.finish_reason == "length" for s in traj.samples])),
         "staleness/max": int(lags.max()), "staleness/mean": float(lags.mean()),
         "perf/tokens": int(lens.sum())}
  out.update(traj.info)
  out.update({k: float(v) for k, v in train.items()})
  out["_lags"] = lags
  return out


def train_loop(exp: Experiment, *, start_step: int = 0, hooks: LoopHooks | None = None,
               in_flight: list[Trajectories] = (), lost: dict | None = None) -> dict:
  """Runs steps [start_step, run.steps); returns the last step's metrics (less `_lags`). `in_flight`: batches
  start_step, start_step + 1, ... produced before a checkpoint and not trained (run.py restores them: exact resume).
  `lost`: step start_step - 1's metrics as its checkpoint kept them (on_landed's), its line never written (a kill
  after the checkpoint): it goes to on_step first, evaluated first where due, on the restored weights (in async mode
  the lost evaluation may have read a later version)."""
  hooks = hooks or LoopHooks()
  cfg = exp.cfg
  mode, eta, steps = cfg.topology.mode, cfg.run.max_staleness, cfg.run.steps
  deterministic = cfg.run.deterministic or jax.process_count() > 1  # readiness is one process's knowledge
  version = start_step  # the trainer's weights version == steps trained
  ready: collections.deque[Trajectories] = collections.deque(in_flight)
  pending: _InFlight | None = None
  produced = start_step + len(ready)
  last: dict = {}
  checked = False
  trainer_devices, rollout_devices = _devices(exp.topology.trainer), _devices(exp.topology.rollout)
  deferred: collections.deque[tuple[int, dict, bool]] = collections.deque()  # (step, metrics, restored)
  chunks, wall = ChunkClock(exp.engine), WallClock()
  if lost is not None:  # no wall-clock figures: the step's time went with the process that ran it
    deferred.append((start_step - 1, dict(lost), True))

  def dispatch(traj: Trajectories) -> _InFlight:
    nonlocal checked
    hooks.on_phase_start("train", traj.step)
    batch, layout = make_batch(exp, traj, version)
    traj.info.update(layout)
    if not checked:
      check_batch(batch, exp.topology.trainer, TRAIN_RULES, cfg.rl.group_size, vocab_size=exp.model_cfg.vocab_size)
      checked = True
    if mode == "colocated":
      exp.engine.release_kv()
    t0 = time.perf_counter()
    batch = jax.device_put(batch, batch_sharding_for(exp.topology.trainer, TRAIN_RULES))  # global arrays
    pre = None
    if exp.logprobs_fn is not None:  # its own program, so the phase has its own time; the step is queued behind
      pre = exp.logprobs_fn(exp.state, batch)
      batch = with_logprobs(batch, pre)
    exp.state, metrics = exp.step_fn(exp.state, batch)
    return _InFlight(traj.step, traj, metrics, t0, time.perf_counter(), StepWatch(pre, metrics), pre)

  def land(flight: _InFlight, policy: str, at_chunk: bool = False) -> None:
    nonlocal version
    waited = not flight.watch.done.is_set()
    flight.watch.wait()  # device completion of the step (the watcher stamps it; this only waits)
    t_pre = flight.watch.pre_done_at or flight.queued_at  # the step's program starts (compilation excluded)
    # The trainer's devices wait on the controller only until the step is queued: a later compile (a rollout's
    # new bucket) is not theirs (compile_until, runtime/spans.py)
    if flight.pre is not None:
      hooks.on_span(span("logprobs", "trainer", trainer_devices, flight.step, version, flight.t0, t_pre,
                         compile_until=flight.queued_at))
    train = to_host(flight.metrics)
    end = flight.watch.done_at
    # The span opens at the dispatch: a first step's compile is in it (its compile_s, runtime/spans.py), not lost
    # between spans (a colocated run's trainer read as idle while it compiled)
    hooks.on_span(span("train", "trainer", trainer_devices, flight.step, version, flight.watch.pre_done_at or flight.t0,
                       end, compile_until=flight.queued_at))
    overlap = chunks.tokens_within(flight.queued_at, end)
    version += 1
    t_sync = time.perf_counter()
    sync = sync_weights(exp, version, policy)
    hooks.on_span(span("sync", "trainer->rollout", sorted(set(trainer_devices) | set(rollout_devices)),
                       flight.step, version, t_sync, time.perf_counter()))
    m = _step_metrics(flight.traj, train, version - 1, cfg.rl.group_size)
    m.update(sync)
    m["time/train_s"] = end - t_pre
    m["time/logprobs_s"] = t_pre - flight.t0 if flight.pre is not None else 0.0
    m["perf/overlap_tokens"] = overlap  # rollout tokens generated between enqueue and device completion
    m["perf/land_at_chunk"] = float(at_chunk)  # landed between decode chunks of a running batch (async)
    m["perf/land_waited"] = float(waited)  # the controller had to wait for the step to finish on its devices
    m["version"] = version
    if m["staleness/max"] > eta:
      raise AssertionError(f"step {flight.step}: a token {m['staleness/max']} versions old exceeds eta={eta}")
    hooks.on_landed(flight.step, m)
    hooks.in_flight(list(ready))  # async: a batch being generated now is not among them (regenerated on resume)
    hooks.on_trained(flight.step, flight.traj)  # the state is exactly version step + 1 here (checkpoints)
    deferred.append((flight.step, m, False))  # eval and logging wait until no engine.run is in progress

  def drain() -> None:
    nonlocal last
    while deferred:
      step, m, restored = deferred.popleft()
      if not restored:
        m.update(wall.step(m["perf/tokens"]))  # wall-clock figures: seconds since the last step, eval excluded
      if hooks.should_eval(step + 1):
        if feed is not None:
          feed.drain()  # the evaluation needs every slot: the batches added so far finish first
        t = time.perf_counter()
        # The weights evaluated: step + 1's, or (async, eta > 0) a later version that landed meanwhile
        m["eval/version"] = exp.engine.gen_id
        m.update(evaluate_metrics(exp, tag=step + 1))  # eval/accuracy (+ eval/env/... with an environment)
        chunks.reset()  # the evaluation's tokens are no rollout's
        hooks.on_span(span("eval", "rollout", rollout_devices, step, exp.engine.gen_id, t, time.perf_counter()))
        wall.exclude(time.perf_counter() - t)
      last = {k: v for k, v in m.items() if k != "_lags"}
      hooks.on_step(step, m)
      hostcomm.collect()  # multi-process: every host read of this step is done; free the store's keys

  def tick(engine: RolloutEngine) -> None:  # between decode chunks
    nonlocal pending
    chunks.chunk()
    hooks.on_chunk(engine)
    if pending is not None:
      pending.chunks += 1
      due = pending.chunks >= cfg.run.land_after_chunks if deterministic else pending.watch.done.is_set()
      if mode == "async" and due:
        land(pending, cfg.rollout.update_policy, at_chunk=True)
        pending = dispatch(ready.popleft()) if ready else None
    if feed is not None:
      feed.top_up(min(steps, version + eta + 1))  # the new version may admit the next batch
    chunks.resume()  # the next chunk is dispatched after this

  tick.needs_boundaries = needs_chunk_boundaries(mode, hooks)
  # Continuous (module docstring): batch k joins the open stream once k <= version + eta, so every token
  # of it is sampled at most eta versions before step k trains on it, whatever the stream holds then.
  feed = Feed(exp, produced, tick, hooks.on_span) if cfg.continuous_rollout else None
  failed = True
  try:
    drain()  # a lost line, before anything else runs
    while version < steps:
      if pending is None and ready:
        pending = dispatch(ready.popleft())
      if produced < steps and produced <= version + eta and len(ready) <= eta:
        if feed is not None:
          feed.top_up(min(steps, version + eta + 1))
          traj = feed.take(produced)
        else:
          chunks.reset()
          hooks.on_phase_start("rollout", produced)
          traj = rollout(exp, produced, tick, hooks.on_span)
        ready.append(traj)
        hooks.on_produced(produced)
        produced += 1
      elif pending is not None:
        flight, pending = pending, None
        # Batch mode: between batches no sequence is live, every policy is the same. Continuous: the
        # stream may hold later batches' sequences, which the update meets under its policy.
        land(flight, cfg.rollout.update_policy if feed is not None else "keep_kv")
      elif not ready:
        raise RuntimeError(f"controller stalled at version {version}, produced {produced}")  # a bug, never input
      drain()
    failed = False
  finally:
    if feed is not None:
      feed.close(abandon=failed)
  return last
