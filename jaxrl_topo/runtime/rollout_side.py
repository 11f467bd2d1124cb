"""The rollout side of one RL step: draw prompts, generate G samples each, score them.

Two ways to produce batch k, one result (`Trajectories`):

  batch       `rollout(exp, k)`: the engine generates batch k alone and returns when its last sample
              ends; then the batch is scored. Colocated mode (the KV pool is released while training),
              DAPO dynamic sampling (a further round depends on the last one's scores), and
              `rollout.continuous=False`.
  continuous  `Feed`: one engine stream stays open for the whole run. Batch k's prompts are added
              to it as soon as staleness allows (`k <= version + eta`), so they take slots as batch
              k-1's stragglers free them, and no batch drains before the next starts. Each group is
              handed to the reward pool the moment its last sample ends, and scored there while
              decoding goes on; `take(k)` returns batch k once all of its groups are done.

Sampling keys: every sample's key is (run key, sequence id, position) with sequence ids
`seq_base(k, round) + i` unique over the run, so a sample draws the same tokens whatever batch,
stream or mode it is generated in.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import zlib
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_topo.rollout.engine import Request, RolloutEngine, Sample
from jaxrl_topo.rollout.sampling import SamplingConfig
from jaxrl_topo.runtime.experiment import Experiment
from jaxrl_topo.runtime.metrics import EVAL_ACCURACY, eval_pass_at
from jaxrl_topo.runtime.sections import MODEL_REWARD
from jaxrl_topo.topology import hostcomm

_ROLLOUT_TAG, _EVAL_TAG = 1, 2  # fold_in tags of the sampling keys
_MAX_SEQ_ID = 2**31 - 1  # sequence ids are int32 on device


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


def _devices(mesh) -> list[int]:
  return sorted(int(d.id) for d in mesh.devices.flat)


def span(phase: str, role: str, devices: list[int], step: int, gen_id: int, start: float, end: float,
         compile_until: float | None = None) -> dict:
  """One timeline entry (every arrow of the step is a named span); times are time.perf_counter(). `compile_until`:
  the controller's compiles count against the span only until then (runtime/spans.py)."""
  out = {"phase": phase, "role": role, "devices": devices, "step": step, "gen_id": gen_id, "start": start, "end": end}
  return out if compile_until is None else {**out, "compile_until": compile_until}


def _requests(exp: Experiment, examples: list[dict]) -> list[Request]:
  turns = exp.cfg.env.max_turns if exp.env is not None else 0  # > 0: episodes (rollout/episodes.py)
  return [Request(ex["prompt_ids"], n=exp.cfg.rl.group_size, max_new_tokens=exp.cfg.rollout.max_new_tokens,
                  stop_ids=exp.stop_ids, stop_strings=exp.stop_strings, max_turns=turns) for ex in examples]


def _start_episodes(exp: Experiment, examples: list[dict], tag, group_size: int) -> tuple[list[dict], dict]:
  """With an environment: each example's prompt is its reset observation (envs/turns.py), and the batch
  is registered under `tag` for the engine's turns handler. Without one: nothing changes."""
  if exp.env is None:
    return examples, {}
  examples, info = exp.env.prepare(examples)
  exp.env.add(tag, examples, group_size)
  return examples, info


def prompt_hash(examples: list[dict]) -> int:
  """crc32 of a batch's prompt ids, in order: logged per step (`data/prompt_hash`), so a resumed run can
  be checked to train every prompt batch once, in the uninterrupted run's order."""
  return zlib.crc32(np.concatenate([np.asarray(ex["prompt_ids"], np.int32) for ex in examples]).tobytes())


def _texts(exp: Experiment, samples: list[Sample]) -> list[str]:
  return [exp.tokenizer.decode(s.tokens) for s in samples]


# ---------------------------------------------------------------- rewards


def submit_scores(exp: Experiment, meta: list[dict], samples: list[Sample]) -> int:
  """Hands one sample per `meta` entry to the reward pool (scored in the background); returns the ticket."""
  return exp.rewards.submit([m["prompt"] for m in meta], _texts(exp, samples), meta)


