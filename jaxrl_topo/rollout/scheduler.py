"""The continuous-batching loop of `RolloutEngine.run`: admission waves, chunk pipelining, retirement.

One iteration: land a pending weight update (under its policy), admit queued groups into free slots
(host bookkeeping only), reserve pages for the next chunk (preempting the youngest sequences when
the pool runs out), dispatch the next chunk (the admission wave's prefills and any host changes go
out with it), and only then read back and process the PREVIOUS chunk's tokens. So the device decodes
chunk k+1 while the host appends chunk k's tokens, checks stop strings and refills slots, and each
chunk costs one blocking read. The price: a sequence that ends in chunk k is seen ending one chunk
late, so its slot idles (no attention work) through chunk k+1, and an update requested after chunk k
lands before chunk k+2. With EngineConfig.overlap=False a chunk is read at once (no lag).
Tokens keep the gen_id of the weights the chunk (or prefill) was dispatched under.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxrl_topo.rollout.kv_pool import OutOfPages

if TYPE_CHECKING:
  from jaxrl_topo.rollout.engine import RolloutEngine


@dataclasses.dataclass(frozen=True)
class Request:
  prompt_ids: Sequence[int]
  n: int = 1  # samples (a GRPO group shares the prompt's pages)
  max_new_tokens: int = 64
  stop_ids: tuple[int, ...] = ()  # extra stop tokens besides the engine's eos_ids
  stop_strings: tuple[str, ...] = ()  # stop once the completion's text contains one (needs detokenize)


@dataclasses.dataclass
class Sample:
  request: int
  index: int  # which of the request's n samples
  tokens: list[int]
  logprobs: list[float]
  gen_ids: list[int]
  finish_reason: str = ""  # "stop" | "length"


def run_loop(eng: RolloutEngine, requests: Sequence[Request], on_chunk) -> list[Sample]:
  loop = _Loop(eng, requests)
  overlap = eng.ecfg.overlap
  lookahead = eng.ecfg.decode_chunk * (2 if overlap else 1)  # writes of the unread chunk + the next one
  inflight = None
  while loop.queue or loop.live or inflight is not None:
    if eng._pending is not None and (eng._pending.policy != "finish_on_old" or not loop.live):
      loop.land_update()
    if eng._pending is None:  # finish_on_old: admit nothing until the old weights are done
      loop.fill(lookahead)
      eng._flush()  # the wave's prefills, before reserve() may preempt (free) one of its slots
    dispatched = None
    if loop.live:
      loop.reserve(lookahead)
      if loop.live:
        dispatched = eng._dispatch()
    if not overlap and dispatched is not None:
      inflight, dispatched = dispatched, None
    if inflight is not None:
      loop.collect(eng._read(inflight)[0])
      if on_chunk is not None:
        on_chunk(eng)
    inflight = dispatched
  if eng._pending is not None:
    eng._swap()
  return [loop.out[(r, i)] for r, req in enumerate(requests) for i in range(req.n)]


class _Loop:
  """The state of one `run`: queue of groups to admit, live slots, samples so far."""

  def __init__(self, engine: RolloutEngine, requests: Sequence[Request]):
    self.engine, self.requests = engine, requests
    self.base = np.cumsum([0] + [req.n for req in requests])  # sequence id = base[r] + sample index
    self.out = {(r, i): Sample(r, i, [], [], []) for r, req in enumerate(requests) for i in range(req.n)}
    # (request, samples, resume): resume = continue out[(r, i)] from its tokens so far (one sample)
    self.queue = collections.deque((r, list(range(req.n)), False) for r, req in enumerate(requests))
    self.live: dict[int, tuple[int, int]] = {}  # slot -> (request, sample)

  def fill(self, lookahead: int) -> None:
    """Admits queued groups while slots and pages allow (a whole group at once: one prefill). The
    prefills go out as one wave with the next dispatch."""
    eng = self.engine
    while self.queue:
      r, samples, resume = self.queue[0]
      req = self.requests[r]
      if len(samples) > eng.ecfg.n_slots - len(self.live):
        return
      done = self.out[(r, samples[0])].tokens if resume else []
      try:
        slots = eng._admit_group(list(req.prompt_ids) + done, [int(self.base[r]) + i for i in samples],
                                 max_new_tokens=req.max_new_tokens - len(done), stop_ids=req.stop_ids,
                                 lookahead=lookahead)
      except OutOfPages:
        if not self.live:
          raise RuntimeError(f"request {r} does not fit the empty pool") from None
        return
      self.queue.popleft()
      eng.stats["resumed"] += resume
      for slot, i in zip(slots, samples, strict=True):
        sample = self.out[(r, i)]
        if not resume:
          sample.tokens, sample.logprobs, sample.gen_ids = [], [], []
        self.live[slot] = (r, i)

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
    cut = _stop_string_end(sample.tokens, start, req.stop_strings, eng.detokenize) if req.stop_strings else None
    if cut is not None:
      del sample.tokens[cut:], sample.logprobs[cut:], sample.gen_ids[cut:]
      sample.finish_reason = "stop"
    elif not eng.host.active_B[slot]:
      last = sample.tokens[-1]
      sample.finish_reason = "stop" if last in eng.ecfg.eos_ids or last in req.stop_ids else "length"
    else:
      return
    del self.live[slot]
    eng.free(slot)
    eng.stats["finished"] += 1

  def reserve(self, lookahead: int) -> None:
    """Pages for the next chunk's writes; out of pages -> preempt the youngest and requeue them."""
    eng = self.engine
    for slot in list(self.live):
      while slot in self.live:
        try:
          eng.pool.ensure_capacity(slot, int(min(lookahead, eng.host.left_B[slot])))
          break
        except OutOfPages as err:
          seq_to_slot = {eng.pool.seq_id(s): s for s in self.live}
          for seq in eng.pool.preempt_youngest(err.needed):
            victim = seq_to_slot[seq]
            r, i = self.live.pop(victim)
            eng._released(victim)
            self.queue.appendleft((r, [i], False))  # recomputed from scratch later: same keys, same tokens
            eng.stats["preemptions"] += 1

  def land_update(self) -> None:
    """Applies pending weights; under abort_and_resume every live sequence is requeued to resume."""
    eng = self.engine
    if eng._pending.policy == "abort_and_resume":
      for slot, (r, i) in sorted(self.live.items(), reverse=True):
        eng.free(slot)
        self.queue.appendleft((r, [i], True))
        eng.stats["aborted"] += 1
      self.live.clear()
    eng._swap()


def _stop_string_end(tokens: list[int], start: int, stops: Sequence[str], detokenize) -> int | None:
  """Length of the shortest token prefix (> start) whose text contains a stop string, else None."""
  if not any(s in detokenize(tokens) for s in stops):
    return None
  for n in range(start + 1, len(tokens) + 1):
    text = detokenize(tokens[:n])
    if any(s in text for s in stops):
      return n
  return len(tokens)  # the stop string straddles `start` (it cannot: it was checked then); be safe
