"""The RL controller: one loop, three modes, the same algorithm code (DESIGN §4-5).

A rollout batch k is produced by the engine under some weight version, scored, and consumed by train
step k; after step k the trainer's weights are version k + 1 and are synced to the rollout side.
The modes differ only in what may overlap, which the loop expresses with one bound, eta
(`run.max_staleness`), and one switch (weights land between decode chunks or between batches):

  colocated      eta = 0: rollout k, train k, sync; one set of devices, the KV pool released while training
  disaggregated  eta = 1: rollout k+1 runs on its own devices while train k (dispatched, not awaited) runs;
                 weights land between batches, so batch k+1 is one version behind (eta = 0: sequential)
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
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_topo.rollout.engine import Request, RolloutEngine, Sample
from jaxrl_topo.rollout.sampling import SamplingConfig
from jaxrl_topo.runtime.config import MODEL_REWARD
from jaxrl_topo.runtime.experiment import Experiment
from jaxrl_topo.runtime.watch import ChunkClock, StepWatch, WallClock
from jaxrl_topo.topology import hostcomm
from jaxrl_topo.topology.hostcomm import to_host
from jaxrl_topo.topology.rules import TRAIN_RULES
from jaxrl_topo.train.batch import Completion, TrainBatch, balance_groups, build_batch, plan_rows
from jaxrl_topo.train.step import batch_sharding_for, check_batch, with_logprobs

_ROLLOUT_TAG, _EVAL_TAG = 1, 2  # fold_in tags of the sampling keys


@dataclasses.dataclass
class Trajectories:
  """One step's scored rollout batch, group-major."""

  step: int
  examples: list[dict]  # one per group
  samples: list[Sample]
  rewards_N: np.ndarray  # shaped rewards the loss uses
  correct_N: np.ndarray  # the main reward function's raw score
  info: dict  # reward errors/timeouts, dynamic-sampling counts, seconds
  data_state: dict  # the prompt iterator's state right after this batch was drawn


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


def _devices(mesh) -> list[int]:
  return sorted(int(d.id) for d in mesh.devices.flat)


def span(phase: str, role: str, devices: list[int], step: int, gen_id: int, start: float, end: float) -> dict:
  """One timeline entry (DESIGN §4: every arrow is a named span); times are time.perf_counter()."""
  return {"phase": phase, "role": role, "devices": devices, "step": step, "gen_id": gen_id, "start": start,
          "end": end}


# ---------------------------------------------------------------- rollout + rewards


def _requests(exp: Experiment, examples: list[dict]) -> list[Request]:
  return [Request(ex["prompt_ids"], n=exp.cfg.rl.group_size, max_new_tokens=exp.cfg.rollout.max_new_tokens,
                  stop_ids=exp.stop_ids, stop_strings=exp.stop_strings) for ex in examples]


def _texts(exp: Experiment, samples: list[Sample]) -> list[str]:
  return [exp.tokenizer.decode(s.tokens) for s in samples]


