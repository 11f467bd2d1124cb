"""Our model vs `transformers` on the same safetensors, and checkpoint I/O in both directions.

A failure in the logit tests means our forward differs from the reference implementation of
that family: look first at the layout transforms in hf_io.py, then at RoPE/qk-norm in layers.py.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_fixtures import FAMILY_CASES, VOCAB, hf_logits, make_hf_model
from safetensors.numpy import load_file, save_file

from jaxrl_topo.models import hf_io
from jaxrl_topo.models.model import forward
from jaxrl_topo.topology.rules import TRAIN_RULES, make_mesh

FAMILIES = sorted(FAMILY_CASES)
TOL = 1e-4  # fp32 on both sides; observed max |diff| is ~1e-6


def _positions(B, T):
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def _our_logits(graphdef, params, tokens, positions=None, segment_ids=None):
  tokens = jnp.asarray(tokens, jnp.int32)
  positions = _positions(*tokens.shape) if positions is None else jnp.asarray(positions)
  seg = None if segment_ids is None else jnp.asarray(segment_ids)
  fn = jax.jit(lambda p, t, q, s: forward(graphdef, p, t, q, s)[0])
  return np.asarray(fn(params, tokens, positions, seg))


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
  family = request.param
  model = make_hf_model(family)
  path = str(tmp_path_factory.mktemp(family))
  model.save_pretrained(path)
  return family, model, path


def test_logits_match_transformers(saved):
  family, model, path = saved
  cfg, graphdef, params = hf_io.load_model(path, dtype="float32")
  assert cfg.family == family
  tokens = np.random.RandomState(0).randint(0, VOCAB, (3, 40))  # 40 > 16: past the llama3 original context
  ours, want = _our_logits(graphdef, params, tokens), hf_logits(model, tokens)
  np.testing.assert_allclose(ours, want, atol=TOL, rtol=0, err_msg=f"{family}: logits differ from transformers")


def test_rope_scaling_is_exercised():
  """The llama case must be sensitive to its RoPE scaling, or the parity test above proves nothing."""
  scaled = make_hf_model("llama")
  plain = make_hf_model("llama", rope_scaling=None)
  tokens = np.random.RandomState(1).randint(0, VOCAB, (1, 40))
  assert np.abs(hf_logits(scaled, tokens) - hf_logits(plain, tokens)).max() > 100 * TOL


def test_packed_batch_matches_separate_sequences(saved):
  """Two sequences packed in one row (segment ids, restarting positions) == each run alone in HF."""
  family, model, path = saved
  _, graphdef, params = hf_io.load_model(path, dtype="float32")
  rng = np.random.RandomState(2)
  a, b = rng.randint(0, VOCAB, 13), rng.randint(0, VOCAB, 9)
  pad = 2
  tokens = np.concatenate([a, b, np.zeros(pad, int)])[None]
  positions = np.concatenate([np.arange(13), np.arange(9), np.arange(pad)])[None]
  segments = np.concatenate([np.full(13, 1), np.full(9, 2), np.zeros(pad, int)])[None]
  ours = _our_logits(graphdef, params, tokens, positions, segments)[0]
  np.testing.assert_allclose(ours[:13], hf_logits(model, a[None])[0], atol=TOL, rtol=0,
                             err_msg=f"{family}: segment 1 of a packed row differs from running it alone")
  np.testing.assert_allclose(ours[13:22], hf_logits(model, b[None])[0], atol=TOL, rtol=0,
                             err_msg=f"{family}: segment 2 saw segment 1 or got wrong positions")


def test_round_trip_our_save_hf_load(saved, tmp_path):
  family, model, path = saved
  cfg, _, params = hf_io.load_model(path, dtype="float32")
  out = str(tmp_path / "ours")
  hf_io.save_model(out, cfg, params)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  tokens = np.random.RandomState(3).randint(0, VOCAB, (2, 24))
  np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(model, tokens),
                                err_msg=f"{family}: transformers reading our checkpoint gives other logits")


def test_sharded_index_loads_onto_a_mesh(saved, tmp_path):
  """A multi-file checkpoint (index.json) loaded straight onto a mesh: same logits, and no device
  holds a whole sharded tensor. Qwen2's single kv head can't split over `tensor`, so it goes fsdp=8."""
  family, model, _ = saved
  path = str(tmp_path / "sharded")
  model.save_pretrained(path, max_shard_size="40KB")
  assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
  assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
  axes = {"fsdp": 8} if family == "qwen2" else {"fsdp": 4, "tensor": 2}
  _, graphdef, params = hf_io.load_model(path, make_mesh(axes), TRAIN_RULES, dtype="float32")
  embed = params["embed_tokens"]  # [V=96, D=32]: vocab over tensor, embed over fsdp
  tensor = axes.get("tensor", 1)
  assert embed.sharding.spec == jax.sharding.PartitionSpec("tensor" if tensor > 1 else None, "fsdp")
  assert {s.data.shape for s in embed.addressable_shards} == {(VOCAB // tensor, 32 // axes["fsdp"])}
  tokens = np.random.RandomState(4).randint(0, VOCAB, (2, 16))
  np.testing.assert_allclose(_our_logits(graphdef, params, tokens), hf_logits(model, tokens), atol=TOL, rtol=0)


def test_bf16_checkpoint_loads_exactly_into_fp32(tmp_path):
  model = make_hf_model("qwen3").to(dtype=torch.bfloat16)
  model.save_pretrained(str(tmp_path))
  _, _, params = hf_io.load_model(str(tmp_path), dtype="float32")
  want = model.model.layers[0].mlp.up_proj.weight.detach().float().numpy().T
  got = np.asarray(params["layers"][0]["mlp"]["up_proj"]["kernel"])
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, want)


def test_save_model_ships_the_tokenizer_it_is_given(tmp_path):
  """A policy saved from a user's own loop: before, only config.json and the weights were written, so
  Tokenizer.from_dir (generate, serve) could not load it. tokenizer_dir= copies the tokenizer files export.export
  copies; a directory without tokenizer.json is refused before anything is written."""
  from jaxrl_topo.models.fresh import write_fresh_model
  from jaxrl_topo.models.presets import get_preset
  from jaxrl_topo.models.tokenizer import Tokenizer

  src, out, bare = str(tmp_path / "src"), str(tmp_path / "policy"), str(tmp_path / "bare")
  write_fresh_model(src, get_preset("tiny"))
  cfg, _, params = hf_io.load_model(src, dtype="float32")
  hf_io.save_model(out, cfg, params, tokenizer_dir=src)
  assert "tokenizer.json" in hf_io.tokenizer_files(src) and hf_io.tokenizer_files(out) == hf_io.tokenizer_files(src)
  want, got = Tokenizer.from_dir(src), Tokenizer.from_dir(out)
  assert got.encode("reverse abcd=") == want.encode("reverse abcd=") and got.eos_token_ids == want.eos_token_ids
  hf_io.save_model(bare, cfg, params)  # no tokenizer_dir: weights and config only, as before
  assert sorted(os.listdir(bare)) == ["config.json", "model.safetensors"]
  with pytest.raises(FileNotFoundError, match=f"^tokenizer_dir={bare}: no tokenizer.json there; nothing was written"):
    hf_io.save_model(str(tmp_path / "x"), cfg, params, tokenizer_dir=bare)
  assert not os.path.exists(tmp_path / "x")
  # A model directory is replaced; anything else that holds files is not (a new user's trial: a run's workdir had
  # its config.json replaced by the model's, silently).
  hf_io.save_model(bare, cfg, jax.tree.map(lambda x: x * 2, params))
  np.testing.assert_array_equal(hf_io.load_model(bare, dtype="float32")[2]["norm"]["weight"],
                                2 * np.asarray(params["norm"]["weight"]))
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "config.json").write_text('{"model": {}}')
  with pytest.raises(FileExistsError, match=f"^save_model: model_dir={run} already exists and is not empty and "
                                            "holds no model to replace; nothing was written"):
    hf_io.save_model(str(run), cfg, params)
  assert sorted(os.listdir(run)) == ["checkpoints", "config.json"]
  assert (run / "config.json").read_text() == '{"model": {}}'


# --- bad checkpoints: every error names the tensor -------------------------------------------


def _single_file_copy(model, tmp_path):
  path = str(tmp_path / "bad")
  model.save_pretrained(path)
  return path, os.path.join(path, "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
  path, file = _single_file_copy(make_hf_model("qwen3"), tmp_path)
  tensors = load_file(file)
  del tensors["model.layers.1.self_attn.k_norm.weight"]
  save_file(tensors, file, metadata={"format": "pt"})
  with pytest.raises(hf_io.CheckpointError, match=r"missing.*model\.layers\.1\.self_attn\.k_norm\.weight"):
    hf_io.load_model(path)


def test_unexpected_tensor_is_named(tmp_path):
  path, file = _single_file_copy(make_hf_model("qwen2"), tmp_path)
  tensors = load_file(file)
  tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
  save_file(tensors, file, metadata={"format": "pt"})
  with pytest.raises(hf_io.CheckpointError, match=r"unexpected.*model\.layers\.0\.mlp\.extra\.weight"):
    hf_io.load_model(path)


def test_misshaped_tensor_is_named(tmp_path):
  path, _ = _single_file_copy(make_hf_model("llama"), tmp_path)
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  config["intermediate_size"] = 40  # the checkpoint has 48
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(hf_io.CheckpointError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape"):
    hf_io.load_model(path)


def test_pickle_checkpoints_are_refused(tmp_path):
  path, file = _single_file_copy(make_hf_model("llama"), tmp_path)
  os.remove(file)
  open(os.path.join(path, "pytorch_model.bin"), "wb").close()
  with pytest.raises(FileNotFoundError, match="pickle"):
    hf_io.load_model(path)


def test_unsupported_config_is_refused(tmp_path):
  path, _ = _single_file_copy(make_hf_model("qwen2"), tmp_path)
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  config["use_sliding_window"] = True
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match="use_sliding_window"):
    hf_io.load_model(path)
