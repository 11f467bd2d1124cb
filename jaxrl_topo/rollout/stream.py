"""A long-lived generation stream over one rollout engine (`RolloutEngine.stream`): batches of requests added
while others decode, each returned when its samples have finished. It drives the continuous-batching loop of
scheduler.py (`_Loop`); `RolloutEngine.run` is one batch through a stream of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxrl_topo.rollout import episodes
from jaxrl_topo.rollout.requests import Request, Sample, check_requests
from jaxrl_topo.rollout.scheduler import _Loop

if TYPE_CHECKING:
  from jaxrl_topo.rollout.engine import RolloutEngine


class Stream:
  """A long-lived generation stream over one engine: batches of requests are `add`ed while others
  decode, and `run_until(tag)` decodes until every sample of batch `tag` has finished and returns
  them, leaving the other batches' sequences live (and possibly one chunk dispatched, unread) for the
  next call. `RolloutEngine.run` is one batch through a stream of its own; the RL loop keeps one
  open for a whole run, so the next batch's prompts fill slots as the current batch's stragglers free
  them instead of waiting for the batch to drain.

  `on_chunk(engine)` runs after each chunk is read (the RL loop lands weights and adds batches there);
  `on_group(tag, r, samples)` when all n samples of batch `tag`'s request r have finished (the RL loop
  scores them while decoding goes on). Between calls, live sequences hold slots: weight updates land
  under their policy at the next iteration. `close()` needs nothing live.
  """

  def __init__(self, engine: RolloutEngine, on_chunk=None, on_group=None, turns=None):
    self.engine, self.on_chunk, self.on_group, self.turns = engine, on_chunk, on_group, turns
    self.loop = _Loop(engine, self._finished, self._turn_ended)
    self.inflight = None
    self.batches: dict = {}  # tag -> (first request index, count, requests still unfinished)
    self._tag_of: dict[int, object] = {}  # request index -> tag

  def add(self, requests: Sequence[Request], tag, *, seq_base: int = 0) -> None:
    """Queues a batch; sample i of request r gets sequence id seq_base + (samples before r) + i, which
    with the engine's key fixes its sampling keys (so the same ids give the same tokens in any stream)."""
    if tag in self.batches:
      raise ValueError(f"batch {tag!r} is already in the stream")
    check_requests(self.engine, requests)
    if self.turns is None and any(req.max_turns for req in requests):
      raise ValueError("Request.max_turns > 0 asks for an episode, which needs an environment to reply: pass "
                       "turns= (an episodes.py Turns) to run() or stream(); for a plain completion leave max_turns=0")
    first = self.loop.extend(requests, seq_base)
    self.batches[tag] = [first, len(requests), len(requests)]
    for r in range(first, first + len(requests)):
      self._tag_of[r] = tag

  def _finished(self, r: int) -> None:
    tag = self._tag_of[r]
    entry = self.batches[tag]
    entry[2] -= 1
    if self.on_group is not None:
      req = self.loop.requests[r]
      self.on_group(tag, r - entry[0], [self.loop.out[(r, i)] for i in range(req.n)])

  def _turn_ended(self, r: int, i: int, turn_start: int) -> None:
    tag = self._tag_of[r]
    self.turns.submit((tag, r - self.batches[tag][0], i), self.loop.out[(r, i)], turn_start)

  def _replies(self, block: bool) -> None:
    """Environment replies that are ready (all of them, waiting for one when `block`): next turns or ends."""
    replies = self.turns.poll(block)
    if block and not replies:
      raise RuntimeError(f"episodes {sorted(self.loop.waiting)} wait for environment replies that will not come")
    for (tag, r, i), tokens, reason in replies:
      episodes.reply(self.loop, self.batches[tag][0] + r, i, tokens, reason)

  def pending(self, tag) -> bool:
    return self.batches[tag][2] > 0

  def busy(self) -> bool:
    return bool(self.loop.queue or self.loop.live or self.loop.pinned or self.loop.waiting or self.inflight is not None)

  def run_until(self, tag) -> list[Sample]:
    """Decodes until batch `tag` is finished; returns its samples request-major and forgets the batch."""
    while self.pending(tag):
      if not self.busy():
        raise RuntimeError(f"stream: batch {tag!r} unfinished with nothing queued or live")
      self._iterate()
    first, n, _ = self.batches.pop(tag)
    out = []
    for r in range(first, first + n):
      del self._tag_of[r]
      out += [self.loop.out.pop((r, i)) for i in range(self.loop.requests[r].n)]
      self.loop.requests[r] = None  # the stream keeps no finished batch
    return out

  def drain(self) -> None:
    """Decodes until nothing is queued, live or in flight (every batch added so far is finished)."""
    while self.busy():
      self._iterate()

  def _iterate(self) -> None:
    """One iteration: land weights, admit and prefill, reserve, dispatch chunk k+1 (unless chunk k ends every live
    row), then read chunk k."""
    eng, loop = self.engine, self.loop
    if loop.waiting:  # block only when nothing else can move
      self._replies(block=not (loop.live or loop.queue or loop.pinned or self.inflight is not None))
    if eng._pending is not None and (eng._pending.policy != "finish_on_old" or not loop.live):
      loop.land_update()
    # Pages for the unread chunk's writes and the next one's. While requests wait, a chunk ends early
    # at the first slot that frees (the host refills it at once), else after decode_chunk steps; in the
    # tail, long chunks (fewer host round trips; steps past every row's end are skipped).
    unread = self.inflight.steps if self.inflight is not None else 0
    admit = eng._pending is None  # finish_on_old: admit nothing until the old weights are done
    if admit:
      loop.fill(unread + eng.ecfg.decode_chunk)
    n_steps = self._chunk_steps(unread)
    if admit:
      # The wave's prefills, before reserve() may preempt (free) one of its slots. When the next chunk's pages
      # fit without preempting, they are taken first: the prefill then carries the page table that chunk reads,
      # and no patch has to follow it.
      if loop.live and eng.pool.fits(loop.needs(unread + n_steps)):
        loop.reserve(unread + n_steps)
      eng._flush()
    waiting = bool(loop.queue or loop.pinned)
    dispatched = None
    if loop.live and not self._ends_in_flight():
      loop.reserve(unread + n_steps)
      if loop.live:
        dispatched = eng._dispatch(n_steps, exit_on_free=waiting, pack=True, after=self.inflight)
        dispatched.queued = waiting
    if not eng.ecfg.overlap and dispatched is not None:
      self.inflight, dispatched = dispatched, None
    if self.inflight is not None:
      loop.collect(eng._read(self.inflight)[0])
      self.inflight = dispatched
      if self.on_chunk is not None:
        self.on_chunk(eng)
    else:
      self.inflight = dispatched

  def _ends_in_flight(self) -> bool:
    """Whether the unread chunk ends every live row: each was live in it (same sequence in the slot) and reaches
    its token limit within its steps (and its window). A chunk dispatched now would run no step, so none is: at a
    tail that saves a dispatch and a read (at small batch, a large part of a sequence's time). A chunk that can
    end early at a live-row floor > 1 does not count. Where a row ends it early anyway (a stop token, or a stop
    string the host cut), nothing is lost: the row is not live after the read, or the next iteration dispatches."""
    d, eng = self.inflight, self.engine
    if d is None or d.floored:
      return False
    h, S = eng.host, eng.ecfg.page_size
    return all(eng._epoch_B[s] == d.epoch_B[s] and d.live_B[s] and h.left_B[s] <= d.steps
               and (not d.window or h.pos_B[s] + h.left_B[s] <= d.window * S) for s in self.loop.live)

  def _chunk_steps(self, unread: int) -> int:
    """Steps of the next chunk: tail_chunk, doubled up to max_chunk while the longest live row has that
    many tokens left and every live row's pages for it are free (no preemption), when nobody needs
    chunk boundaries (no on_chunk hook, or one with `needs_boundaries = False`, e.g. a progress bar; no
    episodes, no pending update). Waiting requests still end
    a chunk as soon as slots free (exit_on_free). Fewer, longer chunks: fewer host round trips at
    small batch. The length is traced: every chunk length runs the same program."""
    eng, loop = self.engine, self.loop
    n = eng.ecfg.tail_steps
    hooked = self.on_chunk is not None and getattr(self.on_chunk, "needs_boundaries", True)
    if hooked or self.turns is not None or eng._pending is not None or not loop.live:
      return n
    longest = max(int(eng.host.left_B[s]) for s in loop.live)
    while 2 * n <= eng.ecfg.max_chunk and n < longest and eng.pool.fits(loop.needs(unread + 2 * n)):
      n *= 2
    return n

  def close(self) -> None:
    """Ends the stream: the last dispatched chunk is read, then a pending update lands. Sequences still
    queued or live are an error (their batch was never asked for)."""
    if self.loop.queue or self.loop.live or self.loop.pinned or self.loop.waiting:
      raise RuntimeError(f"stream closed with batches {list(self.batches)} unfinished; run_until or drain first")
    self.drain()
    if self.engine._pending is not None:
      self.engine._swap()
    self.loop.drop_pins()
