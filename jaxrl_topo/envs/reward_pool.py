"""RewardPool: weighted reward functions run in killable worker processes, with a timeout per call.

A reward function is user code: it may raise, hang, crash its process, or return the wrong thing.
None of that may stop a training run. The pool therefore runs the functions in
worker processes and scores every failure with `error_score`, counting it:

  errors:   the function raised, its worker died, or it returned the wrong number of scores or a
            non-finite score.
  timeouts: the call ran past `timeout_s`. Its worker is terminated (SIGTERM, then SIGKILL after a
            grace period), joined and replaced by a fresh one. The pool stays usable.

A function that is simply broken would otherwise score every item `error_score` to the end of the
run: the circuit breaker (`CircuitBreaker`) raises `RewardsFailing` once a function has failed on
more than `max_error_frac` of the items of `max_error_calls` consecutive calls (off by default here;
a run turns it on with `reward.max_error_frac` / `reward.max_error_steps`).

Both counts are in item-scores: a failed call over a chunk of 8 items for one function adds 8.

A batch is cut into chunks of `chunk_size` items (by default, one chunk per worker) and every
(function, chunk) pair is one call. A bad item therefore costs only its own chunk. Calls are
given to idle workers as they free up; each worker resolves every function once, when it starts.

Functions are passed as strings (see `rewards.resolve`), because the workers are started with the
"spawn" method. The parent runs JAX, which is multithreaded, and fork is not safe there. All
names are resolved in the parent first, so a typo fails before any worker starts. The workers
receive the parent's sys.path, and they ignore SIGINT (the parent handles Ctrl-C).

Worker start-up (a fresh interpreter, then numpy and the reward modules) takes under a second.
It is paid once at construction, and again only after a timeout kill or a crash. Spawn imports
the launcher's `__main__` module again in each worker, as multiprocessing always does, so a
launcher must keep its work under `if __name__ == "__main__"`. Workers are daemonic: they die
with the parent, but a reward function cannot start multiprocessing children (subprocess works).

`n_workers=0` runs everything inline in the calling process (`score_inline`). The scores, counts
and chunking are the same, but no timeout can be enforced and a crash takes down the caller. Use
it for tests and small demos.
"""

import dataclasses
import math
import sys
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
from absl import logging

from jaxrl_topo.cli import UserError
from jaxrl_topo.envs import rewards
from jaxrl_topo.envs.reward_worker import Worker, WorkerPool, scores_of


@dataclasses.dataclass(frozen=True)
class RewardResult:
  total_N: np.ndarray  # float32[N]: sum over functions of weight · score
  per_fn: dict[str, np.ndarray]  # function name, as given -> float32[N] unweighted scores (error_score on failure)
  errors: int  # item-scores set to error_score: raised, worker died, wrong length, non-finite
  timeouts: int  # item-scores set to error_score because the call ran past timeout_s
  failed: dict[str, int] = dataclasses.field(default_factory=dict)  # function name -> items it failed on
  why: str = ""  # the last failure's reason


@dataclasses.dataclass(frozen=True)
class _Spec:
  name: str
  weight: float
  fn: rewards.RewardFn


def _resolve_all(fns: Sequence[tuple[str, float]]) -> list[_Spec]:
  specs = []
  for entry in fns:
    if not (isinstance(entry, tuple | list) and len(entry) == 2):
      raise ValueError(f"each reward must be a (name_or_path, weight) pair, got {entry!r}")
    name, weight = entry
    if not (isinstance(weight, int | float) and math.isfinite(weight)):
      raise ValueError(f"reward {name!r}: weight must be a finite number, got {weight!r}")
    specs.append(_Spec(name, float(weight), rewards.resolve(name)))
  names = [s.name for s in specs]
  if len(set(names)) != len(names):
    raise ValueError(f"reward names must be unique (they key RewardResult.per_fn), got {names}")
  return specs


def _batch_size(prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict] | None) -> int:
  n = len(completions)
  if len(prompts) != n or (metadata is not None and len(metadata) != n):
    raise ValueError(f"batch lengths differ: {len(prompts)} prompts, {n} completions, "
                     f"{'-' if metadata is None else len(metadata)} metadata")
  return n


