"""The rollout engine: paged KV cache, continuous batching, GRPO prefix sharing, in-jit sampling.

Device side: pure jitted functions over a `DecodeState` (the paged pool plus per-slot arrays),
donated on every call, in the shape of JetStream's engine API:
  prefill   writes one prompt's K/V straight into its pages; returns the last position's logits
  insert    samples a slot's first token from those logits and makes the slot live
  generate  K decode steps inside one jit: returns [K, slots] tokens, log-probs, emitted mask
  free      (host) returns the slot's pages; its table row becomes -1 so its writes are dropped
Host side: a `PagePool` (kv_pool.py) owns page tables, refcounts and preemption. `run(requests)`
is the continuous-batching loop: it fills free slots (one prefill per GRPO group, then forks that
share the prompt's full pages), decodes in chunks of K, retires finished sequences (EOS / stop
ids / length) and refills. When pages run out the youngest sequences are preempted, requeued and
later recomputed from scratch; since every sample's keys come from (seed, sequence id, position),
a recomputed sequence is identical to the one it replaces.
Every emitted token carries the gen_id of the weights it was sampled under.
Shapes are static per engine (slots, pages, chunk K, prompt buckets): steady state compiles nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.rollout.dense import bucket_length
from jaxrl_topo.rollout.kv_pool import OutOfPages, PagePool
from jaxrl_topo.rollout.paged import PagedKVCache
from jaxrl_topo.rollout.sampling import SamplingConfig, sample_tokens, sequence_keys


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  n_slots: int = 8  # decode rows
  page_size: int = 16
  n_pages: int = 256  # pages per layer in the pool
  max_len: int = 512  # prompt + completion tokens per sequence
  decode_chunk: int = 8  # decode steps per generate() call (K)
  min_bucket: int = 16  # prompts are padded to a power of two >= this
  impl: str = "fast"  # paged attention read path
  sampling: SamplingConfig = SamplingConfig(greedy=True)
  eos_ids: tuple[int, ...] = ()
  pad_id: int = 0

  def __post_init__(self):
    for name in ("n_slots", "page_size", "n_pages", "max_len", "decode_chunk", "min_bucket"):
      if getattr(self, name) <= 0:
        raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be positive")

  @property
  def max_pages_per_seq(self) -> int:
    return -(-self.max_len // self.page_size)


@dataclasses.dataclass(frozen=True)
class Request:
  prompt_ids: Sequence[int]
  n: int = 1  # samples (a GRPO group shares the prompt's pages)
  max_new_tokens: int = 64
  stop_ids: tuple[int, ...] = ()  # extra stop tokens besides the engine's eos_ids


@dataclasses.dataclass
class Sample:
  request: int
  index: int  # which of the request's n samples
  tokens: list[int]
  logprobs: list[float]
  gen_ids: list[int]
  finish_reason: str = ""  # "stop" | "length"


@struct.dataclass
class DecodeState:
  cache: PagedKVCache
  last_B: jax.Array  # int32 token to feed next
  pos_B: jax.Array  # int32 its position
  seq_B: jax.Array  # int32 sequence id (sampling keys)
  left_B: jax.Array  # int32 tokens still allowed
  active_B: jax.Array  # bool


# ---------------------------------------------------------------- device functions (pure, donated)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",))
def prefill(graphdef, params, state: DecodeState, tokens_1T, length, table_1M):
  """Writes a prompt's K/V into the pages of `table_1M`; returns (state, logits_V at the last token)."""
  model = nnx.merge(graphdef, params)
  view = state.cache.replace(table_BM=table_1M)
  positions_1T = jnp.arange(tokens_1T.shape[1], dtype=jnp.int32)[None]
  h_1TD, view = model.hidden(tokens_1T, positions_1T, None, view)
  h_11D = jax.lax.dynamic_slice_in_dim(h_1TD, length - 1, 1, axis=1)
  cache = state.cache.replace(k_LPSKH=view.k_LPSKH, v_LPSKH=view.v_LPSKH)
  return state.replace(cache=cache), model.logits(h_11D)[0, 0]


