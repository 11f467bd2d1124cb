"""Device side of the rollout engine: the decode state and the pure jitted functions over it.

Every function takes the `DecodeState` and returns the new one, donated, so the pool is updated in
place and slot state never leaves the device between calls. Host data enters only as small int32
arrays describing what changed (admissions, page-table growth, frees); the host reads back only
tokens, log-probs and finish flags. Functions, in the shape of JetStream's engine API:
  prefill   one admission wave of one prompt-length bucket: G ragged prompts (right-padded, each
            written into its own pages) in one forward pass, then the forks' copy-on-write page
            copies, then every sample's first token (its own key, from its prompt's last logits),
            written into that sample's slot row (or only returned: slot = B drops the row)
  patch     the page table and slot rows set from the host (stop-string finish, preemption, abort)
  generate  up to K decode steps of every active slot (K traced: one program for every chunk length); an
            idle slot feeds position -1, so it writes no K/V and its attention reads no page (paged.py)
Alphabet: B slots, G prompts of a wave, T prompt bucket, N sample rows, M pages per slot,
X stop ids per slot, C page copies, K decode steps, V vocabulary.
Row padding: slot index B and page index P are out of range, and every scatter uses mode="drop".

Data shards: on a mesh with a `data` axis each function runs per data shard (`jax.shard_map`,
manual over `data` only; `tensor` stays with GSPMD inside): shard d holds slots [d*B/D, (d+1)*B/D),
pool pages [d*P/D, (d+1)*P/D) (kv_pool.py allocates a slot only pages of its own shard) and every
host row array's rows [d*R/D, (d+1)*R/D), with slot indices local to the shard (B/D = padding).
Page ids arrive global and are made shard-local on entry (`_local_pages`); the device's page table
holds local ids. So no device ever reads another shard's pages: no collective touches the pool,
and each device holds 1/D of the pool (per-device KV bytes fall as `data` grows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

from jaxrl_topo.rollout.paged import PagedKVCache, pages_read, window_widths
from jaxrl_topo.rollout.requests import MAX_STOP_IDS
from jaxrl_topo.rollout.sampling import SamplingConfig, sample_tokens, sequence_keys


class Static:
  """A static jit argument (the model's GraphDef) hashed once: jit hashes its static arguments on
  every call, and hashing a GraphDef walks the whole graph (~0.3 ms a call for a 2-layer model)."""

  def __init__(self, value):
    self.value, self._hash = value, hash(value)

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return isinstance(other, Static) and (self.value is other.value or self.value == other.value)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Shardings of the decode state on a rollout mesh (hashable: a static argument). Every function
  constrains its output state to them, so a state threaded call to call keeps one layout and
  steady state compiles nothing."""

  kv: jax.sharding.NamedSharding
  B: jax.sharding.NamedSharding
  BM: jax.sharding.NamedSharding

  @property
  def data(self) -> int:
    """Data shards: each owns B/data slots and P/data pages."""
    return dict(self.B.mesh.shape).get("data", 1)

  @property
  def kv_heads_split(self) -> bool:
    """Whether KV heads are split over a `tensor` axis of more than one device."""
    return self.kv.spec[3] is not None and dict(self.kv.mesh.shape)[self.kv.spec[3]] > 1


@struct.dataclass
class DecodeState:
  cache: PagedKVCache
  last_B: jax.Array  # int32 token to feed next
  pos_B: jax.Array  # int32 its position (= tokens whose K/V are written)
  seq_B: jax.Array  # int32 sequence id (sampling keys)
  left_B: jax.Array  # int32 tokens still allowed
  active_B: jax.Array  # bool
  stop_BX: jax.Array  # int32 per-slot stop ids besides eos (-1 = none)

  @classmethod
  def idle(cls, cache: PagedKVCache, n_slots: int) -> DecodeState:
    """No sequence in any of `n_slots` slots (each array its own buffer: the state is donated)."""
    z = lambda: jnp.zeros((n_slots,), jnp.int32)  # noqa: E731
    return cls(cache=cache, last_B=z(), pos_B=z(), seq_B=z(), left_B=z(), active_B=jnp.zeros((n_slots,), bool),
               stop_BX=jnp.full((n_slots, MAX_STOP_IDS), -1, jnp.int32))


def constrain(state: DecodeState, layout: Layout | None) -> DecodeState:
  if layout is None:
    return state
  c = jax.lax.with_sharding_constraint
  cache = state.cache.replace(k_LPSKH=c(state.cache.k_LPSKH, layout.kv), v_LPSKH=c(state.cache.v_LPSKH, layout.kv),
                              table_BM=c(state.cache.table_BM, layout.BM))
  return state.replace(cache=cache, last_B=c(state.last_B, layout.B), pos_B=c(state.pos_B, layout.B),
                       seq_B=c(state.seq_B, layout.B), left_B=c(state.left_B, layout.B),
                       active_B=c(state.active_B, layout.B), stop_BX=c(state.stop_BX, layout.BM))


_D, _R = P("data"), P()  # rows split over the data shards; replicated


def _sharded(layout: Layout | None) -> bool:
  return layout is not None and layout.data > 1


def _per_shard(fn, layout: Layout | None, in_specs, out_specs):
  """fn on each data shard's rows and pages (manual over `data` only); fn itself without data shards."""
  if not _sharded(layout):
    return fn
  return jax.shard_map(fn, mesh=layout.B.mesh, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset({"data"}),
                       check_vma=False)


def _state_specs(state: DecodeState) -> DecodeState:
  """shard_map specs of the state: slot rows and pool pages over `data`."""
  specs = jax.tree.map(lambda _: _D, state)
  return specs.replace(cache=specs.cache.replace(k_LPSKH=P(None, "data"), v_LPSKH=P(None, "data")))


def _merge(graphdef, params, sharded: bool):
  """The model, for one data shard's program when `sharded`: `data` is manual there, so its activation
  constraints (ActivationSharding, models built on a mesh) keep only the other mesh axes."""
  model = nnx.merge(graphdef, params)
  act = getattr(model, "sharding", None)
  if sharded and act is not None:
    model.sharding = dataclasses.replace(act, rules=tuple((name, _without_data(axes)) for name, axes in act.rules))
  return model


def _without_data(axes):
  """A rule's mesh axes less `data`."""
  if isinstance(axes, tuple):
    return tuple(a for a in axes if a != "data") or None
  return None if axes == "data" else axes


def _local_pages(ids, n_local: int, sharded: bool, missing: int):
  """Global page ids -> this data shard's (it owns [d * n_local, (d + 1) * n_local)); -1 and ids of
  other shards -> `missing`. Without shards only -1 changes."""
  local = ids - jax.lax.axis_index("data") * n_local if sharded else ids
  return jnp.where((ids >= 0) & (local >= 0) & (local < n_local), local, missing)


def _stops(tok_N, stop_NX, eos_ids: tuple[int, ...]):
  eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
  return jnp.isin(tok_N, eos) | jnp.any(tok_N[:, None] == stop_NX, axis=-1)


def _set_rows(state: DecodeState, slot_N, last_N, pos_N, seq_N, left_N, active_N, stop_NX) -> DecodeState:
  """state rows slot_N := the given values; slot B (padding) is dropped."""
  def put(x, v):
    return x.at[slot_N].set(v.astype(x.dtype), mode="drop")
  return state.replace(last_B=put(state.last_B, last_N), pos_B=put(state.pos_B, pos_N), seq_B=put(state.seq_B, seq_N),
                       left_B=put(state.left_B, left_N), active_B=put(state.active_B, active_N),
                       stop_BX=put(state.stop_BX, stop_NX))


def _copy_pages(cache: PagedKVCache, src_C, dst_C, sharded: bool) -> PagedKVCache:
  """Copy-on-write of forked partial pages (global ids), every layer; dst outside the shard: no-op."""
  src_C = _local_pages(src_C, cache.n_pages, sharded, 0)
  dst_C = _local_pages(dst_C, cache.n_pages, sharded, cache.n_pages)
  k = cache.k_LPSKH.at[:, dst_C].set(cache.k_LPSKH[:, src_C], mode="drop")
  v = cache.v_LPSKH.at[:, dst_C].set(cache.v_LPSKH[:, src_C], mode="drop")
  return cache.replace(k_LPSKH=k, v_LPSKH=v)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "eos_ids", "layout"), donate_argnames=("state",))
