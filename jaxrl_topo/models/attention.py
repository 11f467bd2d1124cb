"""Self-attention over packed rows in O(T) memory: a blockwise (flash-style) kernel in plain JAX.

Training and the trainer's log-prob passes attend causally inside packed segments: query t sees key
s iff s <= t and seg[s] == seg[t]. The dense reference (`layers.gqa_attention` with
`layers.causal_segment_mask`) builds fp32 logits [B, K, G, T, T] per layer, so scratch grows with
T^2 (14.6 GB at 2,048 tokens for a 4-layer d=256 model with 8 rows). Here the rows are cut into
blocks of `block` tokens and, for each query block, the key blocks up to the diagonal are visited
with an online softmax (running max m, running sum l, rescaled accumulator), so the largest live
tensor is one [B, K, G, block, block] tile. Key blocks past the diagonal are never visited (causal
halves the work). GQA reads each of the K kv heads for its G query heads without repeating K/V.

The backward pass is a custom VJP that recomputes each tile from the saved log-sum-exp (as in
FlashAttention-2, arXiv 2307.08691): per key block j, the query blocks i >= j are visited, dK_j and
dV_j accumulate in registers-as-carry and dQ in one [B, T, N, H] fp32 buffer. Residuals are q, k,
v, the output and the log-sum-exp: O(T) memory in the forward and the backward.

`attention(...)` chooses the implementation by name (ModelConfig.attention; a run's `model.attention=auto`, the
default, is resolved by `training_attention`):
  flash      this module (any backend, any shape)
  reference  the dense masked softmax (quadratic; the obviously-correct baseline tests compare to)
  xla        jax.nn.dot_product_attention with the segment mask (implementation="xla")
  cudnn      jax.nn.dot_product_attention(implementation="cudnn") on GPU: needs fp16/bf16 inputs and
             head_dim a multiple of 8; padded rows only (causal + per-row valid lengths), no packing
Letters as in layers.py; the tile letters t (query block) and s (key block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_topo.models import layers
from jaxrl_topo.models.config import ATTENTION_IMPLS

IMPLEMENTATIONS = ATTENTION_IMPLS
_MASKED = -1e30  # finite: a tile whose entries are all masked keeps a finite running max


def _blocked(x, nb: int, bs: int):
  """[B, T, ...] -> [nb, B, bs, ...] (block index leading, for scans and dynamic indexing)."""
  B = x.shape[0]
  return jnp.moveaxis(x.reshape(B, nb, bs, *x.shape[2:]), 1, 0)


def _tile_mask(seg_q_Bt, seg_k_Bs, i, j, bs: int):
  """[B, 1, 1, t, s]: key s of block j is visible from query t of block i (causal, same segment)."""
  tq = i * bs + jnp.arange(bs)
  tk = j * bs + jnp.arange(bs)
  same_Bts = seg_q_Bt[:, :, None] == seg_k_Bs[:, None, :]
  return (same_Bts & (tk[None, None, :] <= tq[None, :, None]))[:, None, None]


def _scores(q_BtKGH, k_BsKH, scale: float):
  return jnp.einsum("BtKGH,BsKH->BKGts", q_BtKGH, k_BsKH, preferred_element_type=jnp.float32) * scale


def _forward_blocks(q_nBtKGH, k_nBsKH, v_nBsKH, seg_nBt, scale: float):
  """(out_nBtKGH fp32, lse_nBKGt): for each query block, an online softmax over key blocks 0..i."""
  nb, B, bs, K, G, H = q_nBtKGH.shape

  def query_block(i):
    q, seg_q = q_nBtKGH[i], seg_nBt[i]

    def key_block(j, carry):
      m, l, acc = carry
      s = _scores(q, k_nBsKH[j], scale)
      s = jnp.where(_tile_mask(seg_q, seg_nBt[j], i, j, bs), s, _MASKED)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      corr = jnp.exp(m - m_new)
      l = l * corr + p.sum(-1)
      pv = jnp.einsum("BKGts,BsKH->BKGtH", p.astype(v_nBsKH.dtype), v_nBsKH[j], preferred_element_type=jnp.float32)
      return m_new, l, acc * corr[..., None] + pv

    init = (jnp.full((B, K, G, bs), _MASKED, jnp.float32), jnp.zeros((B, K, G, bs), jnp.float32),
            jnp.zeros((B, K, G, bs, H), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
    out_BKGtH = acc / l[..., None]  # l >= 1: query t always sees itself
    return jnp.einsum("BKGtH->BtKGH", out_BKGtH), m + jnp.log(l)

  return jax.lax.map(query_block, jnp.arange(nb))


def _backward_blocks(q, k, v, seg, out, lse, d_out, scale: float):
  """(dq, dk, dv) in blocked layout, fp32; per key block j, the query blocks i >= j."""
  nb, B, bs, K, G, H = q.shape
  delta_nBKGt = jnp.einsum("nBtKGH,nBtKGH->nBKGt", d_out, out)  # rowsum(dO * O)

  def key_block(dq, j):
    k_j, v_j, seg_k = k[j], v[j], seg[j]

    def query_block(i, carry):
      dq, dk_j, dv_j = carry
      s = _scores(q[i], k_j, scale)
      mask = _tile_mask(seg[i], seg_k, i, j, bs)
      p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
      dv_j = dv_j + jnp.einsum("BKGts,BtKGH->BsKH", p, d_out[i])
      dp = jnp.einsum("BtKGH,BsKH->BKGts", d_out[i], v_j.astype(jnp.float32))
      ds = p * (dp - delta_nBKGt[i][..., None]) * scale
      dq = dq.at[i].add(jnp.einsum("BKGts,BsKH->BtKGH", ds, k_j.astype(jnp.float32)))
      dk_j = dk_j + jnp.einsum("BKGts,BtKGH->BsKH", ds, q[i].astype(jnp.float32))
      return dq, dk_j, dv_j

    zeros = jnp.zeros((B, bs, K, H), jnp.float32)
    dq, dk_j, dv_j = jax.lax.fori_loop(j, nb, query_block, (dq, zeros, zeros))
    return dq, (dk_j, dv_j)

  dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(nb))
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q_nBtKGH, k_nBsKH, v_nBsKH, seg_nBt, scale: float):
  out, _ = _forward_blocks(q_nBtKGH, k_nBsKH, v_nBsKH, seg_nBt, scale)
  return out.astype(q_nBtKGH.dtype)


def _flash_fwd(q, k, v, seg, scale):
  out, lse = _forward_blocks(q, k, v, seg, scale)
  out = out.astype(q.dtype)
  return out, (q, k, v, seg, out, lse)


def _flash_bwd(scale, res, d_out):
  q, k, v, seg, out, lse = res
  dq, dk, dv = _backward_blocks(q, k, v, seg, out.astype(jnp.float32), lse, d_out.astype(jnp.float32), scale)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, *, block: int = 128):
  """Causal attention within segments, blockwise: equal to the reference, O(T) memory (module doc)."""
  B, T, N, H = q_BTNH.shape
  K = k_BTKH.shape[2]
  bs = min(block, T)
  nb = -(-T // bs)
  pad = nb * bs - T
  if pad:  # padded keys sit after every real query (causal hides them); padded queries are dropped
    widths = lambda x: ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)
    q_BTNH, k_BTKH, v_BTKH = (jnp.pad(x, widths(x)) for x in (q_BTNH, k_BTKH, v_BTKH))
    segment_ids_BT = jnp.pad(segment_ids_BT, ((0, 0), (0, pad)), constant_values=-1)
  q = _blocked(q_BTNH.reshape(B, nb * bs, K, N // K, H), nb, bs)
  k, v, seg = (_blocked(x, nb, bs) for x in (k_BTKH, v_BTKH, segment_ids_BT.astype(jnp.int32)))
  out_nBtKGH = _flash(q, k, v, seg, float(H) ** -0.5)
  return jnp.moveaxis(out_nBtKGH, 0, 1).reshape(B, nb * bs, N, H)[:, :T]


def cached_attention(q_BTNH, k_BSKH, v_BSKH, positions_BT, *, block: int = 256):
  """Queries at `positions_BT` over a contiguous cache (key s holds position s, visible iff s <= position),
  as an online softmax over key blocks: the largest live tensor is [B, K, G, T, block], not [.., T, S].
  Forward only (prefill and decode never differentiate). Equal to gqa_attention with the s <= t mask."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  bs = min(block, S)
  nb = -(-S // bs)
  if nb * bs != S:  # padded keys get positions past every query: masked
    widths = ((0, 0), (0, nb * bs - S), (0, 0), (0, 0))
    k_BSKH, v_BSKH = jnp.pad(k_BSKH, widths), jnp.pad(v_BSKH, widths)
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  k_nBsKH, v_nBsKH = _blocked(k_BSKH, nb, bs), _blocked(v_BSKH, nb, bs)
  scale = float(H) ** -0.5

  def key_block(carry, xs):
    m, l, acc = carry
    j, k_BsKH, v_BsKH = xs
    visible_BTs = (j * bs + jnp.arange(bs))[None, None, :] <= positions_BT[:, :, None]
    s = jnp.where(visible_BTs[:, None, None], _scores(q_BTKGH, k_BsKH, scale), _MASKED)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("BKGts,BsKH->BKGtH", p.astype(v_BsKH.dtype), v_BsKH, preferred_element_type=jnp.float32)
    return (m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv), None

  init = (jnp.full((B, K, N // K, T), _MASKED, jnp.float32), jnp.zeros((B, K, N // K, T), jnp.float32),
          jnp.zeros((B, K, N // K, T, H), jnp.float32))
  (_, l, acc), _ = jax.lax.scan(key_block, init, (jnp.arange(nb), k_nBsKH, v_nBsKH))
  out_BKGTH = acc / l[..., None]
  return jnp.einsum("BKGTH->BTKGH", out_BKGTH).reshape(B, T, N, H).astype(q_BTNH.dtype)


def _dot_product(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, implementation: str):
  if implementation == "cudnn":  # causal over each row's valid prefix: cuDNN takes no segment mask
    lengths_B = jnp.sum(segment_ids_BT != 0, axis=1).astype(jnp.int32)
    return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True, query_seq_lengths=lengths_B,
                                        key_value_seq_lengths=lengths_B, implementation="cudnn")
  mask_B1TS = layers.causal_segment_mask(segment_ids_BT)[:, None]
  return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, mask=mask_B1TS, implementation="xla")


def training_attention(requested: str, *, platform: str, dtype: str, packed: bool, head_dim: int,
                       compute_capability: str | None = None) -> str:
  """The implementation a run trains with: `requested`, unless it is "auto": cuDNN on a GPU where its limits allow
  (an Ampere or newer GPU, bf16 compute, padded rows, head_dim a multiple of 8 and at most 128; measured 6.6x
  faster than flash at 128-token tiles on an H200, benchmarks/RESULTS.md), else flash (packed rows, fp32, CPU)."""
  if requested == "cudnn" and platform != "gpu":  # before: "cuDNN is not detected" from JAX, inside the warm-up
    raise ValueError(f"model.attention='cudnn' runs on a GPU only (the trainer's devices are {platform}): use "
                     "'auto' (cuDNN where it can run), 'flash' or 'xla'")
  if requested != "auto":
    return requested
  try:  # CUDA's "9.0"; None, or a ROCm GPU's "gfx90a": no cuDNN
    ampere = float(compute_capability) >= 8.0
  except (TypeError, ValueError):
    ampere = False
  fits = dtype == "bfloat16" and not packed and head_dim % 8 == 0 and head_dim <= 128
  return "cudnn" if platform == "gpu" and ampere and fits else "flash"


def attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, *, impl: str = "flash", block: int = 128):
  """Causal self-attention inside packed segments (seg 0 = padding), by implementation name."""
  if impl == "flash":
    return flash_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, block=block)
  if impl == "reference":
    return layers.gqa_attention(q_BTNH, k_BTKH, v_BTKH, layers.causal_segment_mask(segment_ids_BT))
  if impl in ("xla", "cudnn"):
    return _dot_product(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, impl)
  raise ValueError(f"attention implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