@functools.partial(jax.jit, donate_argnames=("state",))
def copy_pages(state: DecodeState, src_N, dst_N):
  """Copy-on-write of forked partial pages; dst = n_pages (out of range) entries are no-ops."""
  k, v = state.cache.k_LPSKH, state.cache.v_LPSKH
  src = jnp.clip(src_N, 0, k.shape[1] - 1)
  k = k.at[:, dst_N].set(k[:, src], mode="drop")
  v = v.at[:, dst_N].set(v[:, src], mode="drop")
  return state.replace(cache=state.cache.replace(k_LPSKH=k, v_LPSKH=v))


@functools.partial(jax.jit, static_argnames=("sampling",))
def sample_first(logits_V, key, seq_ids_G, length, *, sampling: SamplingConfig):
  """First tokens of a group's samples from the shared prompt logits, each with its own key."""
  G = seq_ids_G.shape[0]
  keys = sequence_keys(key, seq_ids_G, jnp.full((G,), length, jnp.int32))
  return sample_tokens(jnp.broadcast_to(logits_V, (G, logits_V.shape[0])), keys, sampling)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "n_steps", "eos_ids", "pad_id"),
                   donate_argnames=("state",))
def generate(graphdef, params, state: DecodeState, key, stop_BX, *, sampling: SamplingConfig, n_steps: int,
             eos_ids: tuple[int, ...], pad_id: int):
  """K = n_steps decode steps for every active slot: (state, tokens_KB, logprobs_KB, emitted_KB)."""
  model = nnx.merge(graphdef, params)
  eos = jnp.asarray(eos_ids or (-1,), jnp.int32)

  def step(state, _):
    h_B1D, cache = model.hidden(state.last_B[:, None], state.pos_B[:, None], None, state.cache)
    keys = sequence_keys(key, state.seq_B, state.pos_B + 1)
    tok_B, lp_B = sample_tokens(model.logits(h_B1D)[:, 0], keys, sampling)
    emitted = state.active_B
    stop = jnp.isin(tok_B, eos) | jnp.any(tok_B[:, None] == stop_BX, axis=-1)
    left = state.left_B - emitted
    new = state.replace(cache=cache, last_B=jnp.where(emitted, tok_B, state.last_B),
                        pos_B=state.pos_B + emitted, left_B=left, active_B=emitted & ~stop & (left > 0))
    return new, (jnp.where(emitted, tok_B, pad_id), jnp.where(emitted, lp_B, 0.0), emitted)

  state, (tokens_KB, logprobs_KB, emitted_KB) = jax.lax.scan(step, state, None, length=n_steps)
  return state, tokens_KB, logprobs_KB, emitted_KB


# ---------------------------------------------------------------- host side


_MAX_STOP_IDS = 4  # per-request stop ids beyond eos_ids (static width of the device array)