def prefill(graphdef, params, state: DecodeState, key, table_BM, tokens_GT, lengths_G, start_G, table_GM, src_C,
            dst_C, prompt_N, slot_N, seq_N, left_N, stop_NX, *, sampling: SamplingConfig, eos_ids: tuple[int, ...],
            layout: Layout | None = None):
  """One wave: (state, first tokens_N, their log-probs_N). Sample row n draws from prompt prompt_N[n]
  with the key (seed, seq_N[n], its prompt length) and, unless slot_N[n] = B, goes live in that slot
  with left_N[n] more tokens allowed. `table_BM` replaces the device page table (it holds the
  wave's slots); `table_GM` holds each prompt's own pages (all -1 for padding rows). Prompt g's
  tokens sit at positions start_G[g] + t: an episode's next turn (scheduler.py) continues a slot
  whose positions < start_G[g] are already in its pages, attending to them (start 0: a new prompt).
  With data shards, every G, C and N row array is split into equal per-shard parts (module docstring)."""
  body = functools.partial(_prefill_shard, graphdef.value, sampling=sampling, eos_ids=eos_ids,
                           sharded=_sharded(layout))
  specs = _state_specs(state)
  state, tok_N, lp_N = _per_shard(body, layout, (_R, specs, _R) + (_D,) * 12, (specs, _D, _D))(
      params, state, key, table_BM, tokens_GT, lengths_G, start_G, table_GM, src_C, dst_C, prompt_N, slot_N, seq_N,
      left_N, stop_NX)
  return constrain(state, layout), tok_N, lp_N


