"""A freshly initialised model written as a local HF directory, with the built-in char tokenizer.

Tests, the demo and the tiny configs start from such a directory, so every path through the
engine is the same one a real checkpoint takes (config.json + safetensors + tokenizer.json) and
nothing is ever fetched from a hub.
"""

from __future__ import annotations

import jax

from jaxrl_topo.models import hf_io
from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.models.model import init_params
from jaxrl_topo.models.tokenizer import CHATML_TEMPLATE, build_char_tokenizer, save_tokenizer_dir

CHAR_EOS = ("<|im_end|>", "<eos>")  # the chat turn end, then the plain end-of-text token


def write_fresh_model(out_dir: str, cfg: ModelConfig, seed: int = 0) -> None:
  """Random-init `cfg` and write it with the char tokenizer, ChatML template and EOS ids."""
  tok = build_char_tokenizer()
  if tok.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
    raise ValueError(f"the char tokenizer needs vocab_size >= {tok.get_vocab_size(with_added_tokens=True)}, "
                     f"the config has {cfg.vocab_size}")
  _, params = init_params(cfg, jax.random.key(seed))
  eos_ids = [tok.token_to_id(t) for t in CHAR_EOS]
  hf_io.save_model(out_dir, cfg, params, bos_token_id=tok.token_to_id("<bos>"), eos_token_id=eos_ids)
  save_char_tokenizer(out_dir, tok)


def save_char_tokenizer(out_dir: str, tok=None) -> None:
  """The char tokenizer's files (a fresh model's), with its ChatML template and special tokens, in `out_dir`."""
  save_tokenizer_dir(out_dir, tok or build_char_tokenizer(), chat_template=CHATML_TEMPLATE, bos_token="<bos>",
                     eos_token=CHAR_EOS[0], pad_token="<pad>", unk_token="<unk>")
