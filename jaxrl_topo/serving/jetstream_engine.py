"""JetStream's `engine_api.Engine` over the paged rollout engine (issue 16).

JetStream's orchestrator owns request slots [0, max_concurrent_decodes) and drives three calls:
`prefill` (prefill thread), `insert` and `generate` (generate thread). Our KV lives in pages that a
sequence gets when it is admitted, so the adapter maps the calls onto `RolloutEngine`'s own
JetStream-shaped ones, the same device programs the RL loop runs:

  prefill   validates and trims the padded prompt on the host (`Prefix`, no device work: the
            prompt is prefilled into its pages when it is admitted, in the engine's batched prefill)
  insert    frees whatever the JetStream slot held and admits the prompt (`RolloutEngine.insert`:
            prefill + first token), or parks it while a finish-on-old weight swap waits
  generate  reports ONE token per live slot (so JetStream's `max_tokens` cut is exact); the engine
            decodes in chunks of `decode_chunk`, and the adapter runs a chunk only when a live slot
            has no token left to report

`decode_state` is the adapter's `Slots` (host bookkeeping for the engine, which holds the device
state): JetStream threads it through unchanged. Weight swaps (`swap_weights`) may come from any
thread; they land in `generate` under the engine's update policies. Every reported token's weight
version is kept per request (`finished`), so a test or a log can tell which weights made a response.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2

from jaxrl_topo.rollout.engine import UPDATE_POLICIES, RolloutEngine

FINISHED_KEPT = 4096  # rows of `finished` kept: a long-running server must not grow without bound
NO_BOS = -1  # JetStream prepends `bos_id` to token requests; we strip it (token requests are taken as given)
_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # JetStream's pad_tokens


@dataclasses.dataclass(frozen=True)
class Prefix:
  """A prompt ready to admit; `error` says why it cannot be (the request then ends with no tokens)."""
  ids: tuple[int, ...]
  error: str | None = None


@dataclasses.dataclass
class _Request:
  seq_id: int
  prompt: tuple[int, ...]
  slot: int | None = None  # the engine's slot while admitted
  queue: collections.deque = dataclasses.field(default_factory=collections.deque)  # (token, gen_id) to report
  reported: list = dataclasses.field(default_factory=list)
  gen_ids: list = dataclasses.field(default_factory=list)
  done: bool = False  # the engine will produce no more tokens for it


@dataclasses.dataclass
class Slots:
  """The decode state JetStream threads through insert/generate: JetStream slot -> request."""
  by_slot: dict = dataclasses.field(default_factory=dict)
  waiting: collections.deque = dataclasses.field(default_factory=collections.deque)  # (js slot, prefix)


class TextTokenizer(tokenizer_api.Tokenizer):
  """JetStream's tokenizer interface over ours (`models.tokenizer.Tokenizer`, or None: token requests only)."""

  def __init__(self, tokenizer, eos_ids: Sequence[int], pad_id: int, max_prefill_length: int):
    self._tok, self._eos, self._pad, self._max = tokenizer, tuple(eos_ids), pad_id, max_prefill_length

  def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
    if self._tok is None:  # an empty prompt: `prefill` turns it into a request that ends at once, logged
      return np.full((16,), self._pad, np.int32), 0
    ids = self._tok.encode(s, add_special_tokens=True)[-self._max:]
    bucket = next(b for b in _PREFILL_BUCKETS if b >= max(len(ids), 1))
    return np.asarray(list(ids) + [self._pad] * (bucket - len(ids)), np.int32), len(ids)

  def decode(self, token_ids: list[int], **kwargs) -> str:
    return self._tok.decode(token_ids) if self._tok is not None else ""

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def eos_id(self) -> int:
    return self._eos[0] if self._eos else -2

  @property
  def bos_id(self) -> int:
    return NO_BOS

  @property
  def stop_tokens(self) -> set[int]:
    return set(self._eos)