def _prefill_shard(graphdef, params, state: DecodeState, key, table_BM, tokens_GT, lengths_G, start_G, table_GM, src_C,
                   dst_C, prompt_N, slot_N, seq_N, left_N, stop_NX, *, sampling, eos_ids, sharded: bool):
  model = _merge(graphdef, params, sharded)
  G, T = tokens_GT.shape
  n_local = state.cache.n_pages
  view = state.cache.replace(table_BM=_local_pages(table_GM, n_local, sharded, -1))
  positions_GT = start_G[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  h_GTD, view = model.hidden(tokens_GT, positions_GT, None, view)
  h_G1D = jnp.take_along_axis(h_GTD, (lengths_G - 1)[:, None, None], axis=1)
  logits_GV = model.logits(h_G1D)[:, 0]
  cache = state.cache.replace(k_LPSKH=view.k_LPSKH, v_LPSKH=view.v_LPSKH,
                              table_BM=_local_pages(table_BM, n_local, sharded, -1))
  # The forks' copy-on-write reads and writes the pool after the layers' attention read it. XLA updates the
  # pool in place only if a data dependency orders those reads first, else it copies the whole pool (twice,
  # in every prefill). Hence dst depends on h, through a condition that is never true (no value is both finite
  # and NaN) but that XLA cannot fold; an optimization barrier on (dst, h) orders them too, yet XLA copies the
  # pool then. (The condition used to be "h is not all finite": one non-finite prompt cancelled every fork of
  # the wave, and the other groups' samples read stale K/V where their prompt's last page should have been.)
  never = jnp.isfinite(h_GTD).all() & jnp.isnan(h_GTD).any()
  cache = _copy_pages(cache, src_C, jnp.where(never, -1, dst_C), sharded)
  len_N = start_G[prompt_N] + lengths_G[prompt_N]  # the sampled token's position
  tok_N, lp_N = sample_tokens(logits_GV[prompt_N], sequence_keys(key, seq_N, len_N), sampling)
  active_N = (left_N > 0) & ~_stops(tok_N, stop_NX, eos_ids)
  state = _set_rows(state.replace(cache=cache), slot_N, tok_N, len_N, seq_N, left_N, active_N, stop_NX)
  return state, tok_N, lp_N


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnames=("state",))
def patch(state: DecodeState, table_BM, src_C, dst_C, slot_N, last_N, pos_N, seq_N, left_N, active_N, stop_NX, *,
          layout: Layout | None = None):
  """The host's changes between chunks: a new page table, page copies, slot rows."""
  sharded = _sharded(layout)

  def body(state, table_BM, src_C, dst_C, slot_N, last_N, pos_N, seq_N, left_N, active_N, stop_NX):
    cache = state.cache.replace(table_BM=_local_pages(table_BM, state.cache.n_pages, sharded, -1))
    cache = _copy_pages(cache, src_C, dst_C, sharded)
    return _set_rows(state.replace(cache=cache), slot_N, last_N, pos_N, seq_N, left_N, active_N, stop_NX)

  specs = _state_specs(state)
  state = _per_shard(body, layout, (specs,) + (_D,) * 10, specs)(
      state, table_BM, src_C, dst_C, slot_N, last_N, pos_N, seq_N, left_N, active_N, stop_NX)
  return constrain(state, layout)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "capacity", "eos_ids", "pad_id", "layout",
                                             "n_rows", "window_pages"), donate_argnames=("state",))