class RolloutEngine:
  """Continuous-batching generation over a paged KV cache; `run(requests)` is the whole loop."""

  def __init__(self, graphdef, cfg: ModelConfig, params, ecfg: EngineConfig, *, gen_id: int = 0, seed: int = 0):
    self.graphdef, self.cfg, self.ecfg = graphdef, cfg, ecfg
    self.params, self.gen_id = params, gen_id
    self.key = jax.random.key(seed)
    self.pool = PagePool(ecfg.n_pages, ecfg.page_size, ecfg.n_slots, ecfg.max_pages_per_seq)
    B = ecfg.n_slots
    cache = PagedKVCache.zeros(cfg, ecfg.n_pages, ecfg.page_size, ecfg.max_pages_per_seq, B, impl=ecfg.impl)
    zeros = lambda: jnp.zeros((B,), jnp.int32)  # distinct buffers: the state is donated
    self.state = DecodeState(cache=cache, last_B=zeros(), pos_B=zeros(), seq_B=zeros(), left_B=zeros(),
                             active_B=jnp.zeros((B,), bool))
    self.stats = collections.Counter()

  def update_weights(self, params, gen_id: int) -> None:
    """New weights for the next chunk (keep-KV: live sequences continue on their cached K/V)."""
    if gen_id <= self.gen_id:
      raise ValueError(f"gen_id must increase: engine holds {self.gen_id}, got {gen_id}")
    self.params, self.gen_id = params, gen_id

  # -- one group: prefill once, fork the rest --------------------------------------------------

  def _admit(self, req: Request, seq_ids: list[int]) -> list[tuple[int, int, float]]:
    """Prefills the prompt once into a new slot and forks it for the group's other samples:
    (slot, first token, its log-prob) per sample. Raises OutOfPages, nothing changed, if the pool
    cannot hold the whole group now."""
    n_prompt = len(req.prompt_ids)
    slots, copies = [], []
    try:
      slots.append(self.pool.admit(seq_ids[0], n_prompt))
      for sid in seq_ids[1:]:
        slot, copy = self.pool.fork(slots[0], sid)
        slots.append(slot)
        if copy is not None:
          copies.append(copy)
    except OutOfPages:
      for slot in reversed(slots):
        self.pool.free(slot)
      raise
    T = bucket_length(n_prompt, self.ecfg.min_bucket, self.ecfg.max_pages_per_seq * self.ecfg.page_size)
    tokens = np.full((1, T), self.ecfg.pad_id, np.int32)
    tokens[0, :n_prompt] = req.prompt_ids
    table = self.pool.table()[slots[0]][None]
    self.state, logits = prefill(self.graphdef, self.params, self.state, tokens, np.int32(n_prompt), table)
    if copies:
      src = np.full((self.ecfg.n_slots,), 0, np.int32)
      dst = np.full((self.ecfg.n_slots,), self.ecfg.n_pages, np.int32)  # out of range: no-op
      src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
      self.state = copy_pages(self.state, src, dst)
    first, lps = jax.device_get(sample_first(logits, self.key, np.asarray(seq_ids, np.int32), np.int32(n_prompt),
                                             sampling=self.ecfg.sampling))
    self.stats["prefills"] += 1
    self.stats["forks"] += len(slots) - 1
    return list(zip(slots, first.tolist(), lps.tolist(), strict=True))


  # -- the loop ---------------------------------------------------------------------------------

  def _check(self, requests: Sequence[Request]) -> None:
    """Every request must fit the engine; errors name the request, raised before any compilation."""
    e = self.ecfg
    for r, req in enumerate(requests):
      n = len(req.prompt_ids)
      if n == 0 or req.max_new_tokens <= 0 or req.n <= 0:
        raise ValueError(f"request {r}: needs a non-empty prompt, max_new_tokens > 0 and n > 0")
      if n + req.max_new_tokens > e.max_len:
        raise ValueError(f"request {r}: prompt {n} + max_new_tokens {req.max_new_tokens} > max_len {e.max_len}")
      if req.n > e.n_slots:
        raise ValueError(f"request {r}: n={req.n} samples need as many decode slots; the engine has {e.n_slots}")
      group_pages = -(-(n + req.max_new_tokens) // e.page_size) * req.n
      if group_pages > e.n_pages:
        raise ValueError(f"request {r}: its {req.n} samples can need {group_pages} pages; the pool has {e.n_pages}")
      if len(req.stop_ids) > _MAX_STOP_IDS:
        raise ValueError(f"request {r}: at most {_MAX_STOP_IDS} stop ids")
      if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= self.cfg.vocab_size:
        raise ValueError(f"request {r}: token ids must lie in [0, {self.cfg.vocab_size})")

  def run(self, requests: Sequence[Request], on_chunk=None) -> list[Sample]:
    """Generates every request's n samples; returns them request-major. `on_chunk(engine)` runs
    between decode chunks (e.g. to `update_weights`: live sequences then continue on their K/V)."""
    self._check(requests)
    e, B = self.ecfg, self.ecfg.n_slots
    base = np.cumsum([0] + [req.n for req in requests])  # sequence id = base[r] + sample index
    out = {(r, i): Sample(r, i, [], [], []) for r, req in enumerate(requests) for i in range(req.n)}
    queue = collections.deque((r, list(range(req.n))) for r, req in enumerate(requests))
    host = {k: np.zeros((B,), np.int32) for k in ("last_B", "pos_B", "seq_B", "left_B")}
    host["active_B"] = np.zeros((B,), bool)
    stop = np.full((B, _MAX_STOP_IDS), -1, np.int32)
    live: dict[int, tuple[int, int]] = {}  # slot -> (request, sample)
    while queue or live:
      self._fill(requests, queue, live, out, host, stop, base)
      if not live:
        continue
      self._reserve(queue, live, out, host)
      if not live:
        continue
      self.state = self.state.replace(cache=self.state.cache.replace(table_BM=jnp.asarray(self.pool.table())),
                                      **{k: jnp.asarray(v) for k, v in host.items()})
      self.state, toks, lps, emitted = generate(
          self.graphdef, self.params, self.state, self.key, jnp.asarray(stop), sampling=e.sampling,
          n_steps=e.decode_chunk, eos_ids=e.eos_ids, pad_id=e.pad_id)
      toks, lps, emitted, dev = jax.device_get((toks, lps, emitted, {k: getattr(self.state, k) for k in host}))
      host = {k: np.array(v) for k, v in dev.items()}
      self.stats["chunks"] += 1
      for slot, (r, i) in list(live.items()):
        n_new = int(emitted[:, slot].sum())
        sample = out[(r, i)]
        sample.tokens += toks[:n_new, slot].tolist()
        sample.logprobs += lps[:n_new, slot].tolist()
        sample.gen_ids += [self.gen_id] * n_new
        self.pool.advance(slot, n_new)
        if not host["active_B"][slot]:
          self._finish(slot, live, out, requests)
      if on_chunk is not None:
        on_chunk(self)
    return [out[(r, i)] for r, req in enumerate(requests) for i in range(req.n)]

  def _is_stop(self, token: int, req: Request) -> bool:
    return token in self.ecfg.eos_ids or token in req.stop_ids

  def _finish(self, slot: int, live: dict, out: dict, requests) -> None:
    r, i = live.pop(slot)
    sample = out[(r, i)]
    sample.finish_reason = "stop" if self._is_stop(sample.tokens[-1], requests[r]) else "length"
    self.pool.free(slot)

  def _fill(self, requests, queue, live, out, host, stop, base) -> None:
    """Admits queued groups while slots and pages allow (a whole group at once: one prefill)."""
    while queue:
      r, samples = queue[0]
      req = requests[r]
      if len(samples) > self.ecfg.n_slots - len(live):
        return
      try:
        admitted = self._admit(req, [int(base[r]) + i for i in samples])
      except OutOfPages:
        if not live:
          raise RuntimeError(f"request {r} does not fit the empty pool") from None
        return
      queue.popleft()
      for (slot, tok, lp), i in zip(admitted, samples, strict=True):
        out[(r, i)] = Sample(r, i, [tok], [lp], [self.gen_id])
        live[slot] = (r, i)
        host["active_B"][slot] = False
        if self._is_stop(tok, req) or req.max_new_tokens == 1:
          self._finish(slot, live, out, requests)
          continue
        host["last_B"][slot], host["pos_B"][slot], host["seq_B"][slot] = tok, len(req.prompt_ids), base[r] + i
        host["left_B"][slot], host["active_B"][slot] = req.max_new_tokens - 1, True
        stop[slot] = -1
        stop[slot, : len(req.stop_ids)] = req.stop_ids

  def _reserve(self, queue, live, out, host) -> None:
    """Pages for the next chunk's writes; out of pages -> preempt the youngest and requeue them."""
    for slot in list(live):
      while slot in live:
        try:
          self.pool.ensure_capacity(slot, int(min(self.ecfg.decode_chunk, host["left_B"][slot])))
          break
        except OutOfPages as err:
          seq_to_slot = {self.pool.seq_id(s): s for s in live}
          for seq in self.pool.preempt_youngest(err.needed):
            victim = seq_to_slot[seq]
            r, i = live.pop(victim)
            host["active_B"][victim] = False
            out[(r, i)] = Sample(r, i, [], [], [])
            queue.appendleft((r, [i]))  # recomputed from scratch later: same keys, same tokens
            self.stats["preemptions"] += 1
