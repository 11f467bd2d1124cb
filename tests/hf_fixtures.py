"""Tiny random `transformers` models of each supported family, saved as local safetensors dirs.

Shared by the parity and generation tests. Every family case exercises the feature that makes it
different: Llama with GQA, untied head, attention bias on q/k/v/o and a strong Llama-3 RoPE
scaling (original context 16, so positions past 4 already feel it); Qwen2 with q/k/v bias, tied
embeddings and one kv head; Qwen3 with qk-norm and head_dim 12 != hidden/heads = 8.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB = 96

FAMILY_CASES = {
    "llama": (transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True,
        rope_theta=10000.0, max_position_embeddings=256,
        rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16))),
    "qwen2": (transformers.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen3": (transformers.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, tie_word_embeddings=False,
        rope_theta=10000.0)),
}


def make_hf_model(family: str, seed: int = 0, **overrides):
  """A random fp32 HF model (eager attention), weights drawn large enough for logits of O(1)."""
  config_cls, kw = FAMILY_CASES[family]
  config = config_cls(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=48,
                      **{**kw, **overrides})
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()