def generate(graphdef, params, state: DecodeState, key, live_floor_D, n_steps, *, sampling: SamplingConfig,
             capacity: int, eos_ids: tuple[int, ...], pad_id: int, layout: Layout | None = None, n_rows: int = 0,
             window_pages: int = 0):
  """Up to n_steps decode steps: (state, tokens_KB, logprobs_KB, emitted_KB, active_B after the chunk).
  n_steps (int32 scalar, traced: every chunk length runs one program) <= capacity (static), the K rows of
  the outputs; rows past the steps run hold pad_id / 0 / False.
  With data shards each shard decodes its own slots and stops when they are done.
  live_floor_D (int32, one per data shard): the chunk also ends, early, at the first step at which the
  shard has fewer live rows than that (a slot freed while requests wait: the host admits into it at
  once instead of after the chunk); 0 = never. Traced, so changing it compiles nothing.
  n_rows (static; 0 = all): each shard decodes only its first n_rows live rows, packed into an n_rows batch
  (the host passes a bound on its live rows), so a step's cost follows the live rows, not the slots. A
  live row left out (only if the bound was wrong) just does not advance in this chunk.
  window_pages (static; impl "window" only, > 0 there): the chunk gathers each row's first window_pages pages once
  (PagedKVCache.open_window) and its steps read them in place; it ends before any live row would write past
  them. The host passes a power of two (or M), so a program serves every chunk until the longest row outgrows it."""
  if (state.cache.impl == "window") != (window_pages > 0):
    raise ValueError(f"window_pages={window_pages} with impl={state.cache.impl!r}: a window needs impl 'window'")
  body = functools.partial(_generate_shard, graphdef.value, sampling=sampling, capacity=capacity, eos_ids=eos_ids,
                           pad_id=pad_id, sharded=_sharded(layout), n_rows=n_rows, window_pages=window_pages)
  specs, KB = _state_specs(state), P(None, "data")
  state, tokens_KB, logprobs_KB, emitted_KB = _per_shard(body, layout, (_R, specs, _R, _D, _R), (specs, KB, KB, KB))(
      params, state, key, live_floor_D, jnp.asarray(n_steps, jnp.int32))
  state = constrain(state, layout)
  return state, tokens_KB, logprobs_KB, emitted_KB, state.active_B


