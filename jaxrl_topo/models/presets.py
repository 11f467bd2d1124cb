"""Named model shapes: `tiny` for tests and the demo, and the real shapes of released checkpoints.

The real presets carry the published parameter totals (`PUBLISHED_PARAMS_B`) so a test can pin
`num_params` against them. Loading a real checkpoint reads its own config.json; these presets are
for sizing, benchmarks and review.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable

from jaxrl_topo.models.config import ModelConfig, RopeScaling

_LLAMA32_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)


def _qwen2(**kw) -> ModelConfig:
  return ModelConfig(family="qwen2", qkv_bias=True, rope_theta=1_000_000.0, rms_eps=1e-6,
                     max_position=32768, **kw)


def _qwen3(**kw) -> ModelConfig:
  return ModelConfig(family="qwen3", qk_norm=True, head_dim=128, rope_theta=1_000_000.0, rms_eps=1e-6,
                     max_position=40960, vocab_size=151936, n_kv_heads=8, **kw)


def _llama(**kw) -> ModelConfig:
  return ModelConfig(family="llama", rope_theta=500_000.0, rms_eps=1e-5, max_position=131072,
                     vocab_size=128256, n_kv_heads=8, **kw)


PRESETS: dict[str, ModelConfig] = {
    # 82,304 parameters; the char tokenizer of models/tokenizer.py fits in its vocabulary.
    "tiny": ModelConfig(family="qwen3", vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=128, qk_norm=True, tie_embeddings=True, max_position=512,
                        dtype="float32"),
    "qwen2.5-0.5b": _qwen2(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                           head_dim=64, d_ff=4864, tie_embeddings=True),
    "qwen2.5-1.5b": _qwen2(vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2,
                           head_dim=128, d_ff=8960, tie_embeddings=True),
    "qwen2.5-7b": _qwen2(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                         head_dim=128, d_ff=18944, tie_embeddings=False),
    "qwen3-0.6b": _qwen3(d_model=1024, n_layers=28, n_heads=16, d_ff=3072, tie_embeddings=True),
    "qwen3-1.7b": _qwen3(d_model=2048, n_layers=28, n_heads=16, d_ff=6144, tie_embeddings=True),
    "qwen3-8b": _qwen3(d_model=4096, n_layers=36, n_heads=32, d_ff=12288, tie_embeddings=False),
    "llama-3.2-1b": _llama(d_model=2048, n_layers=16, n_heads=32, head_dim=64, d_ff=8192,
                           tie_embeddings=True, rope_scaling=_LLAMA32_ROPE),
    "llama-3.2-3b": _llama(d_model=3072, n_layers=28, n_heads=24, head_dim=128, d_ff=8192,
                           tie_embeddings=True, rope_scaling=_LLAMA32_ROPE),
    "llama-3.1-8b": _llama(d_model=4096, n_layers=32, n_heads=32, head_dim=128, d_ff=14336,
                           tie_embeddings=False, rope_scaling=_LLAMA31_ROPE),
}

# (total, non-embedding) parameters in billions, as printed on each model's release card, to the
# precision printed there (rounded, except llama-3.2-1b's 1.2358 and qwen2.5-7b's 7.6156, truncated).
# Non-embedding = total minus the input embedding and an untied lm_head;
# the Llama cards give no such figure.
PUBLISHED_PARAMS_B: dict[str, tuple[str, str | None]] = {
    "qwen2.5-0.5b": ("0.49", "0.36"),
    "qwen2.5-1.5b": ("1.54", "1.31"),
    "qwen2.5-7b": ("7.61", "6.53"),
    "qwen3-0.6b": ("0.6", "0.44"),
    "qwen3-1.7b": ("1.7", "1.4"),
    "qwen3-8b": ("8.2", "6.95"),
    "llama-3.2-1b": ("1.23", None),
    "llama-3.2-3b": ("3.21", None),
    "llama-3.1-8b": ("8.03", None),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """A preset by name with field overrides (e.g. dtype="float32"); unknown names list the choices, an unknown
  field is named with the nearest one (ModelConfig's own checks follow)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
  check_fields(overrides)
  return dataclasses.replace(PRESETS[name], **overrides)


def check_fields(names: Iterable[str]) -> None:
  """Raises ValueError for the first of `names` that is not a ModelConfig field, with the nearest one."""
  fields = [f.name for f in dataclasses.fields(ModelConfig)]
  for name in names:
    if name not in fields:
      close = difflib.get_close_matches(name, fields, n=1)
      raise ValueError(f"{name!r} is not a model config field" + (f"; did you mean {close[0]!r}?" if close else
                                                                   f" (fields: {', '.join(fields)})"))
