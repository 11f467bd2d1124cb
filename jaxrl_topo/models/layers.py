"""Pure math of the decoder: RMSNorm, rotary embeddings, grouped-query attention, a dense KV cache.

Dimension letters, used as name suffixes throughout models/:
  B batch  T query length  S key length  D d_model  N query heads  K kv heads  G = N // K
  H head dim  F mlp inner  V vocab  L layers
Norms, softmax and rotary angles are computed in float32 whatever the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl_topo.models.config import ModelConfig, RopeScaling

_MASKED = -1e30  # finite, so a fully masked row gives a uniform softmax rather than NaN


def rms_norm(x, scale, eps: float):
  """y = x / sqrt(mean(x^2) + eps) * scale, in float32, cast back to x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * lead_dims(scale.astype(jnp.float32), y.ndim)).astype(x.dtype)


def lead_dims(w, ndim: int):
  """`w` with leading unit dims up to `ndim` (explicit broadcasting: tests run with rank promotion off)."""
  return w.reshape((1,) * (ndim - w.ndim) + w.shape)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """Inverse frequencies theta^(-2i/H), i < H/2, with Llama-3's wavelength-dependent scaling:
  wavelengths shorter than orig/high_freq_factor are kept, longer than orig/low_freq_factor are
  divided by `factor`, and the band between is interpolated linearly in orig/wavelength."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is None:
    return inv_freq.astype(np.float32)
  orig, low, high = scaling.original_max_position, scaling.low_freq_factor, scaling.high_freq_factor
  wavelen = 2 * np.pi / inv_freq
  smooth = (orig / wavelen - low) / (high - low)
  mid = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  out = np.where(wavelen > orig / low, inv_freq / scaling.factor, inv_freq)
  out = np.where((wavelen <= orig / low) & (wavelen >= orig / high), mid, out)
  return out.astype(np.float32)


def rope_angles(positions_BT, cfg: ModelConfig):
  """(cos_BTH, sin_BTH) for the rotate-half convention, float32."""
  inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
  freqs_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
  freqs_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)
  return jnp.cos(freqs_BTH), jnp.sin(freqs_BTH)


def apply_rope(x_BTnH, cos_BTH, sin_BTH):
  """x*cos + rotate_half(x)*sin with rotate_half([a, b]) = [-b, a]; n is N or K heads."""
  x32 = x_BTnH.astype(jnp.float32)
  a, b = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-b, a], axis=-1)
  out = x32 * cos_BTH[:, :, None, :] + rotated * sin_BTH[:, :, None, :]
  return out.astype(x_BTnH.dtype)


def gqa_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS):
  """softmax(q k^T / sqrt(H) masked) v with K kv heads shared by G = N/K query heads each."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  logits_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS * H**-0.5, _MASKED)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKH.dtype)
  out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH)
  return out_BTKGH.reshape(B, T, N, H)


def causal_segment_mask(segment_ids_BT):
  """mask[b, t, s] = s <= t and seg[b, s] == seg[b, t]: packed sequences never see each other."""
  T = segment_ids_BT.shape[1]
  causal_TS = jnp.tril(jnp.ones((T, T), dtype=bool))
  same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  return causal_TS[None] & same_BTS


@struct.dataclass
class DenseKVCache:
  """A contiguous KV cache: slot s of a row holds the token at position s.

  Writing at the query positions and masking keys to s <= position makes prefill and one-token
  decode the same code path. Entries past a row's position (right-padding of a prefill, say) are
  never read: the next decode step overwrites them before its own mask admits them.
  The caller sizes it: a position >= max_len is dropped on write (no error inside jit), so
  `generate_dense` allocates prompt bucket + max_new_tokens slots.
  """

  k_LBSKH: jax.Array
  v_LBSKH: jax.Array

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> DenseKVCache:
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    dtype = dtype or jnp.dtype(cfg.dtype)
    return cls(k_LBSKH=jnp.zeros(shape, dtype), v_LBSKH=jnp.zeros(shape, dtype))

  @property
  def max_len(self) -> int:
    return self.k_LBSKH.shape[2]

  def attend(self, layer: int, q_BTNH, k_BTKH, v_BTKH, positions_BT):
    """Stores this layer's new keys/values at `positions_BT`, then attends over s <= position."""
    B, T = positions_BT.shape
    b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    k_all = self.k_LBSKH.at[layer, b_BT, positions_BT].set(k_BTKH.astype(self.k_LBSKH.dtype), mode="drop")
    v_all = self.v_LBSKH.at[layer, b_BT, positions_BT].set(v_BTKH.astype(self.v_LBSKH.dtype), mode="drop")
    k_BSKH, v_BSKH = k_all[layer].astype(q_BTNH.dtype), v_all[layer].astype(q_BTNH.dtype)
    if T > 1:  # prefill: blockwise over the cache, O(T x block) scratch instead of O(T x max_len)
      from jaxrl_topo.models.attention import cached_attention
      out_BTNH = cached_attention(q_BTNH, k_BSKH, v_BSKH, positions_BT)
    else:
      mask_BTS = jnp.arange(self.max_len)[None, None, :] <= positions_BT[:, :, None]
      out_BTNH = gqa_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS)
    return out_BTNH, self.replace(k_LBSKH=k_all, v_LBSKH=v_all)