class JetStreamEngine(engine_api.Engine):
  """`engine_api.Engine` over one `RolloutEngine` (interleaved: the same engine prefills and generates).

  `max_new_tokens` caps every request (JetStream's request `max_tokens` cuts what is returned; the
  engine stops a sequence at EOS or at this cap, whichever comes first). `policy` is how a
  `swap_weights` lands: keep_kv / finish_on_old / abort_and_resume (rollout/engine.py)."""

  def __init__(self, engine: RolloutEngine, *, tokenizer=None, max_new_tokens: int = 256,
               policy: str = "finish_on_old"):
    if policy not in UPDATE_POLICIES:
      raise ValueError(f"policy {policy!r}; expected one of {UPDATE_POLICIES}")
    self.engine, self.policy = engine, policy
    e = engine.ecfg
    self.max_new_tokens = max(1, min(max_new_tokens, e.max_len - 1))
    fits = [b for b in _PREFILL_BUCKETS if b <= e.max_len - 1]
    if not fits:
      raise ValueError(f"EngineConfig.max_len={e.max_len}: JetStream needs room for a 16-token prompt bucket")
    self._max_prefill = fits[-1]
    self._tokenizer = TextTokenizer(tokenizer, e.eos_ids, e.pad_id, self._max_prefill)
    self._lock = threading.Lock()
    self._pending: tuple[Any, int] | None = None  # (params, gen_id) waiting to land
    self._next_seq = 0
    self.finished: list[dict] = []  # one row per ended request: prompt, tokens, gen_ids (the newest FINISHED_KEPT)
    devices = list(engine.mesh.devices.flat) if engine.mesh is not None else [jax.devices()[0]]
    self._mesh = engine.mesh if engine.mesh is not None else jax.sharding.Mesh(np.asarray(devices[:1]), ("data",))

  # -- weights ------------------------------------------------------------------------------------

  def swap_weights(self, params, gen_id: int) -> None:
    """New weights (laid out like the engine's), landing at the next `generate` under `policy`."""
    with self._lock:
      newest = self._pending[1] if self._pending else self.engine.gen_id
      if gen_id <= newest:
        raise ValueError(f"gen_id must increase: the server holds {newest}, got {gen_id}")
      self._pending = (params, gen_id)

  def _land(self, state: Slots) -> None:
    with self._lock:
      if self._pending is None:
        return
      if self.policy == "finish_on_old" and any(r.slot is not None and not r.done for r in state.by_slot.values()):
        return  # old sequences still decoding; new prompts wait in `state.waiting`
      (params, gen_id), self._pending = self._pending, None
    self.engine.update_weights(params, gen_id)  # outside the engine's `run`: lands now
    if self.policy == "abort_and_resume":
      for js_slot, r in state.by_slot.items():
        if r.slot is not None and not r.done:  # drop its K/V and unreported tokens, re-prefill what was sent
          self._release(r)
          r.queue.clear()
          self._admit(js_slot, r, r.prompt + tuple(r.reported))

  # -- engine_api.Engine --------------------------------------------------------------------------

  def load_params(self, *args, **kwargs):
    return self.engine.params

  def init_decode_state(self, *args, **kwargs) -> Slots:
    return Slots()

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int) -> Prefix:
    if existing_prefix is not None:
      return Prefix((), "multi-turn prefixes (session_cache) are not supported")
    ids = np.asarray(padded_tokens)[:true_length].tolist()
    if ids and ids[0] == NO_BOS:
      ids = ids[1:]
    if not ids:
      return Prefix((), "empty prompt (a text request to a server without a tokenizer?)")
    bad = [t for t in ids if not 0 <= t < self.engine.cfg.vocab_size]
    if bad:
      return Prefix((), f"token ids outside the vocabulary [0, {self.engine.cfg.vocab_size}): {bad[:5]}")
    return Prefix(tuple(ids))

  def insert(self, prefix: Prefix, decode_state: Slots, slot: int) -> Slots:
    old = decode_state.by_slot.pop(slot, None)
    if old is not None and old.slot is not None:  # JetStream ended it (max_tokens / EOS) while it still decoded
      self._finish(old)
    r = _Request(seq_id=self._next_seq, prompt=prefix.ids)
    self._next_seq += 1
    decode_state.by_slot[slot] = r
    if prefix.error is not None:
      r.done = True
      self._record({"seq_id": r.seq_id, "prompt": [], "tokens": [], "gen_ids": [], "error": prefix.error})
    elif self._pending is not None and self.policy == "finish_on_old":
      decode_state.waiting.append((slot, r))
    else:
      self._admit(slot, r, r.prompt)
    return decode_state

  def generate(self, params, decode_state: Slots) -> tuple[Slots, engine_api.ResultTokens]:
    state = decode_state
    while True:
      self._land(state)
      if self._pending is None:
        while state.waiting:
          js_slot, r = state.waiting.popleft()
          if state.by_slot.get(js_slot) is r:
            self._admit(js_slot, r, r.prompt)
      starving = [r for r in state.by_slot.values() if not r.queue and not r.done]
      if not starving:
        break
      if not any(r.slot is not None and not r.done for r in state.by_slot.values()):
        break  # only parked requests: nothing can decode until the swap lands (it lands above next call)
      self._decode_chunk(state)
    return state, self._report(state)

  def _decode_chunk(self, state: Slots) -> None:
    toks_KB, _, emitted_KB = self.engine.generate()
    gen_id = self.engine.gen_id
    for r in state.by_slot.values():
      if r.slot is None or r.done:
        continue
      r.queue.extend((int(t), gen_id) for t in toks_KB[:, r.slot][emitted_KB[:, r.slot]])
      r.done = not bool(self.engine.host.active_B[r.slot])

  def _report(self, state: Slots) -> engine_api.ResultTokens:
    """One token per live slot: [n_slots, 3] (token, valid, length) as JetStream reads it."""
    n = self.max_concurrent_decodes
    data = np.zeros((n, 3), np.int32)
    for js_slot, r in state.by_slot.items():
      if r.queue:
        tok, gen_id = r.queue.popleft()
        r.reported.append(tok)
        r.gen_ids.append(gen_id)
        data[js_slot] = (tok, 1, len(r.reported))
      else:
        data[js_slot] = (0, 0, len(r.reported))  # invalid: JetStream ends the request here
        if r.done and r.slot is not None:
          self._finish(r)
    return engine_api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                                   samples_per_slot=1)

  def _admit(self, js_slot: int, r: _Request, prompt_ids: tuple[int, ...]) -> None:
    budget = max(1, min(self.max_new_tokens - len(r.reported), self.engine.ecfg.max_len - len(prompt_ids)))
    slot, tok, _ = self.engine.insert(list(prompt_ids), r.seq_id, max_new_tokens=budget)
    r.slot = slot
    r.queue.append((int(tok), self.engine.gen_id))
    r.done = not bool(self.engine.host.active_B[slot])

  def _release(self, r: _Request) -> None:
    if r.slot is not None:
      self.engine.free(r.slot)
      r.slot = None

  def _finish(self, r: _Request) -> None:
    self._release(r)
    self._record({"seq_id": r.seq_id, "prompt": list(r.prompt), "tokens": list(r.reported),
                  "gen_ids": list(r.gen_ids), "error": None})

  def _record(self, row: dict) -> None:
    self.finished.append(row)
    if len(self.finished) > FINISHED_KEPT:  # a list, trimmed in place: readers on other threads never see it fail
      del self.finished[: len(self.finished) - FINISHED_KEPT]

  def get_prefix_destination_sharding(self) -> Any:
    return None  # prefixes are host data; interleaved mode never transfers them

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path="jaxrl_topo")

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> tokenizer_api.Tokenizer:
    return self._tokenizer

  @property
  def max_concurrent_decodes(self) -> int:
    return self.engine.ecfg.n_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None