def finish_scores(exp: Experiment, meta: list[dict], samples: list[Sample], tickets: list[int], *,
                  main_only: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
  """(weighted total, the main reward's scores, info) of the samples whose pool scores `tickets` hold
  (in order), plus the reward model (on its devices) when there is one. `main_only` (evaluation): the
  model is only run when it is the main reward."""
  rc = exp.cfg.reward
  result = exp.rewards.collect(tickets)
  total, per_fn = result.total_N.astype(np.float32).copy(), dict(result.per_fn)
  info = {"reward/errors": result.errors, "reward/timeouts": result.timeouts}
  if exp.reward_model is not None and (rc.fn == MODEL_REWARD or not main_only):
    model_N = exp.reward_model.score([list(m["prompt_ids"]) + list(s.tokens) for m, s in zip(meta, samples,
                                                                                           strict=True)])
    per_fn[MODEL_REWARD] = model_N
    total += (1.0 if rc.fn == MODEL_REWARD else rc.model_weight) * model_N
    info["reward/model_mean"] = float(model_N.mean())
  return total, per_fn[rc.fn], info


def score(exp: Experiment, examples: list[dict], samples: list[Sample],
          tickets: list[int] | None = None, tag=None) -> tuple[np.ndarray, np.ndarray, dict]:
  """(shaped rewards, main-function scores, info) for group-major samples of `examples`; `tickets`:
  their pool scores, already submitted group by group (else submitted now). With an environment the
  episodes' returns (batch `tag` of the turns handler) are the reward."""
  G = exp.cfg.rl.group_size
  meta = [examples[i // G] for i in range(len(samples))]
  if exp.env is not None:
    rewards, info = exp.env.take(tag, samples)
    main = rewards.copy()
  else:
    if tickets is None:
      tickets = [submit_scores(exp, meta, samples)]
    rewards, main, info = finish_scores(exp, meta, samples, tickets)
  rc = exp.cfg.reward
  if rc.overlong_buffer:  # DAPO soft overlong punishment: linear over the last `buffer` tokens
    limit = exp.cfg.rollout.max_new_tokens - rc.overlong_buffer
    over = np.array([max(0, len(s.tokens) - limit) for s in samples], np.float32)
    rewards -= rc.overlong_penalty * over / rc.overlong_buffer
  rewards, main, info = agreed((rewards, main, info))
  if exp.env is not None and exp.env.breaker is not None:  # on the agreed counts: every process stops together
    exp.env.breaker.count({exp.cfg.env.fn: info["env/errors"] + info["env/timeouts"]}, len(samples),
                          exp.env.last_failure)
  return rewards, main, info


def agreed(scores):
  """Process 0's `scores` on every process. Each process scores in its own worker pool, against a wall-clock
  timeout, so one process can time out where another does not; the loop's decisions (DAPO's groups, the
  batch every process puts on the trainer's devices, the logged accuracy) must not differ."""
  return hostcomm.broadcast(scores, src=0)


# ---------------------------------------------------------------- keys


_KEYS: dict = {}  # seed -> host key data of the run's rollout key


def rollout_key(exp: Experiment) -> jax.Array:
  """The run's sampling key, placed on the rollout devices. Derived once, on the first call (before any
  train step is queued), and kept on the host: a key computed on the default device, a trainer device in
  disaggregated mode, would queue every rollout program behind the running train step (measured on CPU:
  no overlap at all)."""
  seed = exp.cfg.run.seed
  if seed not in _KEYS:
    _KEYS[seed] = np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), _ROLLOUT_TAG)))
  if jax.process_count() > 1:  # every process passes the same kind of value: a host one
    return jax.random.wrap_key_data(_KEYS[seed])
  return jax.random.wrap_key_data(jax.device_put(_KEYS[seed], NamedSharding(exp.topology.rollout, PartitionSpec())))


def seq_base(exp: Experiment, step: int, round_: int) -> int:
  """First sequence id of (step, DAPO round): ids are unique over the run, so with the run's key every
  sample has keys of its own."""
  cfg = exp.cfg
  per_batch = cfg.data.batch_size * cfg.rl.group_size
  base = (step * cfg.reward.max_sampling_rounds + round_) * per_batch
  if base + per_batch > _MAX_SEQ_ID:
    raise ValueError(f"step {step}: sequence ids past int32 (run.steps x reward.max_sampling_rounds x batch)")
  return base


# ---------------------------------------------------------------- batch mode


