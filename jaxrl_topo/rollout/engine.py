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
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.rollout.dense import bucket_length
from jaxrl_topo.rollout.kv_pool import OutOfPages, PagePool
from jaxrl_topo.rollout.paged import PagedKVCache
from jaxrl_topo.rollout.sampling import SamplingConfig, sample_tokens, sequence_keys
from jaxrl_topo.topology.hostcomm import to_host


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
  stop_strings: tuple[str, ...] = ()  # stop once the completion's text contains one (needs detokenize)


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


UPDATE_POLICIES = ("keep_kv", "finish_on_old", "abort_and_resume")


@dataclasses.dataclass
class _SlotMirror:
  """Host copy of the per-slot device arrays; pushed before and pulled after every generate()."""

  last_B: np.ndarray
  pos_B: np.ndarray
  seq_B: np.ndarray
  left_B: np.ndarray
  active_B: np.ndarray
  stop_BX: np.ndarray

  @classmethod
  def zeros(cls, n_slots: int) -> _SlotMirror:
    z = lambda: np.zeros((n_slots,), np.int32)  # noqa: E731
    return cls(z(), z(), z(), z(), np.zeros((n_slots,), bool), np.full((n_slots, _MAX_STOP_IDS), -1, np.int32))


@dataclasses.dataclass
class _Pending:
  params: object
  gen_id: int
  policy: str


