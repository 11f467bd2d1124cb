"""Paged KV cache: one pool of fixed-size pages per layer, addressed through a per-row page table.

Token position p of batch row b lives at page `table_BM[b, p // S]`, slot `p % S`. The cache speaks
the same `attend(layer, q_BTNH, k_BTKH, v_BTKH, positions_BT) -> (out_BTNH, cache)` protocol as
layers.DenseKVCache, so the model code is unchanged: `model.hidden(tokens, positions, None, paged)`
prefills (T prompt tokens) and decodes (T = 1). Page ids are chosen on the host (kv_pool.py); rows
may share physical pages (GRPO prefix sharing) as long as they never write into a shared page.
Under the engine's data shards (device.py) each shard's program sees only its own pages and rows,
with shard-local page ids, so every read and write here stays on the device that holds the page.

Dimension letters (those of models/layers.py, plus):
  L layers  P pages in the pool  S slots per page (page_size)  M max pages per row
  C pages per block of the fast loop  W = C * S keys per block

Five read paths, chosen by the static `impl`:
  reference  gather each row's M pages into a dense [B, M*S, K, H] and call layers.gqa_attention
             with mask s <= position (and page assigned). Obviously right; reads M*S keys per row.
  bucketed   (the engine's fallback on GPU where the Pallas kernel does not run) for decode (T == 1), one masked
             softmax over the first n pages of every row, n = the longest row's page count rounded up to a
             power of two, chosen by a `lax.switch` over the log2(M) + 1 static widths. No loop: one gather and
             two matmuls; with `fold_heads` (the engine's choice on CPU, see below) the KV heads fold into the
             key axis.
  pallas     for decode, one Pallas kernel reading pages in place (pallas_paged.py; interpret mode
             off GPU, so on CPU it is a test of the kernel, not a fast path).
  fast       for decode, a `while_loop` over blocks of C pages, up to the most pages any row uses,
             with an online (flash-style) fp32 softmax masked per row beyond its own position.
  window     (the engine's default on CPU) for a decode chunk (device.generate): each row's first n pages of
             every layer are gathered once, when the chunk starts, into contiguous per-layer arrays, keys
             [B, K, H, n*S] and values [B, K, n*S, H] (`open_window`; n: a power of two or M, the fewest pages
             holding a bound on the next position any slot's row can write (host_state.window_pages), and never
             fewer than `window_min_pages` (EngineConfig.min_window_tokens, 64 tokens by default); the
             chunk ends before a row outgrows them, and the next opens twice as wide). Each step appends its
             token's K/V there (and to the pool) and reads, in place, the window's first pages, as many as
             `bucketed` would read at that step, or the floor if wider (a `lax.switch` over the widths
             below n; the steps at width n itself run in a second loop with no switch, `window_full`: an
             XLA:CPU conditional costs ~8 us a layer, most of a batch-1 step), the kv head leading both dots,
             so no step gathers (keys [B, K, H, W], not [B, K, W, H]: XLA:CPU ran the q.k dot over the minor
             axis 2x slower). Reading bucketed's width, not the
             window's, keeps a row's bits a function of the positions decoded, as bucketed's are: the window's
             width follows where chunks end, and XLA:CPU rounds a softmax or a dot over more columns, masked
             zeros included, differently (tests/test_paged.py). On a 2-core CPU this removed most of the
             read's cost at small batch and short contexts (benchmarks/RESULTS.md). Its prices: one decode
             program per (rows, n) pair met (holding the step twice, one per loop; once at the floor, which has no
             narrower width: the floor is there to cut those programs), and the chunk's rows held a
             second time, in the compute dtype.
             Outside an open window it reads as reference.
  Prefill (T > 1) always takes the reference path.
All reads index (layer, page) in one gather on the whole [L, P, S, K, H] pool: slicing the layer out
first (`k_LPSKH[layer]`) copies the layer's whole pool every step, so a step cost as much as the
pool is big (measured 7.9 / 73 / 199 ms at 256 / 2,048 / 8,192 pages; flat after the change).
A row with position < 0 (an idle decode slot) writes nothing, reads no page and adds no width.
Why bucketed/fast are fast: bytes read per layer ∝ max_b(len_b) * K * H, not M * S * K * H; with M sized
for the longest possible completion and most rows far shorter, that is the difference between
reading the cache you have and the cache you might have. Every row pays for the longest row
(masked, not skipped). On a 2-core CPU each while-loop trip costs a few small kernels, so `fast`
loses to `bucketed` there (tiny preset, 16 slots, ~64-token contexts: 0.30 ms a step against 0.9);
on GPU a fused Pallas kernel that reads pages in place removes the gather copy altogether.
Note for anyone wrapping a decode step: a `lax.cond` whose branches carry the pool (e.g. to skip
idle steps) makes XLA copy the whole pool every step; device.generate stops early with a
`while_loop` condition instead.

Writes: each token's K/V is scattered to (page, slot). A position whose page is -1 (unassigned:
padding rows, prefill right-padding past the row's pages, positions >= M*S) is mapped to page
index P, out of range, and dropped by `mode="drop"`. (Left as -1 it would wrap to page P-1.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.models.layers import gqa_attention

IMPLS = ("reference", "fast", "bucketed", "pallas", "window")
READS = ("auto", *IMPLS)  # what a config, EngineConfig.impl or a launcher's --read may name


def check_read(value: str, name: str) -> None:
  """Refuses a decode read that is none of READS, naming the setting (`name`: rollout.impl, read, ...)."""
  if value not in READS:
    raise ValueError(f"{name}={value!r}; expected one of {READS}")
# The launchers' --read flag (generate.py, serve.py): "auto" or one of IMPLS.
READ_HELP = ("The engine's paged decode read (rollout/paged.py): auto = window on CPU, the Pallas kernel on GPU "
             "where it works, else bucketed.")
_MASKED = -1e30  # finite, as in layers.py: masked logits never make inf - inf = NaN


@struct.dataclass
class PagedKVCache:
  """The pool and the page table; `attend` is pure (old -> new), so a decode step can donate it."""

  k_LPSKH: jax.Array
  v_LPSKH: jax.Array
  table_BM: jax.Array  # int32 page ids; -1 = unassigned
  page_size: int = struct.field(pytree_node=False)
  impl: str = struct.field(pytree_node=False, default="fast")
  block_tokens: int = struct.field(pytree_node=False, default=128)  # keys per fast-loop block (≥ 1 page)
  # bucketed: read the KV heads folded into the key axis (below); never where KV heads are split over devices
  fold_heads: bool = struct.field(pytree_node=False, default=False)
  # window: per-layer copies of every row's first n pages, open for one decode chunk (below): keys [B, K, H, n*S]
  # (the q.k dot's contraction over H then reads rows, not columns), values [B, K, n*S, H]
  window_k: tuple | None = None
  window_v: tuple | None = None
  # window: every step reads the whole open window (device.generate runs such steps only while the bucketed width
  # is the window's), so no step needs the switch over narrower widths
  window_full: bool = struct.field(pytree_node=False, default=False)
  # window: no read narrower than this many pages (a power of two, or M): windows of fewer never open, so a
  # config compiles fewer window programs (EngineConfig.min_window_tokens); 1 = bucketed's widths
  window_min_pages: int = struct.field(pytree_node=False, default=1)
  # pallas: programs a row's page walk is divided over (pallas_paged.decode_attention); 0 = the kernel's default
  pallas_splits: int = struct.field(pytree_node=False, default=0)

  @classmethod
  def zeros(cls, cfg: ModelConfig, n_pages: int, page_size: int, max_pages_per_seq: int, batch: int,
            dtype=None, impl: str = "fast", block_tokens: int = 128, fold_heads: bool = False,
            window_min_pages: int = 1, pallas_splits: int = 0) -> PagedKVCache:
    """An all-zero pool and an all -1 table (the host allocator fills `table_BM`)."""
    if impl not in IMPLS:
      raise ValueError(f"PagedKVCache impl={impl!r}; expected one of {IMPLS}")
    if min(n_pages, page_size, max_pages_per_seq, batch, block_tokens) <= 0:
      raise ValueError(f"PagedKVCache sizes must be positive: n_pages={n_pages} page_size={page_size} "
                       f"max_pages_per_seq={max_pages_per_seq} batch={batch} block_tokens={block_tokens}")
    shape = (cfg.n_layers, n_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
    dtype = dtype or jnp.dtype(cfg.dtype)
    return cls(k_LPSKH=jnp.zeros(shape, dtype), v_LPSKH=jnp.zeros(shape, dtype),
               table_BM=jnp.full((batch, max_pages_per_seq), -1, jnp.int32), page_size=page_size, impl=impl,
               block_tokens=block_tokens, fold_heads=fold_heads, window_min_pages=window_min_pages,
               pallas_splits=pallas_splits)

  @property
  def n_pages(self) -> int:
    return self.k_LPSKH.shape[1]

  def page_of(self, positions_BT):
    """Page id holding each position, -1 where unassigned (including positions < 0 or >= M*S)."""
    idx_BT = positions_BT // self.page_size
    valid_BT = (positions_BT >= 0) & (idx_BT < self.table_BM.shape[1])
    page_BT = jnp.take_along_axis(self.table_BM, jnp.where(valid_BT, idx_BT, 0), axis=1)
    return jnp.where(valid_BT, page_BT, -1)

  def write(self, layer: int, k_BTKH, v_BTKH, positions_BT) -> PagedKVCache:
    """Scatters this layer's new K/V to (page, slot); tokens on unassigned pages are dropped."""
    page_BT = self.page_of(positions_BT)
    page_BT = jnp.where(page_BT < 0, self.n_pages, page_BT)  # out of range -> dropped, never wrapped
    slot_BT = positions_BT % self.page_size
    k = self.k_LPSKH.at[layer, page_BT, slot_BT].set(k_BTKH.astype(self.k_LPSKH.dtype), mode="drop")
    v = self.v_LPSKH.at[layer, page_BT, slot_BT].set(v_BTKH.astype(self.v_LPSKH.dtype), mode="drop")
    return self.replace(k_LPSKH=k, v_LPSKH=v)

  def open_window(self, n_pages: int, dtype, written_B) -> PagedKVCache:
    """impl "window": gathers every row's first `n_pages` pages of each layer once, into per-layer arrays of
    `dtype` (the compute dtype), keys [B, K, H, W] and values [B, K, W, H] for W = n_pages*S. Decode steps then
    append to them and read them in place; the caller covers every page a row may touch while the window is open
    (device.generate). Values at columns >= `written_B` (each row's next write; stale or unassigned there) are
    zeroed once here, so the steps' reads need no mask on them (see `_zero_hidden`)."""
    pages_Bn = jnp.maximum(self.table_BM[:, :n_pages], 0)  # unassigned: page 0, never visible (s <= pos)
    B, n = pages_Bn.shape
    _, _, S, K, H = self.k_LPSKH.shape
    written_B1W1 = (jnp.arange(n * S)[None, :] < written_B[:, None])[:, None, :, None]

    def layers(x_LPSKH, order: tuple[int, ...]):  # from [B, n*S, K, H]
      return tuple(x_LPSKH[i, pages_Bn].reshape(B, n * S, K, H).transpose(order).astype(dtype)
                   for i in range(x_LPSKH.shape[0]))
    window_v = tuple(_zero_hidden(x, written_B1W1) for x in layers(self.v_LPSKH, (0, 2, 1, 3)))
    return self.replace(window_k=layers(self.k_LPSKH, (0, 2, 3, 1)), window_v=window_v, window_full=False)

  def close_window(self) -> PagedKVCache:
    return self.replace(window_k=None, window_v=None, window_full=False)

  def attend(self, layer: int, q_BTNH, k_BTKH, v_BTKH, positions_BT):
    """Stores this layer's new keys/values at `positions_BT`, then attends over s <= position."""
    new = self.write(layer, k_BTKH, v_BTKH, positions_BT)
    if self.window_k is not None and q_BTNH.shape[1] == 1:
      return _attend_window(new, layer, q_BTNH, k_BTKH, v_BTKH, positions_BT[:, 0])
    # The reads index (layer, page) in one gather on the whole pool: slicing `k_LPSKH[layer]` first
    # would copy the layer's entire pool every step (inside a loop XLA cannot fuse the slice away).
    if self.impl == "pallas" and q_BTNH.shape[1] == 1:
      from jaxrl_topo.rollout.pallas_paged import decode_attention  # Pallas imports only when used

      out_BNH = decode_attention(q_BTNH[:, 0], new.k_LPSKH, new.v_LPSKH, self.table_BM, positions_BT[:, 0],
                                 layer=layer, page_size=self.page_size, splits=self.pallas_splits or None)
      return out_BNH[:, None], new
    if self.impl == "bucketed" and q_BTNH.shape[1] == 1:
      out_BNH = _decode_bucketed(q_BTNH[:, 0], new.k_LPSKH, new.v_LPSKH, layer, self.table_BM, positions_BT[:, 0],
                                 self.page_size, self.fold_heads)
      return out_BNH[:, None], new
    if self.impl == "fast" and q_BTNH.shape[1] == 1:
      out_BNH = _decode_blocks(q_BTNH[:, 0], new.k_LPSKH, new.v_LPSKH, layer, self.table_BM, positions_BT[:, 0],
                               self.page_size, self.block_tokens)
      return out_BNH[:, None], new
    return _reference(q_BTNH, new.k_LPSKH, new.v_LPSKH, layer, self.table_BM, positions_BT, self.page_size), new