def _chunks(n: int, chunk_size: int) -> list[tuple[int, int]]:
  return [(lo, min(lo + chunk_size, n)) for lo in range(0, n, chunk_size)]


def _vet(out, n: int) -> tuple[np.ndarray | None, str]:
  """`out` as float32[n], or (None, the reason it is unusable)."""
  try:
    scores = np.asarray(scores_of(out), dtype=np.float64)
  except Exception as e:  # not iterable, or items that are not numbers
    return None, f"returned an unusable value ({e})"
  if len(scores) != n:
    return None, f"returned {len(scores)} scores for {n} items"
  if not np.all(np.isfinite(scores)):
    return None, f"returned non-finite scores {scores[~np.isfinite(scores)][:4].tolist()}"
  return scores.astype(np.float32), ""


def _result(specs: Sequence[_Spec], scores_FN: np.ndarray, errors: int, timeouts: int,
            failed: dict[str, int] | None = None, why: str = "") -> RewardResult:
  weights_F = np.asarray([s.weight for s in specs], dtype=np.float64)
  total_N = (weights_F[:, None] * scores_FN.astype(np.float64)).sum(axis=0).astype(np.float32)
  per_fn = {s.name: scores_FN[k].astype(np.float32) for k, s in enumerate(specs)}
  return RewardResult(total_N=total_N, per_fn=per_fn, errors=errors, timeouts=timeouts, failed=dict(failed or {}),
                      why=why)


def _concat(specs: Sequence[_Spec], parts: Sequence[RewardResult]) -> RewardResult:
  """Results of consecutive item ranges as one result over all their items."""
  if len(parts) == 1:
    return parts[0]
  failed: dict[str, int] = {}
  for p in parts:
    for name, bad in p.failed.items():
      failed[name] = failed.get(name, 0) + bad
  cat = lambda xs: np.concatenate(xs) if xs else np.zeros((0,), np.float32)  # noqa: E731
  return RewardResult(total_N=cat([p.total_N for p in parts]),
                      per_fn={s.name: cat([p.per_fn[s.name] for p in parts]) for s in specs},
                      errors=sum(p.errors for p in parts), timeouts=sum(p.timeouts for p in parts), failed=failed,
                      why=next((p.why for p in reversed(parts) if p.why), ""))


class RewardsFailing(UserError):
  """The circuit breaker: a reward function failed on too many items for too many calls in a row."""


@dataclasses.dataclass
class CircuitBreaker:
  """Stops a run whose reward function is broken, instead of training on `error_score` to the end: a
  function that fails (raises, times out, returns garbage) on more than `max_error_frac` of a call's
  items for `max_calls` consecutive calls (one per step, more with dynamic sampling) raises
  `RewardsFailing`. `max_calls=0` turns it off. `what`, `unit` and `calls` name the scorer, its items and its
  calls in the message: a multi-turn run's environment is checked per step's episodes (runtime/rollout_side.py)."""

  max_error_frac: float = 0.5
  max_calls: int = 3
  what: str = "reward"
  unit: str = "items"
  calls: str = "scoring calls"
  streak: dict[str, int] = dataclasses.field(default_factory=dict)

  def check(self, result: RewardResult, n: int) -> None:
    self.count(result.failed, n, result.why)

  def count(self, failed: dict[str, int], n: int, why: str = "") -> None:
    """One call's failures: {scorer name: items it failed on} of `n` items."""
    if not self.max_calls or not n:
      return
    for name, bad in failed.items():
      self.streak[name] = self.streak.get(name, 0) + 1 if bad > self.max_error_frac * n else 0
      if self.streak[name] >= self.max_calls:
        raise RewardsFailing(
            f"{self.what} {name!r} failed on {bad} of {n} {self.unit} in each of the last {self.streak[name]} "
            f"{self.calls} (reward.max_error_frac={self.max_error_frac}, reward.max_error_steps={self.max_calls}); "
            f"last failure: {why or 'see the warnings above'}. Stopped; the checkpoints saved so far are kept.")
    for name in set(self.streak) - set(failed):
      self.streak[name] = 0


