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
  generate  K decode steps of every active slot; an idle slot feeds position -1, so it writes no K/V
            and its attention reads no page (paged.py)
Alphabet: B slots, G prompts of a wave, T prompt bucket, N sample rows, M pages per slot,
X stop ids per slot, C page copies, K decode steps, V vocabulary.
Row padding: slot index B and page index P are out of range, and every scatter uses mode="drop".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxrl_topo.rollout.paged import PagedKVCache
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

  kv: jax.sharding.Sharding
  B: jax.sharding.Sharding
  BM: jax.sharding.Sharding


@struct.dataclass
class DecodeState:
  cache: PagedKVCache
  last_B: jax.Array  # int32 token to feed next
  pos_B: jax.Array  # int32 its position (= tokens whose K/V are written)
  seq_B: jax.Array  # int32 sequence id (sampling keys)
  left_B: jax.Array  # int32 tokens still allowed
  active_B: jax.Array  # bool
  stop_BX: jax.Array  # int32 per-slot stop ids besides eos (-1 = none)


def constrain(state: DecodeState, layout: Layout | None) -> DecodeState:
  if layout is None:
    return state
  c = jax.lax.with_sharding_constraint
  cache = state.cache.replace(k_LPSKH=c(state.cache.k_LPSKH, layout.kv), v_LPSKH=c(state.cache.v_LPSKH, layout.kv),
                              table_BM=c(state.cache.table_BM, layout.BM))
  return state.replace(cache=cache, last_B=c(state.last_B, layout.B), pos_B=c(state.pos_B, layout.B),
                       seq_B=c(state.seq_B, layout.B), left_B=c(state.left_B, layout.B),
                       active_B=c(state.active_B, layout.B), stop_BX=c(state.stop_BX, layout.BM))


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


def _copy_pages(cache: PagedKVCache, src_C, dst_C) -> PagedKVCache:
  """Copy-on-write of forked partial pages, every layer; dst = n_pages entries are no-ops."""
  src_C = jnp.clip(src_C, 0, cache.n_pages - 1)
  k = cache.k_LPSKH.at[:, dst_C].set(cache.k_LPSKH[:, src_C], mode="drop")
  v = cache.v_LPSKH.at[:, dst_C].set(cache.v_LPSKH[:, src_C], mode="drop")
  return cache.replace(k_LPSKH=k, v_LPSKH=v)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "eos_ids", "layout"), donate_argnames=("state",))
def prefill(graphdef, params, state: DecodeState, key, table_BM, tokens_GT, lengths_G, table_GM, src_C, dst_C,
            prompt_N, slot_N, seq_N, left_N, stop_NX, *, sampling: SamplingConfig, eos_ids: tuple[int, ...],
            layout: Layout | None = None):
  """One wave: (state, first tokens_N, their log-probs_N). Sample row n draws from prompt prompt_N[n]
  with the key (seed, seq_N[n], its prompt length) and, unless slot_N[n] = B, goes live in that slot
  with left_N[n] more tokens allowed. `table_BM` replaces the device page table (it holds the
  wave's slots); `table_GM` holds each prompt's own pages (all -1 for padding rows)."""
  model = nnx.merge(graphdef.value, params)
  G, T = tokens_GT.shape
  view = state.cache.replace(table_BM=table_GM)
  positions_GT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (G, T))
  h_GTD, view = model.hidden(tokens_GT, positions_GT, None, view)
  h_G1D = jnp.take_along_axis(h_GTD, (lengths_G - 1)[:, None, None], axis=1)
  logits_GV = model.logits(h_G1D)[:, 0]
  cache = _copy_pages(state.cache.replace(k_LPSKH=view.k_LPSKH, v_LPSKH=view.v_LPSKH, table_BM=table_BM), src_C, dst_C)
  len_N = lengths_G[prompt_N]
  tok_N, lp_N = sample_tokens(logits_GV[prompt_N], sequence_keys(key, seq_N, len_N), sampling)
  active_N = (left_N > 0) & ~_stops(tok_N, stop_NX, eos_ids)
  state = _set_rows(state.replace(cache=cache), slot_N, tok_N, len_N, seq_N, left_N, active_N, stop_NX)
  return constrain(state, layout), tok_N, lp_N


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnames=("state",))
def patch(state: DecodeState, table_BM, src_C, dst_C, slot_N, last_N, pos_N, seq_N, left_N, active_N, stop_NX, *,
          layout: Layout | None = None):
  """The host's changes between chunks: a new page table, page copies, slot rows."""
  cache = _copy_pages(state.cache.replace(table_BM=table_BM), src_C, dst_C)
  state = _set_rows(state.replace(cache=cache), slot_N, last_N, pos_N, seq_N, left_N, active_N, stop_NX)
  return constrain(state, layout)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "n_steps", "eos_ids", "pad_id", "layout"),
                   donate_argnames=("state",))
def generate(graphdef, params, state: DecodeState, key, *, sampling: SamplingConfig, n_steps: int,
             eos_ids: tuple[int, ...], pad_id: int, layout: Layout | None = None):
  """K = n_steps decode steps: (state, tokens_KB, logprobs_KB, emitted_KB, active_B after the chunk)."""
  model = nnx.merge(graphdef.value, params)

  def step(carry):
    i, state, tokens_KB, logprobs_KB, emitted_KB = carry
    live = state.active_B
    pos_B = jnp.where(live, state.pos_B, -1)  # idle rows: no K/V write, no page read
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
  init = (jnp.int32(0), state, jnp.full((n_steps, B), pad_id, jnp.int32), jnp.zeros((n_steps, B), jnp.float32),
          jnp.zeros((n_steps, B), bool))
  _, state, tokens_KB, logprobs_KB, emitted_KB = jax.lax.while_loop(
      lambda c: (c[0] < n_steps) & jnp.any(c[1].active_B), step, init)
  state = constrain(state, layout)
  return state, tokens_KB, logprobs_KB, emitted_KB, state.active_B


def layout_for(mesh, n_slots: int, n_kv_heads: int) -> Layout | None:
  """Shardings of the device state on a rollout mesh: slots over `data`, KV heads over `tensor`."""
  if mesh is None:
    return None
  axes = dict(mesh.shape)
  unknown = set(axes) - {"data", "tensor"}
  if unknown:
    raise ValueError(f"rollout mesh axes {sorted(unknown)} unknown; the engine uses 'data' and 'tensor'")
  data, tensor = axes.get("data", 1), axes.get("tensor", 1)
  if n_slots % data:
    raise ValueError(f"n_slots={n_slots} must be a multiple of the mesh's data axis ({data})")
  d = "data" if "data" in axes else None
  # KV heads split over `tensor` when they divide; otherwise (Qwen2.5-0.5B's 2 KV heads at tensor=4)
  # every tensor shard keeps all KV heads: each query-head shard reads the KV heads it needs locally.
  t = "tensor" if "tensor" in axes and n_kv_heads % tensor == 0 else None
  P = jax.sharding.PartitionSpec
  ns = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))  # noqa: E731
  return Layout(kv=ns(None, None, None, t, None), B=ns(d), BM=ns(d, None))
