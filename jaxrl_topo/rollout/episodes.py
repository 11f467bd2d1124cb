"""Multi-turn episodes in the rollout engine: token in, token out.

A request with `max_turns > 0` is an episode. Each model turn ends like a completion (EOS, a stop id,
a stop string); the slot is then parked (pages kept, no decoding) and the stream's `turns` handler
is given the sample. The handler (envs/turns.py EnvTurns runs environments in the worker pool) answers,
possibly much later, with tokens to append (the environment's reply with the chat template's role
markers, tokenized once) or with None and a finish reason. The sampled tokens are never re-tokenized:
the sample's ids are exactly those sampled and appended, in order.

A reply continues the episode in its own slot: the turn's last sampled token and the appended tokens
go out as a one-row prefill at their positions, attending to the pages already written (no re-prefill
of the history), and the next turn's first token is sampled there. Appended tokens carry log-prob 0,
loss mask 0 and the gen_id of the weights that wrote their K/V. Limits: `max_turns` model turns
(finish_reason "turns" when the environment wanted more) and `max_new_tokens` tokens after the prompt,
model's and environment's together ("length"). An episode preempted or aborted (abort_and_resume)
resumes from its tokens so far: prompt and history are prefilled again, and since every sampling key
is (seed, sequence id, position) the continuation is the one it would have been. An episode waiting for
its environment is not live: a finish_on_old update does not wait for it, and its next turn continues
on the K/V cached under the old weights (as keep_kv; abort_and_resume re-prefills it instead).

The handler protocol (duck-typed):
  submit(key, sample, turn_start)  key = (batch tag, request index in the batch, sample index); the
                                   turn's tokens are sample.tokens[turn_start:]; must not block
  poll(block) -> [(key, tokens | None, finish reason)]  replies that are ready; with block=True, at
                                   least one (the stream has nothing else to do)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxrl_topo.rollout import host_state
from jaxrl_topo.rollout.kv_pool import OutOfPages

if TYPE_CHECKING:
  from jaxrl_topo.rollout.engine import RolloutEngine
  from jaxrl_topo.rollout.scheduler import _Loop


def reply(loop: _Loop, r: int, i: int, tokens: Sequence[int] | None, reason: str) -> None:
  """The environment's answer to sample i of request r (global index): its next turn, or its end."""
  eng = loop.engine
  slot = loop.waiting.pop((r, i))
  req, sample = loop.requests[r], loop.out[(r, i)]
  if tokens is not None and sample.turns >= req.max_turns:
    tokens, reason = None, "turns"
  elif tokens is not None and len(sample.tokens) + len(tokens) >= req.max_new_tokens:
    tokens, reason = None, "length"  # no room for the reply and one more model token
  if tokens is None:
    sample.finish_reason = reason
    if slot is not None:
      eng.free(slot)
    loop.finish(r)
    return
  tokens = [int(t) for t in tokens]
  if not tokens or min(tokens) < 0 or max(tokens) >= eng.cfg.vocab_size:
    raise ValueError(f"episode reply for request {r} sample {i}: needs token ids in [0, {eng.cfg.vocab_size})")
  start = len(req.prompt_ids) + len(sample.tokens) - 1  # the turn's last token: sampled, not yet in the pages
  feed = [sample.tokens[-1], *tokens]
  sample.tokens += tokens
  sample.logprobs += [0.0] * len(tokens)
  sample.gen_ids += [eng.gen_id] * len(tokens)
  sample.loss_mask += [0] * len(tokens)
  loop.turn_start[(r, i)] = len(sample.tokens)
  left = req.max_new_tokens - len(sample.tokens)
  if slot is not None:
    try:
      extend(eng, slot, feed, start, max_new_tokens=left, stop_ids=req.stop_ids, lookahead=eng.ecfg.decode_chunk)
      loop.live[slot] = (r, i)
      return
    except OutOfPages:
      eng.free(slot)
  loop.queue.appendleft((r, [i], True))  # resumes: prompt and history prefilled again
  eng.stats["resumed_episodes"] += 1


def extend(eng: RolloutEngine, slot: int, feed_ids: Sequence[int], start: int, *, max_new_tokens: int,
           stop_ids: Sequence[int] = (), lookahead: int = 0) -> None:
  """An episode's next turn in a parked slot (its pages hold positions < start): `feed_ids` (the last
  sampled token, then the appended ones) go out with the next flush as a one-row wave at positions
  start.., attending to the pages already written (no re-prefill), and its first token is sampled with
  the key of its position, as a recompute of the whole sequence would. OutOfPages: the slot is unchanged."""
  eng.pool.rewind(slot, start)
  eng.pool.ensure_capacity(slot, len(feed_ids) + min(lookahead, max_new_tokens - 1))
  eng.pool.advance(slot, len(feed_ids))
  h = eng.host
  eng._park(slot)
  eng._rows.pop(slot, None)  # the prefill sets the whole row
  h.pos_B[slot], h.left_B[slot], h.active_B[slot] = start + len(feed_ids), max_new_tokens - 1, max_new_tokens > 1
  h.stop_BX[slot] = -1
  h.stop_BX[slot, : len(stop_ids)] = stop_ids
  eng._waves.append(host_state._Wave(list(feed_ids), [slot], [int(h.seq_B[slot])], max_new_tokens, tuple(stop_ids), [],
                                    eng.pool.table()[slot], [], start))
  eng.stats["extensions"] += 1