def _score_specs(specs, prompts, completions, metadata, error_score: float, chunk_size: int | None) -> RewardResult:
  n = _batch_size(prompts, completions, metadata)
  metadata = [{}] * n if metadata is None else list(metadata)
  scores_FN = np.full((len(specs), n), error_score, dtype=np.float32)
  errors, failed, last = 0, {}, ""
  for k, spec in enumerate(specs):
    for lo, hi in _chunks(n, chunk_size or n):
      try:
        scores, why = _vet(spec.fn(list(prompts[lo:hi]), list(completions[lo:hi]), metadata[lo:hi]), hi - lo)
      except Exception as e:
        scores, why = None, f"raised {type(e).__name__}: {e}"
      if scores is None:
        logging.warning("reward %r %s; items %d:%d scored %s", spec.name, why, lo, hi, error_score)
        errors += hi - lo
        failed[spec.name], last = failed.get(spec.name, 0) + hi - lo, why
      else:
        scores_FN[k, lo:hi] = scores
  return _result(specs, scores_FN, errors, 0, failed, last)


def score_inline(fns: Sequence[tuple[str, float]], prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict] | None = None, *, error_score: float = 0.0,
                 chunk_size: int | None = None) -> RewardResult:
  """`RewardPool.score` in the calling process: same scores and error counts, but no timeouts.

  `chunk_size=None` calls each function once on the whole batch.
  """
  return _score_specs(_resolve_all(fns), prompts, completions, metadata, error_score, chunk_size)


