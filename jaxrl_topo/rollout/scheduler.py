"""The continuous-batching loop of `RolloutEngine.run`: admission waves, chunk pipelining, retirement.

One iteration: land a pending weight update (under its policy), admit queued groups into free slots,
send the admission wave's prefills (the next chunk's pages reserved first when they fit without
preempting, so the prefill carries the page table that chunk reads), reserve pages for the next chunk
(preempting the youngest sequences when the pool runs out), dispatch the next chunk (any other host
changes go out with it; no chunk when the unread one ends every live row), and only then read back and
process the PREVIOUS chunk's tokens. So the device decodes
chunk k+1 while the host appends chunk k's tokens, checks stop strings and refills slots, and each
chunk costs one blocking read. The price: a sequence that ends in chunk k is seen ending one chunk
late, so its slot idles (no attention work) through chunk k+1, and an update requested after chunk k
lands before chunk k+2. With EngineConfig.overlap=False a chunk is read at once (no lag).
Tokens keep the gen_id of the weights the chunk (or prefill) was dispatched under.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxrl_topo.rollout.kv_pool import OutOfPages
from jaxrl_topo.rollout.requests import Request, Sample, stop_string_end

if TYPE_CHECKING:
  from jaxrl_topo.rollout.engine import RolloutEngine


class _Loop:
  """The state of one `run`: queue of groups to admit, live slots, samples so far."""

  def __init__(self, engine: RolloutEngine, on_finished=lambda r: None, on_turn=None):
    self.engine, self.on_finished, self.on_turn = engine, on_finished, on_turn
    # episodes (episodes.py): (request, sample) -> its parked slot, or None once preempted while waiting
    self.waiting: dict[tuple[int, int], int | None] = {}
    self.turn_start: dict[tuple[int, int], int] = {}  # (request, sample) -> index of its turn's first token
    self.requests: list[Request | None] = []  # None once its batch is returned
    self.base: list[int] = []  # sequence id of request r's sample i = base[r] + i
    self.left: list[int] = []  # samples of request r not finished yet
    self.out: dict[tuple[int, int], Sample] = {}
    # (request, samples, resume): resume = continue out[(r, i)] from its tokens so far (one sample)
    self.queue: collections.deque = collections.deque()
    self.live: dict[int, tuple[int, int]] = {}  # slot -> (request, sample)
    # A group admitted with fewer free slots than samples: its prompt stays pinned and the rest start
    # (first token sampled at the prefill) as slots free up. request -> (pin id, samples waiting)
    self.pinned: dict[int, tuple[int, collections.deque]] = {}

  def extend(self, requests: Sequence[Request], seq_base: int) -> int:
    """Appends and queues requests (sequence ids from seq_base on); returns the first one's index."""
    first = len(self.requests)
    for req in requests:
      r = len(self.requests)
      self.requests.append(req)
      self.base.append(seq_base)
      self.left.append(req.n)
      seq_base += req.n
      self.out.update({(r, i): Sample(r - first, i, [], [], []) for i in range(req.n)})
      self.queue.append((r, list(range(req.n)), False))
    return first

  def fill(self, lookahead: int) -> None:
    """Starts pinned groups' waiting samples, then admits queued groups while slots and pages allow:
    a group prefills once; with fewer free slots than samples, the rest wait on its pinned prompt.
    The prefills go out as one wave with the next dispatch."""
    eng = self.engine
    fits, held = self._fill_pinned(lookahead)
    if not fits:
      if self.live:
        return
      self.drop_pins()  # nothing live to wait for: prefill those samples afresh
      held = 0
    while self.queue:
      free = eng.pool.max_free_slots() - held  # a group starts in one data shard
      r, samples, resume = self.queue[0]
      req = self.requests[r]
      if free <= 0 or (resume and len(samples) > free):  # held may exceed the free slots
        return
      now, later = samples[:free], samples[free:]
      done = self.out[(r, samples[0])].tokens if resume else []
      try:
        slots, pin = eng._admit_group(list(req.prompt_ids) + done, [int(self.base[r]) + i for i in now],
                                      max_new_tokens=req.max_new_tokens - len(done), stop_ids=req.stop_ids,
                                      lookahead=lookahead, later=[int(self.base[r]) + i for i in later])
      except OutOfPages as err:
        if self.live:
          return  # pages come free as live rows finish
        # Only episodes parked for their environment hold pages: they resume on their reply.
        if any(slot is not None for slot in self.waiting.values()) and self.preempt(err):
          continue
        raise RuntimeError(f"request {r} does not fit the empty pool") from None
      self.queue.popleft()
      eng.stats["resumed"] += resume
      for i in samples:
        if not resume:
          sample = self.out[(r, i)]
          sample.tokens, sample.logprobs, sample.gen_ids, sample.loss_mask, sample.turns = [], [], [], [], 0
          self.turn_start[(r, i)] = 0
      for slot, i in zip(slots, now, strict=True):
        self.live[slot] = (r, i)
      if later:
        self.pinned[r] = (pin, collections.deque(later))
        eng.stats["pinned_groups"] += 1

  def _fill_pinned(self, lookahead: int) -> tuple[bool, int]:
    """Waiting samples of pinned groups into free slots, oldest group first: (False if out of pages,
    samples still waiting for their first token to be read, for whom free slots are held back)."""
    eng = self.engine
    held = 0
    for r in list(self.pinned):
      pin, waiting = self.pinned[r]
      req = self.requests[r]
      while waiting and eng.pool.n_free_slots(eng.pool.pin_shard(pin)):
        sid = int(self.base[r]) + waiting[0]
        if (sid, pin) not in eng.first_of:  # sampled by a prefill whose results are not read yet
          held += len(waiting)
          break
        try:
          slot = eng.fork_pinned(pin, sid, len(req.prompt_ids), max_new_tokens=req.max_new_tokens,
                                 stop_ids=req.stop_ids, lookahead=lookahead)
        except OutOfPages:
          return False, held
        self.live[slot] = (r, waiting.popleft())
        tok, lp, gen_id = eng.first_of.pop((sid, pin))
        self._append(slot, [tok], [lp], [gen_id])
      if not waiting:
        del self.pinned[r]
        eng.pool.unpin(pin)
    return True, held

  def drop_pins(self) -> None:
    """Releases every pin; its waiting samples go back to the queue (prefilled afresh later)."""
    eng = self.engine
    for r, (pin, waiting) in sorted(self.pinned.items(), reverse=True):
      eng.pool.unpin(pin)
      for i in waiting:
        eng.first_of.pop((int(self.base[r]) + i, pin), None)
      self.queue.appendleft((r, list(waiting), False))
    self.pinned.clear()

  def collect(self, new: dict[int, tuple[list[int], list[float], list[int]]]) -> None:
    for slot, (toks, lps, gids) in new.items():
      if slot in self.live:
        self._append(slot, toks, lps, gids)

  def _append(self, slot: int, tokens: list[int], logprobs: list[float], gen_ids: list[int]) -> None:
    """Adds a slot's new tokens; retires it on device stop, length, or a stop string."""
    eng = self.engine
    r, i = self.live[slot]
    req, sample = self.requests[r], self.out[(r, i)]
    start = len(sample.tokens)
    sample.tokens += tokens
    sample.logprobs += logprobs
    sample.gen_ids += gen_ids
    sample.loss_mask += [1] * len(tokens)
    t0 = self.turn_start.get((r, i), 0)  # stop strings are looked for in this turn's text only
    cut = stop_string_end(sample.tokens[t0:], start - t0, req.stop_strings, eng.detokenize) if req.stop_strings \
        else None
    if cut is not None:
      cut += t0
      del sample.tokens[cut:], sample.logprobs[cut:], sample.gen_ids[cut:], sample.loss_mask[cut:]
      sample.finish_reason = "stop"
    elif not eng.host.active_B[slot]:
      last = sample.tokens[-1]
      sample.finish_reason = "stop" if last in eng.ecfg.eos_ids or last in req.stop_ids else "length"
    else:
      return
    del self.live[slot]
    if req.max_turns and sample.finish_reason == "stop":  # an episode's turn: its environment answers next
      sample.turns += 1
      eng._park(slot)
      self.waiting[(r, i)] = slot
      self.on_turn(r, i, t0)
      return
    eng.free(slot)
    self.finish(r)

  def finish(self, r: int) -> None:
    self.engine.stats["finished"] += 1
    self.left[r] -= 1
    if not self.left[r]:
      self.on_finished(r)

  def needs(self, lookahead: int) -> dict[int, int]:
    """{live slot: tokens its next `lookahead` steps write}: no more than it has left."""
    return dict(zip(*(a.tolist() for a in self._needs_N(lookahead)), strict=True))

  def _needs_N(self, lookahead: int) -> tuple[np.ndarray, np.ndarray]:
    """`needs` as arrays: (live slots, tokens each writes)."""
    slots_N = np.fromiter(self.live, np.int64, len(self.live))
    return slots_N, np.minimum(lookahead, self.engine.host.left_B[slots_N])

  def reserve(self, lookahead: int) -> None:
    """Pages for the next chunk's writes; out of pages -> preempt the youngest and requeue them."""
    eng = self.engine
    slots_N, need_N = self._needs_N(lookahead)
    short_N = eng.pool.shortfall(slots_N, need_N) > 0  # the others have their pages (and nobody takes them)
    for slot, need in zip(slots_N[short_N].tolist(), need_N[short_N].tolist(), strict=True):
      while slot in self.live:
        try:
          eng.pool.ensure_capacity(slot, need)
          break
        except OutOfPages as err:
          if self.pinned:  # pinned prompts go first: their samples can be prefilled again
            self.drop_pins()
            continue
          self.preempt(err)

  def preempt(self, err: OutOfPages) -> int:
    """Frees the youngest sequences of err's data shard until its `needed` pages are free (how many it freed);
    live ones are requeued, parked episodes resume when their environment replies."""
    eng = self.engine
    seq_to_slot = {eng.pool.seq_id(s): s for s in self.live}
    parked = {eng.pool.seq_id(s): key for key, s in self.waiting.items() if s is not None}
    freed = eng.pool.preempt_youngest(err.needed, err.shard)
    for seq in freed:
      eng.stats["preemptions"] += 1
      if seq in parked:  # an episode waiting for its environment: it resumes when the reply comes
        eng._released(self.waiting[parked[seq]])
        self.waiting[parked[seq]] = None
        continue
      victim = seq_to_slot[seq]
      r, i = self.live.pop(victim)
      eng._released(victim)
      # recomputed later: same keys, same tokens (an episode resumes from its tokens so far, whose
      # environment turns must not run again)
      self.queue.appendleft((r, [i], bool(self.requests[r].max_turns)))
    return len(freed)

  def land_update(self) -> None:
    """Applies pending weights; under abort_and_resume every live sequence is requeued to resume."""
    eng = self.engine
    self.drop_pins()  # samples waiting on a pinned prompt start under the new weights
    if eng._pending.policy == "abort_and_resume":
      for slot, (r, i) in sorted(self.live.items(), reverse=True):
        eng.free(slot)
        self.queue.appendleft((r, [i], True))
        eng.stats["aborted"] += 1
      self.live.clear()
      for key, slot in self.waiting.items():  # waiting episodes re-prefill when their reply comes
        if slot is not None:
          eng.free(slot)
          self.waiting[key] = None
          eng.stats["aborted"] += 1
    eng._swap()

