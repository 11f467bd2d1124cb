"""RewardModel vs transformers' *ForSequenceClassification on the same safetensors directory.

A parity failure means our pooled score differs from HF's: check the pooled position (last real
token) and score.weight's layout first, then the backbone (test_hf_parity.py covers it alone).
An invariance failure means padding or dummy rows leak into a sequence's score.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from hf_fixtures import FAMILY_CASES, VOCAB
from safetensors.numpy import load_file, save_file

from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.rl.reward_model import RewardModel, write_reward_model
from jaxrl_topo.topology.rules import ROLLOUT_RULES, make_mesh

PAD_ID = 0  # test sequences never contain it, so HF's "rightmost non-pad token" is the last one
LENGTHS = (1, 5, 17, 9, 33)  # 17 and 33 cross the 16 and 32 length buckets
TOL = 1e-4  # fp32 on both sides


@pytest.fixture(scope="module")
def mesh():
  return make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])


def _sequences(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
  rng = np.random.RandomState(seed)
  return [rng.randint(PAD_ID + 1, vocab, n).tolist() for n in lengths]


def _hf_scores(model, sequences) -> np.ndarray:
  """transformers' logits[:, 0], one unpadded sequence at a time."""
  with torch.no_grad():
    return np.array([model(torch.tensor([s])).logits[0, 0].item() for s in sequences], np.float32)


def _make_hf_reward_model(family: str, seed: int = 0):
  """A random fp32 SequenceClassification model; kv heads 2 so `tensor=2` divides them."""
  config_cls, kw = FAMILY_CASES[family]
  config = config_cls(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=48,
                      num_labels=1, pad_token_id=PAD_ID, **{**kw, "num_key_value_heads": 2})
  torch.manual_seed(seed)
  model = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()
  with torch.no_grad():  # weights large enough for O(1) scores
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory):
  """family -> (HF model, the directory it was saved to), each built once, on first use."""
  cache = {}

  def get(family: str):
    if family not in cache:
      model = _make_hf_reward_model(family)
      path = str(tmp_path_factory.mktemp(f"rm_{family}"))
      model.save_pretrained(path)
      cache[family] = model, path
    return cache[family]
  return get


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_scores_match_transformers(family, hf_saved, mesh):
  model, path = hf_saved(family)
  rm = RewardModel.load(path, mesh, ROLLOUT_RULES, batch_size=4)
  assert rm.score_D.shape == (32,) and rm.score_D.sharding.is_fully_replicated
  seqs = _sequences(VOCAB)
  want = _hf_scores(model, seqs)
  assert np.abs(want).max() > 0.1, "scores near zero would make the comparison vacuous"
  np.testing.assert_allclose(rm.score(seqs), want, atol=TOL, rtol=0,
                             err_msg=f"{family}: reward scores differ from transformers")


def test_scores_do_not_depend_on_batching(hf_saved, mesh):
  _, path = hf_saved("qwen2")
  seqs = _sequences(VOCAB, lengths=(3, 40, 7, 1, 12), seed=1)
  rm = RewardModel.load(path, mesh, ROLLOUT_RULES)  # batch_size 32: one chunk, bucket 64
  together = rm.score(seqs)
  alone = np.concatenate([rm.score([s]) for s in seqs])  # buckets 16 and 64, 31 dummy rows each
  pairs = RewardModel(rm.graphdef, rm.params, rm.score_D, rm.cfg, mesh, ROLLOUT_RULES, batch_size=2).score(seqs)
  odd = RewardModel(rm.graphdef, rm.params, rm.score_D, rm.cfg, mesh, ROLLOUT_RULES, batch_size=3).score(seqs)
  assert together.dtype == np.float32 and together.shape == (5,)
  for name, got in (("one at a time", alone), ("batch_size=2", pairs), ("batch_size=3 (replicated)", odd)):
    np.testing.assert_allclose(got, together, rtol=1e-5, atol=1e-6, err_msg=f"{name} changed the scores")


def test_empty_inputs(hf_saved, mesh):
  _, path = hf_saved("qwen2")
  rm = RewardModel.load(path, mesh, ROLLOUT_RULES, batch_size=2)
  assert rm.score([]).shape == (0,)
  with pytest.raises(ValueError, match="empty sequence"):
    rm.score([[5, 6], []])


def test_write_reward_model_round_trip(tmp_path, mesh):
  cfg = get_preset("tiny")  # qwen3 with the char tokenizer's vocabulary
  path = str(tmp_path / "rm")
  write_reward_model(path, cfg, seed=3)
  with open(os.path.join(path, "config.json")) as f:
    hf_cfg = json.load(f)
  assert hf_cfg["architectures"] == ["Qwen3ForSequenceClassification"] and hf_cfg["pad_token_id"] == PAD_ID
  assert "lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))
  assert os.path.isfile(os.path.join(path, "tokenizer.json"))

  rm = RewardModel.load(path, mesh, ROLLOUT_RULES, batch_size=4)
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager").eval()
  seqs = _sequences(cfg.vocab_size, seed=2)
  want = _hf_scores(hf, seqs)
  assert np.abs(want).max() > 0.1, "scores near zero would make the comparison vacuous"
  np.testing.assert_allclose(rm.score(seqs), want, atol=TOL, rtol=0,
                             err_msg="write_reward_model's directory reads differently in transformers")


def test_missing_score_head_is_named(tmp_path, mesh):
  path = str(tmp_path / "rm")
  write_reward_model(path, get_preset("tiny"))
  weights = os.path.join(path, "model.safetensors")
  tensors = load_file(weights)
  del tensors["score.weight"]
  save_file(tensors, weights, metadata={"format": "pt"})
  with pytest.raises(ValueError, match=f"{path}.*'score.weight'"):
    RewardModel.load(path, mesh, ROLLOUT_RULES)