class RewardPool(WorkerPool):
  """Weighted reward functions run in `n_workers` killable processes. See the module docstring."""

  what = "a reward worker"
  start_key = "reward.start_timeout_s"

  def __init__(self, fns: Sequence[tuple[str, float]], *, n_workers: int = 2, timeout_s: float = 10.0,
               error_score: float = 0.0, chunk_size: int | None = None, start_timeout_s: float = 60.0,
               max_error_frac: float = 0.5, max_error_calls: int = 0):
    if n_workers < 0 or timeout_s <= 0 or (chunk_size is not None and chunk_size < 1):
      raise ValueError(f"need n_workers >= 0, timeout_s > 0, chunk_size >= 1 or None; got n_workers={n_workers}, "
                       f"timeout_s={timeout_s}, chunk_size={chunk_size}")
    if not math.isfinite(error_score):
      raise ValueError(f"error_score must be finite, got {error_score}")
    if not 0 <= max_error_frac <= 1 or max_error_calls < 0:
      raise ValueError(f"need 0 <= max_error_frac <= 1 and max_error_calls >= 0; got {max_error_frac}, "
                       f"{max_error_calls}")
    self.breaker = CircuitBreaker(max_error_frac, max_error_calls)
    self._specs = _resolve_all(fns)  # fails here, before any worker starts
    self.n_workers, self.timeout_s, self.error_score, self.chunk_size = n_workers, timeout_s, error_score, chunk_size
    self._closed = False
    self._next_ticket = 0
    self._todo: deque = deque()  # calls (ticket, function index, lo, hi) not handed to a worker yet
    self._jobs: dict[int, tuple] = {}  # ticket -> (n, prompts, completions, metadata, its calls)
    # finished calls: (ticket, function index, lo, hi) -> (scores, "error", "") on success, or (None, "error" |
    # "timeout", why) on failure (_finished)
    self._outcomes: dict = {}
    self._inline: dict[int, RewardResult] = {}  # tickets scored at submit (no workers)
    self._start_workers(n_workers, start_timeout_s)

  @property
  def worker_pids(self) -> list[int]:
    return [w.proc.pid for w in self._workers]

  def _new_worker(self) -> Worker:
    return Worker(self._ctx, list(sys.path), [s.name for s in self._specs], self._start_timeout_s)

  def _finished(self, call, kind: str, payload) -> None:
    _, _, lo, hi = call
    scores, why = _vet(payload, hi - lo) if kind == "ok" else (None, payload)
    self._outcomes[call] = (scores, "timeout" if kind == "timeout" else "error", why)

  def score(self, prompts: Sequence[str], completions: Sequence[str],
            metadata: Sequence[dict] | None = None) -> RewardResult:
    """Scores a batch with every function; failures get `error_score` and are counted, and raise
    `RewardsFailing` only through the circuit breaker (`self.breaker`)."""
    return self.collect([self.submit(prompts, completions, metadata)])

  def submit(self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict] | None = None) -> int:
    """Starts scoring a batch in the background (inline pools score it now); returns its ticket for
    `collect`. Calls go to idle workers now and whenever `poll` or `collect` runs."""
    if self._closed:
      raise RuntimeError("RewardPool is closed")
    n = _batch_size(prompts, completions, metadata)
    ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
    if not self._workers:
      self._inline[ticket] = _score_specs(self._specs, prompts, completions, metadata, self.error_score,
                                          self.chunk_size)
      return ticket
    metadata = [{}] * n if metadata is None else list(metadata)
    chunk = self.chunk_size or max(1, -(-n // self.n_workers))
    calls = [(ticket, k, lo, hi) for k in range(len(self._specs)) for lo, hi in _chunks(n, chunk)]
    self._jobs[ticket] = (n, list(prompts), list(completions), metadata, calls)
    self._todo.extend(calls)
    self.poll()
    return ticket

  def poll(self) -> None:
    """Hands queued calls to idle workers and takes in every finished one; never blocks."""
    self._pump(timeout=0.0)

  def _pump(self, timeout: float | None) -> None:
    try:
      self._dispatch()
      if any(w.call is not None or not w.ready for w in self._workers):
        self._wait(timeout)
        self._dispatch()
    except BaseException:  # e.g. Ctrl-C mid-call: workers hold stale calls, so the pool cannot go on
      self.close()
      raise

  def _dispatch(self) -> None:
    for w in self._workers:
      while self._todo and w.ready and w.call is None:
        call = self._todo.popleft()
        _, prompts, completions, metadata, _ = self._jobs[call[0]]
        lo, hi = call[2], call[3]
        try:
          w.conn.send((call[1], prompts[lo:hi], completions[lo:hi], metadata[lo:hi]))
        except OSError:  # the idle worker died (killed from outside): retry the call on a fresh one
          self._todo.appendleft(call)
          self._replace(w)
          break
        w.call, w.deadline = call, time.monotonic() + self.timeout_s

  def collect(self, tickets: Sequence[int]) -> RewardResult:
    """Waits for the tickets' batches; returns their results concatenated in ticket order, counted
    once by the circuit breaker (one scoring call, however many tickets it was submitted as)."""
    if self._closed:
      raise RuntimeError("RewardPool is closed")
    parts = []
    for t in tickets:
      if t in self._inline:
        parts.append(self._inline.pop(t))
        continue
      calls = self._jobs[t][4]
      while not all(c in self._outcomes for c in calls):
        self._pump(timeout=None)
      n = self._jobs.pop(t)[0]
      parts.append(self._assemble({c[1:]: self._outcomes.pop(c) for c in calls}, n))
    result = _concat(self._specs, parts)
    self.breaker.check(result, len(result.total_N))
    return result

  def _assemble(self, outcomes: dict, n: int) -> RewardResult:
    """One batch's result from its calls' outcomes, (function index, lo, hi) -> (scores, kind, why)."""
    scores_FN = np.full((len(self._specs), n), self.error_score, dtype=np.float32)
    counts, failed, last = {"error": 0, "timeout": 0}, {}, ""
    for (k, lo, hi), (scores, kind, why) in outcomes.items():
      if scores is None:
        logging.warning("reward %r %s; items %d:%d scored %s", self._specs[k].name, why, lo, hi, self.error_score)
        counts[kind] += hi - lo
        name = self._specs[k].name
        failed[name], last = failed.get(name, 0) + hi - lo, why
      else:
        scores_FN[k, lo:hi] = scores
    return _result(self._specs, scores_FN, counts["error"], counts["timeout"], failed, last)

  def close(self) -> None:
    """Stops and joins every worker. Idempotent."""
    self._closed = True
    super().close()

  def __enter__(self) -> "RewardPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