def _score_texts(exp: Experiment, meta: list[dict], samples: list[Sample], *,
                 main_only: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
  """(weighted total, the main reward's scores, info) of one sample per `meta` entry: the reward
  functions in the worker pool, plus the reward model (on its devices) when there is one.
  `main_only` (evaluation): the model is only run when it is the main reward."""
  rc = exp.cfg.reward
  result = exp.rewards.score([m["prompt"] for m in meta], _texts(exp, samples), meta)
  total, per_fn = result.total_N.astype(np.float32).copy(), dict(result.per_fn)
  info = {"reward/errors": result.errors, "reward/timeouts": result.timeouts}
  if exp.reward_model is not None and (rc.fn == MODEL_REWARD or not main_only):
    model_N = exp.reward_model.score([list(m["prompt_ids"]) + list(s.tokens) for m, s in zip(meta, samples,
                                                                                           strict=True)])
    per_fn[MODEL_REWARD] = model_N
    total += (1.0 if rc.fn == MODEL_REWARD else rc.model_weight) * model_N
    info["reward/model_mean"] = float(model_N.mean())
  return total, per_fn[rc.fn], info


def score(exp: Experiment, examples: list[dict], samples: list[Sample]) -> tuple[np.ndarray, np.ndarray, dict]:
  """(shaped rewards, main-function scores, info) for group-major samples of `examples`."""
  G = exp.cfg.rl.group_size
  meta = [examples[i // G] for i in range(len(samples))]
  rewards, main, info = _score_texts(exp, meta, samples)
  rc = exp.cfg.reward
  if rc.overlong_buffer:  # DAPO soft overlong punishment: linear over the last `buffer` tokens
    limit = exp.cfg.rollout.max_new_tokens - rc.overlong_buffer
    over = np.array([max(0, len(s.tokens) - limit) for s in samples], np.float32)
    rewards -= rc.overlong_penalty * over / rc.overlong_buffer
  return rewards, main, info


_KEYS: dict = {}  # (seed, steps, rounds) -> host key data of every (step, round)


def _rollout_key(exp: Experiment, step: int, round_: int) -> jax.Array:
  """The sampling key of (seed, step, round), placed on the rollout devices. The keys are derived once, on
  the first call (before any train step is queued), and kept on the host: a key computed on the default
  device, a trainer device in disaggregated mode, would queue every rollout program behind the running
  train step (measured on CPU: no overlap at all)."""
  cfg = exp.cfg
  rounds = cfg.reward.max_sampling_rounds
  table = _KEYS.get((cfg.run.seed, cfg.run.steps, rounds))
  if table is None or step >= len(table):
    base = jax.random.fold_in(jax.random.key(cfg.run.seed), _ROLLOUT_TAG)
    grid = jax.vmap(lambda s: jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, s), r))(
        np.arange(rounds)))(np.arange(max(cfg.run.steps, step + 1)))
    table = _KEYS[(cfg.run.seed, cfg.run.steps, rounds)] = np.asarray(jax.random.key_data(grid))
  if jax.process_count() > 1:  # every process passes the same kind of value: a host one
    return jax.random.wrap_key_data(table[step, round_])
  rollout = NamedSharding(exp.topology.rollout, PartitionSpec())
  return jax.random.wrap_key_data(jax.device_put(table[step, round_], rollout))


def rollout(exp: Experiment, step: int, on_chunk: Callable[[RolloutEngine], None] | None = None,
            on_span: Callable[[dict], None] = lambda s: None) -> Trajectories:
  """Draws a prompt batch, samples G completions each, scores them; DAPO dynamic sampling draws more
  batches until `data.batch_size` groups have reward variance (or `max_sampling_rounds` are spent)."""
  cfg, G = exp.cfg, exp.cfg.rl.group_size
  want = cfg.data.batch_size
  keep, spare, info = [], [], collections.Counter()
  t0 = time.perf_counter()
  for round_ in range(cfg.reward.max_sampling_rounds if cfg.reward.dynamic_sampling else 1):
    examples = next(exp.prompts)
    key = _rollout_key(exp, step, round_)
    t, gen_id = time.perf_counter(), exp.engine.gen_id
    samples = exp.engine.run(_requests(exp, examples), on_chunk, key=key)
    t1 = time.perf_counter()
    info["time/rollout_s"] += t1 - t
    on_span(span("rollout", "rollout", _devices(exp.topology.rollout), step, gen_id, t, t1))
    rewards, main, rinfo = score(exp, examples, samples)
    t2 = time.perf_counter()
    info["time/reward_s"] += t2 - t1
    reward_devices = _devices(exp.reward_model.mesh) if exp.reward_model is not None else []
    on_span(span("reward", "reward", reward_devices, step, gen_id, t1, t2))
    info.update(rinfo)
    for g, ex in enumerate(examples):
      group = (ex, samples[g * G : (g + 1) * G], rewards[g * G : (g + 1) * G], main[g * G : (g + 1) * G])
      varied = np.ptp(group[2]) > 0
      (keep if varied or not cfg.reward.dynamic_sampling else spare).append(group)
    info["dapo/rounds"] = round_ + 1
    if len(keep) >= want:
      break
  info["dapo/dropped_groups"] = len(spare)
  groups = (keep + spare)[:want]  # short after the last round: fill with zero-variance groups
  info["time/rollout_total_s"] = time.perf_counter() - t0
  return Trajectories(step=step, examples=[g[0] for g in groups], samples=[s for g in groups for s in g[1]],
                      rewards_N=np.concatenate([g[2] for g in groups]),
                      correct_N=np.concatenate([g[3] for g in groups]), info=dict(info),
                      data_state=exp.prompts.get_state())


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
                                                n_micro) for j in range(G)]
    samples, rewards, prompts = [samples[i] for i in order], rewards[order], [prompts[i] for i in order]
  comps = [Completion(p, s.tokens, float(r), s.logprobs) for p, s, r in zip(prompts, samples, rewards, strict=True)]
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
  params, stats = exp.sync(exp.state, None if policy == "finish_on_old" else exp.engine.params)
  exp.engine.update_weights(params, version, policy)
  return stats