def _attend_window(new: PagedKVCache, layer: int, q_BTNH, k_BTKH, v_BTKH, pos_B):
  """One decode step through the open window: the token's K/V (rounded to the pool's dtype, as a read of the
  pool would see them) appended at column pos, then one masked softmax over the window's first n pages, n the
  width `bucketed` would read (the longest live row's pages rounded up to a power of two, at most M; a
  `lax.switch` over the widths up to the window's). So a row's bits follow the positions decoded, never the
  window's width, which follows where chunks end: two runs that chunk differently agree bit for bit. (Over the
  whole window they did not: XLA:CPU rounds a dot or a sum over 128 columns differently from the same values
  over 64 followed by zeros.) Rows with pos < 0 (idle) write nothing and read nothing."""
  k_BKHW, v_BKWH = new.window_k[layer], new.window_v[layer]
  B, K, W, H = v_BKWH.shape
  S, M = new.page_size, new.table_BM.shape[1]
  col_B1 = jnp.where((pos_B >= 0) & (pos_B < W), pos_B, W)[:, None]  # past the window: dropped
  b_B1, k_1K = jnp.arange(B)[:, None], jnp.arange(K)[None, :]
  as_pool = lambda x_BTKH, pool, like: x_BTKH[:, 0].astype(pool.dtype).astype(like.dtype)  # noqa: E731
  k_BKHW = k_BKHW.at[b_B1, k_1K, :, col_B1].set(as_pool(k_BTKH, new.k_LPSKH, k_BKHW), mode="drop")
  v_BKWH = v_BKWH.at[b_B1, k_1K, col_B1].set(as_pool(v_BTKH, new.v_LPSKH, v_BKWH), mode="drop")
  replace = lambda ws, x: ws[:layer] + (x,) + ws[layer + 1:]  # noqa: E731
  new = new.replace(window_k=replace(new.window_k, k_BKHW), window_v=replace(new.window_v, v_BKWH))

  def read(n: int, q_BNH):  # the first n pages; values there zeroed past each row's writes when the window opened
    return _attend_by_head(q_BNH, k_BKHW[..., : n * S], v_BKWH[:, :, : n * S],
                           jnp.arange(n * S)[None, :] <= pos_B[:, None], keys="BKHW", zero_hidden=False)

  if new.window_full:  # the step's bucketed width is the window's (device.generate): no switch
    return read(W // S, q_BTNH[:, 0])[:, None], new
  widths = window_widths(min(W // S, M), new.window_min_pages)
  out_BNH = jax.lax.switch(jnp.searchsorted(jnp.asarray(widths), pages_read(pos_B, S, M)),
                           [functools.partial(read, n) for n in widths], q_BTNH[:, 0])
  return out_BNH[:, None], new


def pages_read(pos_B, S: int, M: int):
  """The most pages any row holds (positions 0..pos; a row with pos < 0 none), at most M: `bucketed` reads this
  many rounded up to the next of `read_widths(M)`."""
  return jnp.max(jnp.clip(pos_B // S + 1, 0, M))


def read_widths(M: int) -> list[int]:
  """The page counts a bucketed read may take for rows of at most M pages: powers of two below M, and M."""
  return sorted({min(M, 1 << i) for i in range(max(1, M).bit_length() + 1)})


def window_widths(n_pages: int, min_pages: int) -> list[int]:
  """The widths an open window of n_pages pages reads at: `read_widths`' up to n_pages, none narrower than
  min_pages (a power of two or M; capped at n_pages). So a row reads max(bucketed's width, min_pages) pages in any
  window that holds them: its bits stay a function of the positions decoded, whatever the window."""
  return [w for w in read_widths(n_pages) if w >= min(min_pages, n_pages)]


def _attend_by_head(q_BNH, k, v, mask_BW, keys: str = "BWKH", zero_hidden: bool = True):
  """Masked softmax attention of one query per head, the kv head a batch dimension of both dots; a row with no
  visible key gives 0. `keys`: "BWKH" (keys and values as gathered from pages) or "BKHW" (an open window: keys
  [B, K, H, W], values [B, K, W, H]; both dots then read their operand in place, contracting a non-minor axis.
  With keys [B, K, W, H] the q.k dot contracts their minor axis, which XLA:CPU ran 2x slower: benchmarks/RESULTS.md).
  `zero_hidden=False` where `v` holds no non-finite value at a masked key (an open window), saving a pass over it."""
  B, N, H = q_BNH.shape
  K = k.shape[keys.index("K")]
  values = "BKWH" if keys == "BKHW" else keys
  q_BKGH = q_BNH.reshape(B, K, N // K, H)
  if zero_hidden:
    v = _zero_hidden(v, mask_BW[:, None, :, None] if values == "BKWH" else mask_BW[:, :, None, None])
  logits_BKGW = jnp.einsum(f"BKGH,{keys}->BKGW", q_BKGH, k, preferred_element_type=jnp.float32) * H**-0.5
  p_BKGW, l_BKG = _masked_softmax(logits_BKGW, mask_BW[:, None, None, :])
  out_BKGH = jnp.einsum(f"BKGW,{values}->BKGH", p_BKGW.astype(v.dtype), v, preferred_element_type=jnp.float32)
  out_BKGH = out_BKGH / jnp.where(l_BKG > 0, l_BKG, 1.0)[..., None]
  return out_BKGH.reshape(B, N, H).astype(q_BNH.dtype)


def _zero_hidden(v, visible):
  """v with the keys no query may see set to 0. A masked key's weight is exactly 0, but 0 * inf or 0 * NaN is
  NaN: a stale slot past a row's position, or page 0 read for an unassigned page, holds another sequence's
  values, and one non-finite value there would poison every row that reads the page. (In prefill the zeroing is
  per row, over what any of its queries sees: a row's own non-finite token still reaches its earlier positions,
  never another row.)"""
  return jnp.where(visible, v, jnp.zeros((), v.dtype))


def _masked_softmax(logits, mask):
  """(p, l): exp(logit - max) where visible (0 elsewhere), unnormalised, and its sum over the last axis."""
  logits = jnp.where(mask, logits, _MASKED)
  p = jnp.where(mask, jnp.exp(logits - logits.max(-1, keepdims=True)), 0.0)
  return p, p.sum(-1)


def _reference(q_BTNH, k_LPSKH, v_LPSKH, layer: int, table_BM, positions_BT, page_size: int):
  """Gathers every row's M pages of `layer` into a dense cache and runs layers.gqa_attention."""
  B, M = table_BM.shape
  _, _, S, K, H = k_LPSKH.shape
  pages_BM = jnp.maximum(table_BM, 0)  # unassigned pages are read (page 0) but masked below
  k_BSKH = k_LPSKH[layer, pages_BM].reshape(B, M * S, K, H).astype(q_BTNH.dtype)
  v_BSKH = v_LPSKH[layer, pages_BM].reshape(B, M * S, K, H).astype(q_BTNH.dtype)
  assigned_BS = jnp.repeat(table_BM >= 0, page_size, axis=1)
  mask_BTS = (jnp.arange(M * S)[None, None, :] <= positions_BT[:, :, None]) & assigned_BS[:, None, :]
  return gqa_attention(q_BTNH, k_BSKH, _zero_hidden(v_BSKH, mask_BTS.any(axis=1)[:, :, None, None]), mask_BTS)


def _decode_blocks(q_BNH, k_LPSKH, v_LPSKH, layer: int, table_BM, pos_B, page_size: int, block_tokens: int):
  """One query per row; online softmax over blocks of C pages, only as many blocks as the longest row.
  A row with pos < 0 (an idle decode slot) reads nothing and adds no trips.

  m = running max logit, l = running sum of exp(logit - m), acc = running sum of exp(logit - m) v;
  a new block rescales (l, acc) by exp(m_old - m_new). out = acc / l (0 for a row with no keys).
  """
  B, N, H = q_BNH.shape
  _, _, S, K, _ = k_LPSKH.shape
  M = table_BM.shape[1]
  C = max(1, min(M, block_tokens // S))
  n_blocks = -(-M // C)
  table_BM = jnp.pad(table_BM, ((0, 0), (0, n_blocks * C - M)), constant_values=-1)
  q_BKGH = q_BNH.reshape(B, K, N // K, H)
  used_B = jnp.clip(pos_B // S + 1, 0, M)  # pages holding positions 0..pos
  trips = (jnp.max(used_B) + C - 1) // C  # dynamic: blocks past every row's length are never read

  def block(j, carry):
    m_BKG, l_BKG, acc_BKGH = carry
    pages_BC = jax.lax.dynamic_slice_in_dim(table_BM, j * C, C, axis=1)
    k_BWKH = k_LPSKH[layer, jnp.maximum(pages_BC, 0)].reshape(B, C * S, K, H).astype(q_BNH.dtype)
    v_BWKH = v_LPSKH[layer, jnp.maximum(pages_BC, 0)].reshape(B, C * S, K, H).astype(q_BNH.dtype)
    s_W = j * C * S + jnp.arange(C * S)
    mask_BW = (s_W[None, :] <= pos_B[:, None]) & jnp.repeat(pages_BC >= 0, S, axis=1)
    v_BWKH = _zero_hidden(v_BWKH, mask_BW[:, :, None, None])
    logits_BKGW = jnp.einsum("BKGH,BWKH->BKGW", q_BKGH, k_BWKH, preferred_element_type=jnp.float32) * H**-0.5
    logits_BKGW = jnp.where(mask_BW[:, None, None, :], logits_BKGW, _MASKED)
    m_new_BKG = jnp.maximum(m_BKG, logits_BKGW.max(axis=-1))
    p_BKGW = jnp.where(mask_BW[:, None, None, :], jnp.exp(logits_BKGW - m_new_BKG[..., None]), 0.0)
    scale_BKG = jnp.exp(m_BKG - m_new_BKG)
    pv_BKGH = jnp.einsum("BKGW,BWKH->BKGH", p_BKGW.astype(v_BWKH.dtype), v_BWKH,
                         preferred_element_type=jnp.float32)
    return m_new_BKG, l_BKG * scale_BKG + p_BKGW.sum(-1), acc_BKGH * scale_BKG[..., None] + pv_BKGH

  G = N // K
  init = (jnp.full((B, K, G), _MASKED, jnp.float32), jnp.zeros((B, K, G), jnp.float32),
          jnp.zeros((B, K, G, H), jnp.float32))
  _, l_BKG, acc_BKGH = jax.lax.fori_loop(0, trips, block, init)
  out_BKGH = acc_BKGH / jnp.where(l_BKG > 0, l_BKG, 1.0)[..., None]
  return out_BKGH.reshape(B, N, H).astype(q_BNH.dtype)


def _decode_bucketed(q_BNH, k_LPSKH, v_LPSKH, layer: int, table_BM, pos_B, page_size: int, fold_heads: bool):
  """One query per row; one masked softmax over the first n pages of every row, n = the longest
  row's page count rounded up to a power of two (a `lax.switch` over log2(M) + 1 static widths).
  No loop: one gather and two matmuls, reading at most twice the longest row's pages."""
  M = table_BM.shape[1]
  S = page_size
  widths = read_widths(M)
  branch = jnp.searchsorted(jnp.asarray(widths), pages_read(pos_B, S, M))  # first width >= it (0 -> width 1)

  read = _read_folded if fold_heads else _read_by_head
  branches = [functools.partial(read, k_LPSKH=k_LPSKH, v_LPSKH=v_LPSKH, layer=layer, pages_Bn=table_BM[:, :n],
                                pos_B=pos_B, S=S) for n in widths]
  return jax.lax.switch(branch, branches, q_BNH)


def _read_by_head(q_BNH, k_LPSKH, v_LPSKH, layer: int, pages_Bn, pos_B, S: int):
  """The bucketed read over pages `pages_Bn`, the kv head a batch dimension of both dots."""
  B, _, H = q_BNH.shape
  n, K = pages_Bn.shape[1], k_LPSKH.shape[3]
  k_BWKH = k_LPSKH[layer, jnp.maximum(pages_Bn, 0)].reshape(B, n * S, K, H).astype(q_BNH.dtype)
  v_BWKH = v_LPSKH[layer, jnp.maximum(pages_Bn, 0)].reshape(B, n * S, K, H).astype(q_BNH.dtype)
  mask_BW = (jnp.arange(n * S)[None, :] <= pos_B[:, None]) & jnp.repeat(pages_Bn >= 0, S, axis=1)
  return _attend_by_head(q_BNH, k_BWKH, v_BWKH, mask_BW)


# The bucketed read folds the KV-head axis into the key axis: a gathered [B, n, S, K, H] block is read as
# [B, T = n*S*K, H] (key t is slot t // K of kv head t % K) with no transpose, and every query head scores
# all T keys, the other heads' keys masked out. That multiplies the attention FLOPs and logits by K (2x at
# K = 2, small next to the weights), but the dots take the gathered block as it lies; with keys laid out
# [B, W, K, H] and the kv head as a dot batch dimension, XLA:CPU copies each gathered block into dot layout.
# Measured (benchmarks/RESULTS.md): the decode step 1.4x faster at 1,024-token contexts, the same within
# noise at 64-256 (there the gather itself, at copy bandwidth, is the cost). The engine folds only where
# that was measured: on CPU (on GPU the Pallas kernel is the default) and with K <= 2 (at K = 8 the K-fold
# attention FLOPs would rival the weights' at long contexts); never where KV heads are split over `tensor`:
# merging a split axis into the key axis makes GSPMD all-gather each layer's gathered block (batch x width)
# across devices at every step.


def _read_folded(q_BNH, k_LPSKH, v_LPSKH, layer: int, pages_Bn, pos_B, S: int):
  """The bucketed read over pages `pages_Bn`, KV heads folded into the key axis."""
  k_BTH = _gather_folded(k_LPSKH, layer, pages_Bn, q_BNH.dtype)
  v_BTH = _gather_folded(v_LPSKH, layer, pages_Bn, q_BNH.dtype)
  mask_BNT = _folded_mask(q_BNH, pages_Bn, pos_B, k_LPSKH.shape[3], S)
  return _attend_folded(q_BNH, k_BTH, _zero_hidden(v_BTH, mask_BNT.any(axis=1)[:, :, None]), mask_BNT)


def _gather_folded(x_LPSKH, layer: int, pages_Bn, dtype):
  """Row b's pages `pages_Bn[b]` of `layer` as [B, n*S*K, H] (unassigned pages read page 0, masked later)."""
  B, n = pages_Bn.shape
  _, _, S, K, H = x_LPSKH.shape
  return x_LPSKH[layer, jnp.maximum(pages_Bn, 0)].reshape(B, n * S * K, H).astype(dtype)


def _folded_mask(q_BNH, pages_Bn, pos_B, K: int, S: int):
  """[B, N, T]: key t (slot s = t // K of kv head t % K) is visible to query head j of row b when s <= pos_b,
  its page is assigned and t % K is j's kv head (j // G)."""
  N = q_BNH.shape[1]
  t_T = jnp.arange(pages_Bn.shape[1] * S * K)
  seen_BT = (t_T[None, :] // K <= pos_B[:, None]) & jnp.repeat(pages_Bn >= 0, S * K, axis=1)
  head_NT = (t_T[None, :] % K) == (jnp.arange(N) // (N // K))[:, None]
  return seen_BT[:, None, :] & head_NT[None]


def _attend_folded(q_BNH, k_BTH, v_BTH, mask_BNT):
  """Masked softmax attention of one query per head over folded keys; a row with no visible key gives 0."""
  H = q_BNH.shape[-1]
  logits_BNT = jnp.einsum("BNH,BTH->BNT", q_BNH, k_BTH, preferred_element_type=jnp.float32) * H**-0.5
  p_BNT, l_BN = _masked_softmax(logits_BNT, mask_BNT)
  out_BNH = jnp.einsum("BNT,BTH->BNH", p_BNT.astype(v_BTH.dtype), v_BTH, preferred_element_type=jnp.float32)
  return (out_BNH / jnp.where(l_BN > 0, l_BN, 1.0)[..., None]).astype(q_BNH.dtype)