class RolloutEngine:
  """Continuous-batching generation over a paged KV cache.

  JetStream-shaped pieces: `insert_group` (prefill once + insert n slots; `insert` is n = 1),
  `generate` (one chunk of K steps), `free`; `run(requests)` is the whole loop over them.
  With `mesh` (axes `data`, `tensor`), slots are split over `data` and the KV pool over KV heads
  on `tensor`; the caller passes params already laid out on that mesh (topology ROLLOUT_RULES).
  `detokenize(ids) -> str` enables per-request stop strings.
  """

  def __init__(self, graphdef, cfg: ModelConfig, params, ecfg: EngineConfig, *, gen_id: int = 0, seed: int = 0,
               mesh: jax.sharding.Mesh | None = None, detokenize: Callable[[Sequence[int]], str] | None = None):
    self.graphdef, self.cfg, self.ecfg = graphdef, cfg, ecfg
    self.params, self.gen_id, self.detokenize = params, gen_id, detokenize
    self.sampling = ecfg.sampling  # run(sampling=...) overrides it for one call
    self.key = jax.random.key(seed)
    self.mesh = mesh
    self._pending: _Pending | None = None
    self._running = False  # inside run(): updates land under their policy
    self._shardings = _slot_shardings(mesh, ecfg.n_slots, cfg.n_kv_heads)
    self.pool = PagePool(ecfg.n_pages, ecfg.page_size, ecfg.n_slots, ecfg.max_pages_per_seq)
    self.host = _SlotMirror.zeros(ecfg.n_slots)
    self.state = DecodeState(cache=self._zero_cache(), **self._slot_arrays())
    self.stats = collections.Counter()
    self._kv_released = False

  def _zero_cache(self) -> PagedKVCache:
    e = self.ecfg
    cache = PagedKVCache.zeros(self.cfg, e.n_pages, e.page_size, e.max_pages_per_seq, e.n_slots, impl=e.impl)
    return cache.replace(k_LPSKH=self._put(cache.k_LPSKH, "kv"), v_LPSKH=self._put(cache.v_LPSKH, "kv"),
                         table_BM=self._put(cache.table_BM, "BM"))  # the steady-state layouts from the start

  def release_kv(self) -> None:
    """Frees the KV pool's device memory (colocated: the trainer needs it); the next `run` or
    `insert_group` allocates a fresh one. Only between runs: no sequence may hold pages."""
    if any(self.pool.seq_id(s) is not None for s in range(self.ecfg.n_slots)):
      raise RuntimeError("release_kv with live sequences; free them first")
    if not self._kv_released:
      self.state.cache.k_LPSKH.delete()
      self.state.cache.v_LPSKH.delete()
      self._kv_released = True

  def _ensure_kv(self) -> None:
    if self._kv_released:
      self.state = self.state.replace(cache=self._zero_cache())
      self._kv_released = False

  def _put(self, x, kind: str):
    sharding = self._shardings.get(kind)
    return jax.device_put(x, sharding) if sharding is not None else jnp.asarray(x)

  def _slot_arrays(self) -> dict:
    h = self.host
    return dict(last_B=self._put(h.last_B, "B"), pos_B=self._put(h.pos_B, "B"), seq_B=self._put(h.seq_B, "B"),
                left_B=self._put(h.left_B, "B"), active_B=self._put(h.active_B, "B"))

  # -- weights -----------------------------------------------------------------------------------

  def update_weights(self, params, gen_id: int, policy: str = "keep_kv") -> None:
    """New weights, version `gen_id`, landing between decode chunks under `policy`:
      keep_kv           now; live sequences continue on K/V cached under the old weights
      finish_on_old     live sequences finish on the old weights; nothing new is admitted until
                        they have, then the swap (the old weights stay alive until then)
      abort_and_resume  now; live sequences drop their K/V and are re-prefilled (prompt + tokens
                        so far) under the new weights, then continue
    Tokens keep the gen_id they were sampled under. Outside `run`, every policy swaps at once."""
    if policy not in UPDATE_POLICIES:
      raise ValueError(f"update policy {policy!r}; expected one of {UPDATE_POLICIES}")
    newest = self._pending.gen_id if self._pending else self.gen_id
    if gen_id <= newest:
      raise ValueError(f"gen_id must increase: engine holds {newest}, got {gen_id}")
    self._pending = _Pending(params, gen_id, policy)
    if not self._running:
      self._swap()

  def _swap(self) -> None:
    self.params, self.gen_id, self._pending = self._pending.params, self._pending.gen_id, None
    self.stats["weight_updates"] += 1

  # -- JetStream-shaped pieces ---------------------------------------------------------------------

  def insert_group(self, prompt_ids: Sequence[int], seq_ids: Sequence[int], *, max_new_tokens: int,
                   stop_ids: Sequence[int] = ()) -> list[tuple[int, int, float]]:
    """Prefills `prompt_ids` once into a new slot, forks it for the other sequences (sharing the
    prompt's full pages), samples each one's first token and makes the slots live for up to
    `max_new_tokens` tokens in all: (slot, first token, its log-prob) per sequence. Raises
    OutOfPages, with nothing changed, if the pool cannot hold the whole group now."""
    self._ensure_kv()
    n_prompt = len(prompt_ids)
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
    e = self.ecfg
    T = bucket_length(n_prompt, e.min_bucket, e.max_pages_per_seq * e.page_size)
    tokens = np.full((1, T), e.pad_id, np.int32)
    tokens[0, :n_prompt] = prompt_ids
    table = self.pool.table()[slots[0]][None]
    self.state, logits = prefill(self.graphdef, self.params, self.state, tokens, np.int32(n_prompt), table)
    if copies:
      src = np.full((e.n_slots,), 0, np.int32)
      dst = np.full((e.n_slots,), e.n_pages, np.int32)  # out of range: no-op
      src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
      self.state = copy_pages(self.state, src, dst)
    first, lps = to_host(sample_first(logits, self.key, np.asarray(seq_ids, np.int32), np.int32(n_prompt),
                                      sampling=self.sampling))
    self.stats["prefills"] += 1
    self.stats["forks"] += len(slots) - 1
    h = self.host
    for slot, sid, tok in zip(slots, seq_ids, first.tolist(), strict=True):
      h.last_B[slot], h.pos_B[slot], h.seq_B[slot], h.left_B[slot] = tok, n_prompt, sid, max_new_tokens - 1
      h.active_B[slot] = max_new_tokens > 1 and tok not in e.eos_ids and tok not in stop_ids
      h.stop_BX[slot] = -1
      h.stop_BX[slot, : len(stop_ids)] = stop_ids
    return list(zip(slots, first.tolist(), lps.tolist(), strict=True))

  def insert(self, prompt_ids: Sequence[int], seq_id: int, **kw) -> tuple[int, int, float]:
    """One sequence: `insert_group` with a group of one."""
    return self.insert_group(prompt_ids, [seq_id], **kw)[0]

  def generate(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """K decode steps for every live slot: (tokens_KB, logprobs_KB, emitted_KB) on the host.
    A slot stops emitting at EOS / its stop ids / its length budget and stays inactive (its pages
    held) until `free`. Raises OutOfPages if a live slot cannot get pages for the chunk."""
    e, h = self.ecfg, self.host
    for slot in np.flatnonzero(h.active_B):
      self.pool.ensure_capacity(int(slot), int(min(e.decode_chunk, h.left_B[slot])))
    self.state = self.state.replace(cache=self.state.cache.replace(table_BM=self._put(self.pool.table(), "BM")),
                                    **self._slot_arrays())
    self.state, toks, lps, emitted = generate(
        self.graphdef, self.params, self.state, self.key, self._put(h.stop_BX, "BM"), sampling=self.sampling,
        n_steps=e.decode_chunk, eos_ids=e.eos_ids, pad_id=e.pad_id)
    names = ("last_B", "pos_B", "left_B", "active_B")
    toks, lps, emitted, dev = to_host((toks, lps, emitted, [getattr(self.state, k) for k in names]))
    for name, value in zip(names, dev, strict=True):
      setattr(h, name, np.array(value))
    for slot in np.flatnonzero(emitted.any(axis=0)):
      self.pool.advance(int(slot), int(emitted[:, slot].sum()))
    self.stats["chunks"] += 1
    return toks, lps, emitted

  def free(self, slot: int) -> None:
    """Returns the slot's pages (shared prompt pages when the last sibling goes)."""
    self.pool.free(slot)
    self.host.active_B[slot] = False

  # -- the loop ------------------------------------------------------------------------------------

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
      if req.stop_strings and (self.detokenize is None or not all(req.stop_strings)):
        raise ValueError(f"request {r}: stop strings need non-empty strings and an engine built with detokenize=")
      if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= self.cfg.vocab_size:
        raise ValueError(f"request {r}: token ids must lie in [0, {self.cfg.vocab_size})")

  def run(self, requests: Sequence[Request], on_chunk: Callable[[RolloutEngine], None] | None = None, *,
          key: jax.Array | None = None, sampling: SamplingConfig | None = None) -> list[Sample]:
    """Generates every request's n samples; returns them request-major. `on_chunk(engine)` runs
    between decode chunks, e.g. to `update_weights` (which then lands under its policy). `key`
    replaces the engine's sampling key from now on (the RL loop gives each step its own); `sampling`
    replaces `ecfg.sampling` for this call only (e.g. greedy evaluation)."""
    self._check(requests)
    if key is not None:
      self.key = key
    self._running = True
    self.sampling = sampling or self.ecfg.sampling
    try:
      return self._run(_Loop(self, requests), on_chunk)
    finally:
      self._running = False
      self.sampling = self.ecfg.sampling

  def _run(self, loop: _Loop, on_chunk) -> list[Sample]:
    while loop.queue or loop.live:
      if self._pending is not None and (self._pending.policy != "finish_on_old" or not loop.live):
        loop.land_update()
      if self._pending is None:  # finish_on_old: admit nothing until the old weights are done
        loop.fill()
      if not loop.live:
        continue
      loop.reserve()
      if not loop.live:
        continue
      loop.collect(*self.generate())
      if on_chunk is not None:
        on_chunk(self)
    if self._pending is not None:
      self._swap()
    return [loop.out[(r, i)] for r, req in enumerate(loop.requests) for i in range(req.n)]


class _Loop:
  """The state of one `run`: queue of groups to admit, live slots, samples so far."""

  def __init__(self, engine: RolloutEngine, requests: Sequence[Request]):
    self.engine, self.requests = engine, requests
    self.base = np.cumsum([0] + [req.n for req in requests])  # sequence id = base[r] + sample index
    self.out = {(r, i): Sample(r, i, [], [], []) for r, req in enumerate(requests) for i in range(req.n)}
    # (request, samples, resume): resume = continue out[(r, i)] from its tokens so far (one sample)
    self.queue = collections.deque((r, list(range(req.n)), False) for r, req in enumerate(requests))
    self.live: dict[int, tuple[int, int]] = {}  # slot -> (request, sample)

  def fill(self) -> None:
    """Admits queued groups while slots and pages allow (a whole group at once: one prefill)."""
    eng = self.engine
    while self.queue:
      r, samples, resume = self.queue[0]
      req = self.requests[r]
      if len(samples) > eng.ecfg.n_slots - len(self.live):
        return
      done = self.out[(r, samples[0])].tokens if resume else []
      try:
        admitted = eng.insert_group(list(req.prompt_ids) + done, [int(self.base[r]) + i for i in samples],
                                    max_new_tokens=req.max_new_tokens - len(done), stop_ids=req.stop_ids)
      except OutOfPages:
        if not self.live:
          raise RuntimeError(f"request {r} does not fit the empty pool") from None
        return
      self.queue.popleft()
      eng.stats["resumed"] += resume
      for (slot, tok, lp), i in zip(admitted, samples, strict=True):
        sample = self.out[(r, i)]
        if not resume:
          sample.tokens, sample.logprobs, sample.gen_ids = [], [], []
        self.live[slot] = (r, i)
        self._append(slot, [tok], [lp])

  def collect(self, toks_KB, lps_KB, emitted_KB) -> None:
    for slot in list(self.live):
      n_new = int(emitted_KB[:, slot].sum())
      self._append(slot, toks_KB[:n_new, slot].tolist(), lps_KB[:n_new, slot].tolist())

  def _append(self, slot: int, tokens: list[int], logprobs: list[float]) -> None:
    """Adds a slot's new tokens; retires it on device stop, length, or a stop string."""
    eng = self.engine
    r, i = self.live[slot]
    req, sample = self.requests[r], self.out[(r, i)]
    start = len(sample.tokens)
    sample.tokens += tokens
    sample.logprobs += logprobs
    sample.gen_ids += [eng.gen_id] * len(tokens)
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

  def reserve(self) -> None:
    """Pages for the next chunk's writes; out of pages -> preempt the youngest and requeue them."""
    eng = self.engine
    for slot in list(self.live):
      while slot in self.live:
        try:
          eng.pool.ensure_capacity(slot, int(min(eng.ecfg.decode_chunk, eng.host.left_B[slot])))
          break
        except OutOfPages as err:
          seq_to_slot = {eng.pool.seq_id(s): s for s in self.live}
          for seq in eng.pool.preempt_youngest(err.needed):
            victim = seq_to_slot[seq]
            r, i = self.live.pop(victim)
            eng.host.active_B[victim] = False
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


def _slot_shardings(mesh, n_slots: int, n_kv_heads: int) -> dict:
  """Shardings of the device state on a rollout mesh: slots over `data`, KV heads over `tensor`."""
  if mesh is None:
    return {}
  axes = dict(mesh.shape)
  unknown = set(axes) - {"data", "tensor"}
  if unknown:
    raise ValueError(f"rollout mesh axes {sorted(unknown)} unknown; the engine uses 'data' and 'tensor'")
  data, tensor = axes.get("data", 1), axes.get("tensor", 1)
  if n_slots % data:
    raise ValueError(f"n_slots={n_slots} must be a multiple of the mesh's data axis ({data})")
  if n_kv_heads % tensor:
    raise ValueError(f"n_kv_heads={n_kv_heads} must be a multiple of the mesh's tensor axis ({tensor})")
  d = "data" if "data" in axes else None
  t = "tensor" if "tensor" in axes else None
  P = jax.sharding.PartitionSpec
  ns = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))  # noqa: E731
  return {"kv": ns(None, None, None, t, None), "B": ns(d), "BM": ns(d, None)}
