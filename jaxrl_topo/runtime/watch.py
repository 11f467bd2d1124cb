"""Clocks of the RL loop: when a train step finished on its devices, when rollout tokens were generated,
and the wall-clock rates of the run.

StepWatch   a thread per dispatched train step blocks on the step's outputs and stamps their device
            completion; the controller never polls, so a span ends when the devices finished, not at the
            next host check (the loop's readiness-based landing reads `done`).
ChunkClock  brackets every decode chunk's tokens by host times: a chunk read at tick j was dispatched
            after tick j-2 returned (the engine dispatches chunk j+1 before reading chunk j) and read
            before tick j began, so its tokens were generated inside [exit of tick j-2, entry of tick j].
            `tokens_within(t0, t1)` counts only chunks whose whole bracket lies inside: a lower bound on
            the rollout tokens generated while a train step ran.
WallClock   seconds between consecutive steps' metrics (held-out evaluation excluded), tokens/s and steps/hour.
"""

from __future__ import annotations

import collections
import threading
import time

import jax


class StepWatch:
  """Device-completion stamps (time.perf_counter()) of a step's logprobs phase (`pre`) and outputs."""

  def __init__(self, pre, outputs):
    self.pre_done_at: float | None = None
    self.done_at: float | None = None
    self.error: BaseException | None = None
    self.done = threading.Event()
    threading.Thread(target=self._run, args=(pre, outputs), daemon=True, name="jaxrl-step-watch").start()

  def _run(self, pre, outputs) -> None:
    try:
      if pre is not None:
        jax.block_until_ready(pre)
        self.pre_done_at = time.perf_counter()
      jax.block_until_ready(outputs)
    except BaseException as e:  # re-raised on the controller thread by wait()
      self.error = e
    finally:
      self.done_at = time.perf_counter()
      self.done.set()

  def wait(self) -> None:
    self.done.wait()
    if self.error is not None:
      raise self.error


class ChunkClock:
  """Host-time brackets of decode chunks and the tokens each one brought (engine.stats['tokens'])."""

  def __init__(self, engine):
    self.engine = engine
    self.exits = collections.deque([time.perf_counter()] * 2, maxlen=2)  # the last two ticks' exit times
    self.count = self._tokens()
    self.chunks: collections.deque[tuple[float, float, int]] = collections.deque()  # (lo, hi, tokens)

  def _tokens(self) -> int:
    return int(self.engine.stats.get("tokens", 0))

  def reset(self) -> None:
    """Before a training rollout: its chunks are dispatched after now; tokens generated since the last
    chunk (held-out evaluation) are not counted."""
    self.count = self._tokens()
    self.exits.extend([time.perf_counter()] * 2)

  def chunk(self) -> None:
    """At the entry of a tick (between decode chunks): the chunk just read."""
    now, tokens = time.perf_counter(), self._tokens()
    self.chunks.append((self.exits[0], now, tokens - self.count))
    self.count = tokens

  def resume(self) -> None:
    """At the exit of a tick: the next chunks are dispatched after this."""
    self.exits.append(time.perf_counter())

  def tokens_within(self, t0: float, t1: float) -> int:
    """Tokens of the chunks generated entirely inside [t0, t1]; forgets chunks that ended before t0
    (steps land in dispatch order, so later queries start later)."""
    while self.chunks and self.chunks[0][1] < t0:
      self.chunks.popleft()
    return sum(n for lo, hi, n in self.chunks if lo >= t0 and hi <= t1)


class WallClock:
  """Per step: wall seconds since the previous step's metrics; over the run: rates from the first step's
  end (which includes compilation) to now."""

  def __init__(self):
    self.last = time.perf_counter()
    self.first: float | None = None
    self.excluded = 0.0  # evaluation seconds since `first`
    self.steps = self.tokens = 0

  def step(self, tokens: int) -> dict:
    now = time.perf_counter()
    dt, self.last = max(now - self.last, 1e-9), now
    out = {"time/step_s": dt, "perf/tokens_per_s": tokens / dt, "perf/steps_per_hour": 3600.0 / dt}
    if self.first is None:
      self.first = now
      return out
    self.steps, self.tokens = self.steps + 1, self.tokens + tokens
    elapsed = max(now - self.first - self.excluded, 1e-9)
    out["perf/run_steps_per_hour"] = 3600.0 * self.steps / elapsed
    out["perf/run_tokens_per_s"] = self.tokens / elapsed
    return out

  def exclude(self, seconds: float) -> None:
    """Seconds spent outside the run's steps (held-out evaluation): not counted in the next step's wall time."""
    self.last += seconds
    if self.first is not None:
      self.excluded += seconds