def rollout(exp: Experiment, step: int, on_chunk: Callable[[RolloutEngine], None] | None = None,
            on_span: Callable[[dict], None] = lambda s: None) -> Trajectories:
  """Draws a prompt batch, samples G completions each, scores them; DAPO dynamic sampling draws more
  batches until `data.batch_size` groups have variance in the main reward (the accuracy, before any shaping
  or reward-model term; or `max_sampling_rounds` are spent)."""
  cfg, G = exp.cfg, exp.cfg.rl.group_size
  want = cfg.data.batch_size
  keep, spare, info = [], [], collections.Counter()
  t0 = time.perf_counter()
  for round_ in range(cfg.reward.max_sampling_rounds if cfg.reward.dynamic_sampling else 1):
    tag = ("batch", step, round_)
    examples, einfo = _start_episodes(exp, next(exp.prompts), tag, G)
    info.update(einfo)
    t, gen_id = time.perf_counter(), exp.engine.gen_id
    samples = exp.engine.run(_requests(exp, examples), on_chunk, key=rollout_key(exp),
                             seq_base=seq_base(exp, step, round_), turns=exp.env, tag=tag)
    t1 = time.perf_counter()
    info["time/rollout_s"] += t1 - t
    on_span(span("rollout", "rollout", _devices(exp.topology.rollout), step, gen_id, t, t1))
    rewards, main, rinfo = score(exp, examples, samples, tag=tag)
    t2 = time.perf_counter()
    info["time/reward_s"] += t2 - t1
    on_span(span("reward", "reward", _reward_devices(exp), step, gen_id, t1, t2))
    info.update(rinfo)
    for g, ex in enumerate(examples):
      group = (ex, samples[g * G : (g + 1) * G], rewards[g * G : (g + 1) * G], main[g * G : (g + 1) * G])
      varied = np.ptp(group[3]) > 0  # DAPO: the accuracy (main reward) varies; a length penalty is no signal
      (keep if varied or not cfg.reward.dynamic_sampling else spare).append(group)
    info["dapo/rounds"] = round_ + 1
    if len(keep) >= want:
      break
  info["dapo/dropped_groups"] = len(spare)
  groups = (keep + spare)[:want]  # short after the last round: fill with zero-variance groups
  info["time/rollout_total_s"] = time.perf_counter() - t0
  info["data/prompt_hash"] = prompt_hash([g[0] for g in groups])
  return Trajectories(step=step, examples=[g[0] for g in groups], samples=[s for g in groups for s in g[1]],
                      rewards_N=np.concatenate([g[2] for g in groups]),
                      correct_N=np.concatenate([g[3] for g in groups]), info=dict(info),
                      data_state=exp.prompts.get_state())


def _reward_devices(exp: Experiment) -> list[int]:
  return _devices(exp.reward_model.mesh) if exp.reward_model is not None else []


# ---------------------------------------------------------------- continuous mode


@dataclasses.dataclass
class _Batch:
  examples: list[dict]
  data_state: dict
  added_at: float
  gen_id: int  # the rollout weights when it was added
  tickets: dict = dataclasses.field(default_factory=dict)  # group -> reward-pool ticket
  drained_at: float | None = None  # finished by a drain (before an evaluation): its decoding ended then
  scored_early: int = 0  # groups handed to the pool before the batch's last sample ended