# ---------------------------------------------------------------- evaluation


def evaluate(exp: Experiment, tag: int = 0) -> float:
  """Held-out accuracy (0..1): the main reward function's mean score, one greedy sample per prompt."""
  if not exp.heldout:
    return float("nan")
  reqs = [dataclasses.replace(q, n=1) for q in _requests(exp, exp.heldout)]
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(exp.cfg.run.seed), _EVAL_TAG), tag)
  samples = exp.engine.run(reqs, key=key, sampling=SamplingConfig(greedy=True) if exp.cfg.rollout.eval_greedy else None)
  return float(np.mean(_score_texts(exp, exp.heldout, samples, main_only=True)[1]))


# ---------------------------------------------------------------- the loop


@dataclasses.dataclass
class LoopHooks:
  """What the launcher plugs in: metrics sink, checkpointing, eval cadence."""

  on_step: Callable[[int, dict], None] = lambda step, metrics: None
  on_trained: Callable[[int, Trajectories], None] = lambda step, traj: None  # after step's weights landed
  # Right before each on_trained: the batches produced but not trained yet (exact resume saves them).
  in_flight: Callable[[list[Trajectories]], None] = lambda trajs: None
  should_eval: Callable[[int], bool] = lambda step: False
  on_produced: Callable[[int], None] = lambda step: None  # a rollout batch is ready
  on_span: Callable[[dict], None] = lambda span: None  # timeline entries (review/ audits them)


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
               in_flight: list[Trajectories] = ()) -> dict:
  """Runs steps [start_step, run.steps); returns the last step's metrics. `in_flight`: batches start_step,
  start_step + 1, ... produced before a checkpoint and not trained (run.py restores them: exact resume)."""
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
  deferred: collections.deque[tuple[int, dict]] = collections.deque()
  chunks, wall = ChunkClock(exp.engine), WallClock()

  def dispatch(traj: Trajectories) -> _InFlight:
    nonlocal checked
    batch, layout = make_batch(exp, traj, version)
    traj.info.update(layout)
    if not checked:
      check_batch(batch, exp.topology.trainer, TRAIN_RULES, cfg.rl.group_size)
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
    if flight.pre is not None:
      hooks.on_span(span("logprobs", "trainer", trainer_devices, flight.step, version, flight.t0, t_pre))
    train = to_host(flight.metrics)
    end = flight.watch.done_at
    hooks.on_span(span("train", "trainer", trainer_devices, flight.step, version, t_pre, end))
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
    hooks.in_flight(list(ready))  # async: a batch being generated now is not among them (regenerated on resume)
    hooks.on_trained(flight.step, flight.traj)  # the state is exactly version step + 1 here (checkpoints)
    deferred.append((flight.step, m))  # eval and logging wait until no engine.run is in progress

  def drain() -> None:
    nonlocal last
    while deferred:
      step, m = deferred.popleft()
      m.update(wall.step(m["perf/tokens"]))  # wall-clock figures: seconds since the last step, eval excluded
      if hooks.should_eval(step + 1):
        t = time.perf_counter()
        m["eval/accuracy"] = evaluate(exp, tag=step + 1)
        hooks.on_span(span("eval", "rollout", rollout_devices, step, exp.engine.gen_id, t, time.perf_counter()))
        wall.exclude(time.perf_counter() - t)
      last = m
      hooks.on_step(step, m)
      hostcomm.collect()  # multi-process: every host read of this step is done; free the store's keys

  def tick(engine: RolloutEngine) -> None:  # between decode chunks
    nonlocal pending
    chunks.chunk()
    if pending is not None:
      pending.chunks += 1
      due = pending.chunks >= cfg.run.land_after_chunks if deterministic else pending.watch.done.is_set()
      if mode == "async" and due:
        land(pending, cfg.rollout.update_policy, at_chunk=True)
        pending = dispatch(ready.popleft()) if ready else None
    chunks.resume()  # the next chunk is dispatched after this

  while version < steps:
    if pending is None and ready:
      pending = dispatch(ready.popleft())
    if produced < steps and produced <= version + eta and len(ready) <= eta:
      chunks.reset()
      ready.append(rollout(exp, produced, tick, hooks.on_span))
      hooks.on_produced(produced)
      produced += 1
    elif pending is not None:
      flight, pending = pending, None
      land(flight, "keep_kv")  # between batches no sequence is live: every policy is the same
    elif not ready:
      raise RuntimeError(f"controller stalled at version {version}, produced {produced}")  # a bug, never input
    drain()
  return last
