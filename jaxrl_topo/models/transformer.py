"""The decoder-only transformer (Llama-3 / Qwen2 / Qwen3) as Flax NNX modules.

Module and attribute names mirror Hugging Face's (`layers.3.self_attn.q_proj`), so the checkpoint
mapping in hf_io.py is a table, not a search. Weights are stored head-split ([D, N, H] rather
than [D, N*H]) so `heads` and `head_dim` carry their own logical axis names. Every parameter has
a `logical_axes` metadata tuple; topology/rules.py maps those names to mesh axes.

The forward runs three ways through one code path:
  training   cache=None: causal attention within each packed segment (segment_ids, positions).
  prefill    cache given, T prompt tokens written at their positions.
  decode     cache given, T = 1.
The cache is any object with `attend(layer, q_BTNH, k_BTKH, v_BTKH, positions_BT) -> (out, cache)`,
so the paged rollout engine plugs in its own pool. Dimension letters are those of layers.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_topo.models import attention, layers
from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.topology.rules import ActivationSharding, constrain

_INIT_STD = 0.02


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, init: str = "normal") -> nnx.Param:
  if init == "normal":
    value = _INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
  else:
    value = (jnp.ones if init == "ones" else jnp.zeros)(shape, jnp.float32)
  return nnx.Param(value.astype(dtype), logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, axis: str, eps: float, dtype):
    self.weight = _param(None, (dim,), (axis,), dtype, init="ones")
    self.eps = eps

  def __call__(self, x):
    return layers.rms_norm(x, self.weight[...], self.eps)


class Projection(nnx.Module):
  """y = einsum(spec, x, kernel) (+ bias): a linear map over named, possibly head-split, dims.

  Computed as one dot_general contracting the shared dims in x's order (`contraction`): jnp.einsum
  contracts them in alphabetical order, so o_proj's "BTNH,NHD->BTD" contracted (H, N) and XLA
  transposed both operands, the whole [N, H, D] kernel included, at every call (every layer of every
  decode step: benchmarks/RESULTS.md)."""

  def __init__(self, rngs, spec: str, shape, axes, dtype, *, bias_dims: int = 0):
    self.spec = spec
    self.dims = contraction(spec)
    self.kernel = _param(rngs, shape, axes, dtype)
    self.bias = _param(None, shape[-bias_dims:], axes[-bias_dims:], dtype, init="zeros") if bias_dims else None

  def __call__(self, x):
    y = jax.lax.dot_general(x, self.kernel[...].astype(x.dtype), (self.dims, ((), ())))
    return y if self.bias is None else y + layers.lead_dims(self.bias[...].astype(x.dtype), y.ndim)


def contraction(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """dot_general contracting dims of a no-batch einsum `spec` ("BTNH,NHD->BTD": ((2, 3), (0, 1))), in the
  lhs's order; the output must be the lhs's free dims then the kernel's (dot_general's order)."""
  ins, out = spec.split("->")
  lhs, rhs = ins.split(",")
  shared = [c for c in lhs if c in rhs]
  if out != "".join(c for c in lhs if c not in shared) + "".join(c for c in rhs if c not in shared):
    raise ValueError(f"Projection spec {spec!r}: the output must list x's free dims, then the kernel's")
  return tuple(lhs.index(c) for c in shared), tuple(rhs.index(c) for c in shared)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    D, N, K, H, p = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
    b = 2 if cfg.qkv_bias else 0
    self.q_proj = Projection(rngs, "BTD,DNH->BTNH", (D, N, H), ("embed", "heads", "head_dim"), p, bias_dims=b)
    self.k_proj = Projection(rngs, "BTD,DKH->BTKH", (D, K, H), ("embed", "kv_heads", "head_dim"), p, bias_dims=b)
    self.v_proj = Projection(rngs, "BTD,DKH->BTKH", (D, K, H), ("embed", "kv_heads", "head_dim"), p, bias_dims=b)
    self.o_proj = Projection(rngs, "BTNH,NHD->BTD", (N, H, D), ("heads", "head_dim", "embed"), p,
                             bias_dims=1 if cfg.o_bias else 0)
    self.q_norm = RMSNorm(H, "head_dim", cfg.rms_eps, p) if cfg.qk_norm else None
    self.k_norm = RMSNorm(H, "head_dim", cfg.rms_eps, p) if cfg.qk_norm else None
    self.impl, self.block = cfg.attention, cfg.attn_block

  def __call__(self, x_BTD, rope, seg_BT, positions_BT, cache, layer: int, sharding):
    q_BTNH = constrain(self.q_proj(x_BTD), ("batch", "length", "heads", "head_dim"), sharding)
    k_BTKH = constrain(self.k_proj(x_BTD), ("batch", "length", "kv_heads", "head_dim"), sharding)
    v_BTKH = constrain(self.v_proj(x_BTD), ("batch", "length", "kv_heads", "head_dim"), sharding)
    if self.q_norm is not None:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    q_BTNH, k_BTKH = layers.apply_rope(q_BTNH, *rope), layers.apply_rope(k_BTKH, *rope)
    if cache is None:
      out_BTNH = attention.attention(q_BTNH, k_BTKH, v_BTKH, seg_BT, impl=self.impl, block=self.block)
    else:
      out_BTNH, cache = cache.attend(layer, q_BTNH, k_BTKH, v_BTKH, positions_BT)
    return self.o_proj(out_BTNH), cache


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    D, F, p = cfg.d_model, cfg.d_ff, cfg.param_dtype
    self.gate_proj = Projection(rngs, "BTD,DF->BTF", (D, F), ("embed", "mlp"), p)
    self.up_proj = Projection(rngs, "BTD,DF->BTF", (D, F), ("embed", "mlp"), p)
    self.down_proj = Projection(rngs, "BTF,FD->BTD", (F, D), ("mlp", "embed"), p)

  def __call__(self, x_BTD, sharding):
    h_BTF = jax.nn.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD)
    return self.down_proj(constrain(h_BTF, ("batch", "length", "mlp"), sharding))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.d_model, "embed", cfg.rms_eps, cfg.param_dtype)
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(cfg.d_model, "embed", cfg.rms_eps, cfg.param_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BTD, rope, seg_BT, positions_BT, cache, layer: int, sharding):
    attn_BTD, cache = self.self_attn(self.input_layernorm(x_BTD), rope, seg_BT, positions_BT, cache, layer,
                                     sharding)
    x_BTD = x_BTD + attn_BTD
    x_BTD = x_BTD + self.mlp(self.post_attention_layernorm(x_BTD), sharding)
    return constrain(x_BTD, ("batch", "length", "embed"), sharding), cache


def remat_policy(remat: str | bool):
  """None (no remat), or the checkpoint policy of each block: "block" saves only the block's input
  and recomputes everything inside it; a jax.checkpoint_policies name saves what that policy keeps."""
  name = ("block" if remat else "none") if isinstance(remat, bool) else remat
  if name == "none":
    return None
  if name == "block":
    return jax.checkpoint_policies.nothing_saveable
  policy = getattr(jax.checkpoint_policies, name, None)
  if policy is None or not callable(policy) or name.startswith("_"):
    names = sorted(n for n in dir(jax.checkpoint_policies) if not n.startswith("_"))
    raise ValueError(f"remat={name!r}; expected 'none', 'block' or a jax.checkpoint_policies name: {names}")
  if name.startswith(("save_", "offload_")) or name in ("save_only_these_names", "save_any_names_but_these"):
    raise ValueError(f"remat={name!r} is a policy factory that needs arguments; name a ready policy instead")
  return policy


class Transformer(nnx.Module):
  """`logits_BTV, cache = model(tokens_BT, positions_BT, segment_ids_BT, cache)`; logits are fp32.

  remat ("none" | "block" | a jax.checkpoint_policies name; True = "block") rematerialises each block
  in the backward pass (training only; ignored with a cache).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sharding: ActivationSharding | None = None,
               remat: str | bool = "none"):
    self.cfg, self.sharding = cfg, sharding
    self.remat = remat_policy(remat)  # validated here, before anything is traced
    p = cfg.param_dtype
    self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), p)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.norm = RMSNorm(cfg.d_model, "embed", cfg.rms_eps, p)
    self.lm_head = None if cfg.tie_embeddings else _param(rngs, (cfg.d_model, cfg.vocab_size),
                                                           ("embed", "vocab"), p)

  def hidden(self, tokens_BT, positions_BT, segment_ids_BT=None, cache=None):
    """Final-norm hidden states [B, T, D] (compute dtype) and the updated cache."""
    cfg, sharding = self.cfg, self.sharding
    # The table whole along `embed` for the lookup (FSDP gathers every weight it uses): with `embed` sharded
    # over fsdp and the rows over (data, fsdp), XLA could not turn the lookup's gradient into the table's
    # layout and replicated the activations ("involuntary full rematerialization").
    table_VD = constrain(self.embed_tokens[...], ("vocab", None), sharding)
    x_BTD = jnp.take(table_VD, tokens_BT, axis=0).astype(cfg.dtype)
    x_BTD = constrain(x_BTD, ("batch", "length", "embed"), sharding)
    rope = layers.rope_angles(positions_BT, cfg)
    seg_BT = None
    if cache is None:  # training: causal within each packed segment (models/attention.py)
      seg_BT = jnp.zeros_like(tokens_BT) if segment_ids_BT is None else segment_ids_BT
    for i, block in enumerate(self.layers):
      if self.remat is not None and cache is None:  # keep what the policy saves, recompute the rest
        x_BTD = nnx.remat(lambda b, x, r, s, p, i=i: b(x, r, s, p, None, i, sharding)[0], policy=self.remat)(
            block, x_BTD, rope, seg_BT, positions_BT)
      else:
        x_BTD, cache = block(x_BTD, rope, seg_BT, positions_BT, cache, i, sharding)
    return self.norm(x_BTD), cache

  def unembed_DV(self):
    """The output projection [D, V]: the transposed input embedding when tied."""
    return self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]

  def logits(self, h_BTD):
    w_DV = self.unembed_DV().astype(h_BTD.dtype)
    logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD, w_DV, preferred_element_type=jnp.float32)
    return constrain(logits_BTV, ("batch", "length", "vocab"), self.sharding)

  def __call__(self, tokens_BT, positions_BT, segment_ids_BT=None, cache=None):
    h_BTD, cache = self.hidden(tokens_BT, positions_BT, segment_ids_BT, cache)
    return self.logits(h_BTD), cache