class Feed:
  """The continuous rollout side: one engine stream for the whole run (module docstring).

  The controller calls `top_up(limit)` whenever the trainer's version moves (batches k < limit may be
  in the stream), and `take(k)` for the next batch to train on. `on_chunk` runs between decode chunks
  (weights land there, and the controller may top up)."""

  def __init__(self, exp: Experiment, start: int, on_chunk: Callable[[RolloutEngine], None],
               on_span: Callable[[dict], None]):
    self.exp, self.on_span = exp, on_span
    self.added = start  # batches [start, added) were drawn and added
    self.batches: dict[int, _Batch] = {}
    self._last_done = 0.0  # when the previous batch taken finished
    self._ctx = exp.engine.stream(on_chunk, self._on_group, key=rollout_key(exp), turns=exp.env)
    self.stream = self._ctx.__enter__()

  def top_up(self, limit: int) -> None:
    """Draws and adds batches up to (not including) `limit`; each is admitted as slots free."""
    exp = self.exp
    while self.added < limit:
      k = self.added
      examples, _ = _start_episodes(exp, next(exp.prompts), k, exp.cfg.rl.group_size)
      self.batches[k] = _Batch(examples, exp.prompts.get_state(), time.perf_counter(), exp.engine.gen_id)
      self.stream.add(_requests(exp, examples), k, seq_base=seq_base(exp, k, 0))
      self.added += 1
    exp.rewards.poll()  # hand finished groups' calls to workers that came free

  def _on_group(self, k: int, g: int, samples: list[Sample]) -> None:
    b = self.batches[k]
    if self.exp.env is not None:  # the episodes' returns are the reward: nothing to score
      return
    b.tickets[g] = submit_scores(self.exp, [b.examples[g]] * len(samples), samples)
    b.scored_early += self.stream.pending(k)  # more of the batch is still decoding

  def take(self, k: int) -> Trajectories:
    """Batch k (already added), once every group has finished, scored."""
    exp, b = self.exp, self.batches[k]
    t = time.perf_counter()
    samples = self.stream.run_until(k)
    t1 = time.perf_counter()
    # Batches overlap in the stream: batch k's span starts when it joined, or when batch k-1 finished if that
    # is later, so the spans tile the rollout side's busy time (one batch's worth of decoding each). A batch a
    # drain finished ends there: the evaluation after it decoded none of it.
    end = t1 if b.drained_at is None else b.drained_at
    start, self._last_done = max(b.added_at, self._last_done), end
    self.on_span(span("rollout", "rollout", _devices(exp.topology.rollout), k, b.gen_id, start, end))
    rewards, main, info = score(exp, b.examples, samples, [b.tickets.get(g) for g in range(len(b.examples))], tag=k)
    t2 = time.perf_counter()
    self.on_span(span("reward", "reward", _reward_devices(exp), k, b.gen_id, t1, t2))
    del self.batches[k]
    info.update({"time/rollout_s": t1 - t, "time/reward_s": t2 - t1, "time/rollout_total_s": t2 - t,
                 "dapo/rounds": 1, "dapo/dropped_groups": 0, "reward/groups_scored_early": b.scored_early,
                 "data/prompt_hash": prompt_hash(b.examples)})
    return Trajectories(step=k, examples=b.examples, samples=samples, rewards_N=rewards, correct_N=main,
                        info=info, data_state=b.data_state)

  def drain(self) -> None:
    """Finishes every batch added so far (they stay to be taken): evaluation needs the engine's slots."""
    self.stream.drain()
    t = time.perf_counter()
    for b in self.batches.values():
      b.drained_at = b.drained_at or t

  def close(self, abandon: bool = False) -> None:
    """Ends the stream. `abandon` (the loop is failing): batches added and never taken are dropped with their
    sequences, slots and pages (RolloutEngine drops them on the way out; a resume redraws those batches)."""
    if abandon or self.batches:
      stop = RuntimeError("rollout feed abandoned")
      self._ctx.__exit__(RuntimeError, stop, None)  # the engine drops the stream's sequences (RolloutEngine._abandon)
    else:
      self._ctx.__exit__(None, None, None)


# ---------------------------------------------------------------- evaluation


def evaluate_metrics(exp: Experiment, tag: int = 0) -> dict:
  """{"eval/accuracy": held-out accuracy}: the main reward's mean over `run.eval_samples` samples a prompt (greedy:
  one); with more than one, eval/pass@k too (eval_scores). With an environment the episodes' returns are the
  scores and their info means come along (eval/env/...)."""
  k, etag = exp.cfg.run.eval_samples, ("eval", tag)
  if not exp.heldout:  # every key a run reads (summary.json's pass@k), unmeasured
    return {EVAL_ACCURACY: float("nan"), **({eval_pass_at(k): float("nan")} if k > 1 else {})}
  meta, _ = _start_episodes(exp, exp.heldout, etag, k)
  reqs = [dataclasses.replace(q, n=k) for q in _requests(exp, meta)]
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(exp.cfg.run.seed), _EVAL_TAG), tag)
  samples = exp.engine.run(reqs, key=key, sampling=SamplingConfig(greedy=True) if exp.cfg.rollout.eval_greedy else None,
                           turns=exp.env, tag=etag)
  if exp.env is not None:
    returns, info = exp.env.take(etag, samples)
    return agreed({**eval_scores(np.asarray(returns).reshape(-1, k)), **{f"eval/{n}": v for n, v in info.items()}})
  per_sample = [m for m in meta for _ in range(k)]  # samples are prompt-major, k each
  main = finish_scores(exp, per_sample, samples, [submit_scores(exp, per_sample, samples)], main_only=True)[1]
  return agreed(eval_scores(np.asarray(main).reshape(-1, k)))


def eval_scores(scores_PK: np.ndarray) -> dict:
  """eval/accuracy: the mean of every sample's score; with k > 1 samples a prompt also eval/pass@k: the mean over
  prompts of each one's best score (pass@k, the fraction with a solved sample, where scores are 0 or 1)."""
  out = {EVAL_ACCURACY: float(np.mean(scores_PK))}
  if scores_PK.shape[1] > 1:
    out[eval_pass_at(scores_PK.shape[1])] = float(np.mean(np.max(scores_PK, axis=1)))
  return out
