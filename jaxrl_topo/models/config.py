"""Model architecture as a frozen dataclass, and its mapping to/from Hugging Face config.json.

One `ModelConfig` describes the three supported decoder-only families:
  llama  (Llama-3.x): optional attention bias on q/k/v/o, Llama-3 RoPE scaling.
  qwen2  (Qwen2/2.5): bias on q/k/v only, never on o.
  qwen3  (Qwen3):     RMSNorm on q and k per head ("qk-norm"), head_dim independent of d_model.
Anything outside that envelope (sliding windows, MLP bias, other activations or RoPE types) is
rejected by `from_hf_dict` with the field that caused it, instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("flash", "reference", "xla", "cudnn")  # models/attention.py
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama-3 frequency-dependent RoPE scaling (`rope_type: llama3` in HF configs)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Architecture of a decoder-only transformer. Sizes are counts, not bytes."""

  family: str
  vocab_size: int
  d_model: int  # hidden size D
  n_layers: int
  n_heads: int  # query heads N
  n_kv_heads: int  # key/value heads K (GQA: N % K == 0)
  head_dim: int  # H, independent of d_model / n_heads (Qwen3 uses 128 with D/N = 64)
  d_ff: int  # SwiGLU inner size F
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  qk_norm: bool = False
  max_position: int = 4096  # longest sequence the model was trained for: the engine and generate refuse longer ones
  dtype: str = "bfloat16"  # compute dtype of matmuls; norms, softmax and logits are always fp32
  param_dtype: str = "float32"  # storage dtype of parameters (fp32 master weights for training)
  # How training attends (models/attention.py): "flash" (blockwise, O(T) memory), "reference" (dense
  # masked softmax), "xla" or "cudnn" (jax.nn.dot_product_attention). Not architecture: never in config.json.
  attention: str = "flash"
  attn_block: int = 128  # flash: tokens per query/key tile

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"ModelConfig.family={self.family!r}; expected one of {FAMILIES}")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"ModelConfig.n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for rotary embeddings")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; expected one of {DTYPES}")
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f"ModelConfig.attention={self.attention!r}; expected one of {ATTENTION_IMPLS}")
    if self.attn_block < 1:
      raise ValueError(f"ModelConfig.attn_block={self.attn_block} must be positive")
    if self.family == "qwen2" and self.o_bias:
      raise ValueError("qwen2 has bias on q/k/v only; o_bias=True is not a Qwen2 model")


def num_params(cfg: ModelConfig) -> int:
  """Analytic parameter count, the way HF counts it (tied embeddings counted once)."""
  D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
  attn = D * N * H + 2 * D * K * H + N * H * D
  attn += (N * H + 2 * K * H) * cfg.qkv_bias + D * cfg.o_bias + 2 * H * cfg.qk_norm
  per_layer = attn + 3 * D * F + 2 * D
  return cfg.n_layers * per_layer + V * D * (1 if cfg.tie_embeddings else 2) + D


# --- Hugging Face config.json <-> ModelConfig -------------------------------------------------


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
  """Reads RoPE from either the transformers<5 (`rope_theta` + `rope_scaling`) or >=5
  (`rope_parameters`) spelling."""
  params = dict(d.get("rope_parameters") or {})
  scaling = dict(d.get("rope_scaling") or {})
  theta = float(params.get("rope_theta", d.get("rope_theta", 10_000.0)))
  merged = {**params, **scaling}
  rope_type = merged.get("rope_type", merged.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise ValueError(f"config.json: rope type {rope_type!r} is not supported (only default and llama3)")
  return theta, RopeScaling(
      factor=float(merged["factor"]),
      low_freq_factor=float(merged["low_freq_factor"]),
      high_freq_factor=float(merged["high_freq_factor"]),
      original_max_position=int(merged["original_max_position_embeddings"]),
  )


def _reject_unsupported(d: dict[str, Any]) -> None:
  if d.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: hidden_act={d['hidden_act']!r} is not supported (only silu)")
  if d.get("mlp_bias"):
    raise ValueError("config.json: mlp_bias=true is not supported")
  if d.get("use_sliding_window"):
    raise ValueError("config.json: use_sliding_window=true is not supported (full attention only)")
  layer_types = d.get("layer_types") or []
  if any(t != "full_attention" for t in layer_types):
    raise ValueError(f"config.json: layer_types {sorted(set(layer_types))} not supported (full_attention only)")


def from_hf_dict(d: dict[str, Any], **overrides: Any) -> ModelConfig:
  """Builds a ModelConfig from a parsed HF config.json; `overrides` set e.g. dtype."""
  family = d.get("model_type")
  if family not in FAMILIES:
    raise ValueError(f"config.json: model_type={family!r} is not supported; expected one of {FAMILIES}")
  _reject_unsupported(d)
  theta, scaling = _rope_from_hf(d)
  n_heads = int(d["num_attention_heads"])
  attention_bias = bool(d.get("attention_bias", False))
  fields = dict(
      family=family,
      vocab_size=int(d["vocab_size"]),
      d_model=int(d["hidden_size"]),
      n_layers=int(d["num_hidden_layers"]),
      n_heads=n_heads,
      n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
      head_dim=int(d.get("head_dim") or d["hidden_size"] // n_heads),
      d_ff=int(d["intermediate_size"]),
      rope_theta=theta,
      rope_scaling=scaling,
      rms_eps=float(d.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(d.get("tie_word_embeddings", False)),
      qkv_bias=True if family == "qwen2" else attention_bias,
      o_bias=False if family == "qwen2" else attention_bias,
      qk_norm=family == "qwen3",
      max_position=int(d.get("max_position_embeddings", 4096)),
  )
  return ModelConfig(**{**fields, **overrides})


def to_hf_dict(cfg: ModelConfig, *, bos_token_id: int | None = None,
               eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
  """The HF config.json for `cfg`, in the spelling transformers 4.4x and 5.x both read."""
  if cfg.family == "qwen2" and not cfg.qkv_bias:
    raise ValueError("qwen2 checkpoints always carry q/k/v bias; use family='llama' for a bias-free model")
  if cfg.family != "qwen2" and cfg.qkv_bias != cfg.o_bias:
    raise ValueError(f"{cfg.family}: HF's attention_bias covers q/k/v/o together; got qkv_bias={cfg.qkv_bias} "
                     f"o_bias={cfg.o_bias}")
  if cfg.qk_norm != (cfg.family == "qwen3"):
    raise ValueError(f"qk_norm={cfg.qk_norm} does not exist in HF family {cfg.family!r}")
  d: dict[str, Any] = dict(
      architectures=[_ARCHITECTURES[cfg.family]],
      model_type=cfg.family,
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model,
      num_hidden_layers=cfg.n_layers,
      num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads,
      head_dim=cfg.head_dim,
      intermediate_size=cfg.d_ff,
      hidden_act="silu",
      rms_norm_eps=cfg.rms_eps,
      rope_theta=cfg.rope_theta,
      tie_word_embeddings=cfg.tie_embeddings,
      max_position_embeddings=cfg.max_position,
      torch_dtype=cfg.param_dtype,
  )
  if cfg.family != "qwen2":
    d["attention_bias"] = cfg.qkv_bias
  if cfg.rope_scaling is not None:
    r = cfg.rope_scaling
    d["rope_scaling"] = dict(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                             high_freq_factor=r.high_freq_factor,
                             original_max_position_embeddings=r.original_max_position)
  if bos_token_id is not None:
    d["bos_token_id"] = bos_token_id
  if eos_token_id is not None:
    d["eos_token_id"] = eos_token_id
  return d