def _generate_shard(graphdef, params, state: DecodeState, key, live_floor_D, n_steps, *, sampling, capacity: int,
                    eos_ids, pad_id: int, sharded: bool, n_rows: int, window_pages: int):
  B = state.last_B.shape[0]
  rows = functools.partial(_decode_rows, graphdef, params, key=key, live_floor_D=live_floor_D, n_steps=n_steps,
                           sampling=sampling, capacity=capacity, eos_ids=eos_ids, pad_id=pad_id, sharded=sharded,
                           window_pages=window_pages)
  if not 0 < n_rows < B:
    return rows(state)
  # Pack: the live rows first (stable), the first n_rows of them decode; their results go back to their slots.
  rows_R = jnp.argsort(~state.active_B, stable=True)[:n_rows]
  take = lambda x: x[rows_R]  # noqa: E731
  packed = state.replace(cache=state.cache.replace(table_BM=take(state.cache.table_BM)), last_B=take(state.last_B),
                         pos_B=take(state.pos_B), seq_B=take(state.seq_B), left_B=take(state.left_B),
                         active_B=take(state.active_B), stop_BX=take(state.stop_BX))
  packed, tokens_KR, logprobs_KR, emitted_KR = rows(packed)
  put = lambda x, v: x.at[rows_R].set(v)  # noqa: E731
  state = state.replace(cache=state.cache.replace(k_LPSKH=packed.cache.k_LPSKH, v_LPSKH=packed.cache.v_LPSKH),
                        last_B=put(state.last_B, packed.last_B), pos_B=put(state.pos_B, packed.pos_B),
                        left_B=put(state.left_B, packed.left_B), active_B=put(state.active_B, packed.active_B))
  cols = lambda x_KR, fill: jnp.full((capacity, B), fill, x_KR.dtype).at[:, rows_R].set(x_KR)  # noqa: E731
  return state, cols(tokens_KR, pad_id), cols(logprobs_KR, 0.0), cols(emitted_KR, False)


def _decode_rows(graphdef, params, state: DecodeState, *, key, live_floor_D, n_steps, sampling, capacity: int, eos_ids,
                 pad_id: int, sharded: bool, window_pages: int):
  """Up to n_steps (<= capacity) decode steps of every row of `state` (its batch, packed or not)."""
  model = _merge(graphdef, params, sharded)
  if window_pages:
    state = state.replace(cache=state.cache.open_window(window_pages, jnp.dtype(model.cfg.dtype),
                                                        jnp.where(state.active_B, state.pos_B, 0)))

  def step(carry):
    i, state, tokens_KB, logprobs_KB, emitted_KB = carry
    live = state.active_B
    pos_B = _live_pos(state)  # idle rows: no K/V write, no page read
    h_B1D, cache = model.hidden(state.last_B[:, None], pos_B[:, None], None, state.cache)
    keys = sequence_keys(key, state.seq_B, state.pos_B + 1)
    tok_B, lp_B = sample_tokens(model.logits(h_B1D)[:, 0], keys, sampling)
    left = state.left_B - live
    new = state.replace(cache=cache, last_B=jnp.where(live, tok_B, state.last_B), pos_B=state.pos_B + live,
                        left_B=left, active_B=live & ~_stops(tok_B, state.stop_BX, eos_ids) & (left > 0))
    tokens_KB = tokens_KB.at[i].set(jnp.where(live, tok_B, pad_id))
    return i + 1, new, tokens_KB, logprobs_KB.at[i].set(jnp.where(live, lp_B, 0.0)), emitted_KB.at[i].set(live)

  # A while loop, not a scan: it stops at the first step with no live row, so the steps of a chunk
  # past every row's end (and a whole chunk dispatched past the end) cost nothing. (A lax.cond around
  # the step would do the same but makes XLA copy the whole pool at every step.)
  B = state.last_B.shape[0]
  init = (jnp.int32(0), state, jnp.full((capacity, B), pad_id, jnp.int32), jnp.zeros((capacity, B), jnp.float32),
          jnp.zeros((capacity, B), bool))
  def more(c):
    n_live = jnp.sum(c[1].active_B.astype(jnp.int32))
    return (c[0] < jnp.minimum(n_steps, capacity)) & (n_live > 0) & (n_live >= live_floor_D[0])

  if not window_pages:
    _, state, tokens_KB, logprobs_KB, emitted_KB = jax.lax.while_loop(more, step, init)
    return state, tokens_KB, logprobs_KB, emitted_KB
  # impl "window": the steps whose bucketed width is narrower than the window read through a switch over the
  # narrower widths; then, while it is the window's own, the steps read the whole window with no switch (a
  # conditional is a called computation on XLA:CPU, ~8 us a layer). The chunk ends when no longer so (a live
  # row would write past the window, or the longest one ended and the width fell). A window at the narrowest
  # width it may read (EngineConfig.min_window_tokens) has no narrower steps: its program holds the second loop only.
  S, M = state.cache.page_size, state.cache.table_BM.shape[1]
  widths = window_widths(min(window_pages, M), state.cache.window_min_pages)
  narrower = widths[-2] if len(widths) > 1 else 0
  read = lambda c: pages_read(_live_pos(c[1]), S, M)  # noqa: E731
  carry = jax.lax.while_loop(lambda c: more(c) & (read(c) <= narrower), step, init) if narrower else init
  i, state, tokens_KB, logprobs_KB, emitted_KB = carry
  carry = (i, state.replace(cache=state.cache.replace(window_full=True)), tokens_KB, logprobs_KB, emitted_KB)
  fits = lambda c: jnp.max(_live_pos(c[1])) < window_pages * S  # noqa: E731
  carry = jax.lax.while_loop(lambda c: more(c) & (read(c) > narrower) & fits(c), step, carry)
  _, state, tokens_KB, logprobs_KB, emitted_KB = carry
  return state.replace(cache=state.cache.close_window()), tokens_KB, logprobs_KB, emitted_KB


def _live_pos(state: DecodeState):
  """Each row's position, -1 for an idle row."""
  return jnp.where(state.active_B, state.pos_B, -1)


def key_on_mesh(key: jax.Array, mesh) -> jax.Array:
  """A key held by devices outside `mesh` (the whole rollout mesh's, for an engine on some of its shards) copied
  onto the mesh, replicated. Multi-process meshes, and no mesh, take the key as given."""
  devices = set(mesh.devices.flat) if mesh is not None else set()
  if (not devices or not key.is_fully_addressable or key.sharding.device_set <= devices
      or any(d.process_index != jax.process_index() for d in devices)):
    return key
  return jax.device_put(key, jax.sharding.NamedSharding(mesh, P()))


def layout_for(mesh, n_slots: int, n_pages: int, n_kv_heads: int) -> Layout | None:
  """Shardings of the device state on a rollout mesh: slots and pool pages over `data` (each data
  shard owns n_slots/data slots and n_pages/data pages), KV heads over `tensor`."""
  if mesh is None:
    return None
  axes = dict(mesh.shape)
  unknown = set(axes) - {"data", "tensor"}
  if unknown:
    raise ValueError(f"rollout mesh axes {sorted(unknown)} unknown; the engine uses 'data' and 'tensor'")
  data, tensor = axes.get("data", 1), axes.get("tensor", 1)
  for name, n in (("n_slots", n_slots), ("n_pages", n_pages)):
    if n % data:
      raise ValueError(f"{name}={n} must be a multiple of the mesh's data axis ({data}): each data shard owns "
                       f"{name} / {data} of them")
  d = "data" if "data" in axes else None
  # KV heads split over `tensor` when they divide; otherwise (Qwen2.5-0.5B's 2 KV heads at tensor=4)
  # every tensor shard keeps all KV heads: each query-head shard reads the KV heads it needs locally.
  t = "tensor" if "tensor" in axes and n_kv_heads % tensor == 0 else None
  ns = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))  # noqa: E731
  return Layout(kv=ns(None, d, None, t, None), B=ns(d), BM=ns(d, None))
