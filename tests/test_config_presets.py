"""Tests for models/config.py, models/presets.py, topology/rules.py and layers.rope_inv_freq.

Parameter counts are pinned three ways: against the release cards (to the printed digits), against
transformers' own model classes built on the meta device (exact), and against what `init_params`
actually allocates. Runs in ~10 s on CPU (most of it importing torch/transformers).
"""

import dataclasses
import math

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import AutoConfig, AutoModelForCausalLM

from jaxrl_topo.models.config import ModelConfig, RopeScaling, from_hf_dict, num_params, to_hf_dict
from jaxrl_topo.models.layers import rope_inv_freq
from jaxrl_topo.models.model import abstract_model, init_params, param_shardings
from jaxrl_topo.models.presets import PRESETS, PUBLISHED_PARAMS_B, get_preset
from jaxrl_topo.topology.rules import ROLLOUT_RULES, TRAIN_RULES, logical_to_spec, make_mesh, named_sharding

REAL = sorted(PUBLISHED_PARAMS_B)
TINY = PRESETS["tiny"]

# --- parameter counts ------------------------------------------------------------------------

# Cards that print a truncated figure rather than a rounded one (checked against the exact count):
#   llama-3.2-1b total 1,235,814,400 is printed "1.23" (rounding gives 1.24);
#   qwen2.5-7b   total 7,615,616,512 is printed "7.61" (rounding gives 7.62).
# Everything else on the cards (including Qwen2.5-7B's non-embedding 6.5256 -> "6.53") rounds.
_TRUNCATED_ON_CARD = {("llama-3.2-1b", "total"), ("qwen2.5-7b", "total")}


def _embedding_params(cfg: ModelConfig) -> int:
  return cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)


def _at_printed_precision(count: int, printed: str, truncate: bool) -> str:
  decimals = len(printed.split(".")[1])
  billions = count / 1e9
  if truncate:
    billions = math.floor(billions * 10**decimals) / 10**decimals
  return f"{billions:.{decimals}f}"


def test_real_presets_are_the_published_ones():
  assert set(PRESETS) - {"tiny"} == set(REAL), "a real preset lacks its published parameter count (or vice versa)"


@pytest.mark.parametrize("name", REAL)
def test_num_params_matches_release_card(name):
  cfg = PRESETS[name]
  total, non_embedding = PUBLISHED_PARAMS_B[name]
  got = _at_printed_precision(num_params(cfg), total, (name, "total") in _TRUNCATED_ON_CARD)
  assert got == total, f"{name}: num_params={num_params(cfg):,} prints {got}B, card says {total}B: preset shape wrong"
  if non_embedding is not None:
    count = num_params(cfg) - _embedding_params(cfg)
    got = _at_printed_precision(count, non_embedding, (name, "non_embedding") in _TRUNCATED_ON_CARD)
    assert got == non_embedding, f"{name}: non-embedding {count:,} prints {got}B, card says {non_embedding}B"


@pytest.mark.parametrize("name", ["tiny", *REAL])
def test_num_params_equals_transformers_meta_model(name):
  """Exact, independent count: transformers' own class for the family, built without memory."""
  hf_config = AutoConfig.for_model(**to_hf_dict(PRESETS[name]))
  with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(hf_config)
  want = sum(p.numel() for p in model.parameters())
  assert num_params(PRESETS[name]) == want, (
      f"{name}: num_params={num_params(PRESETS[name]):,}, {type(model).__name__} has {want:,}: "
      "the analytic count (or to_hf_dict) misses a parameter group")


# Between them: tied and untied, qk-norm, q/k/v bias alone, q/k/v/o bias, o bias alone.
TINY_VARIANTS = {
    "tiny": TINY,
    "untied": dataclasses.replace(TINY, tie_embeddings=False),
    "qwen2_qkv_bias": dataclasses.replace(TINY, family="qwen2", qk_norm=False, qkv_bias=True),
    "llama_qkvo_bias": dataclasses.replace(TINY, family="llama", qk_norm=False, qkv_bias=True, o_bias=True,
                                           tie_embeddings=False),
    "o_bias_only": dataclasses.replace(TINY, family="llama", qk_norm=False, o_bias=True),
}


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_num_params_equals_allocated_elements(variant):
  cfg = TINY_VARIANTS[variant]
  # eval_shape traces init_params' own jit without compiling it: the shapes it would return, for free.
  params = jax.eval_shape(lambda key: init_params(cfg, key)[1], jax.random.key(0))
  allocated = sum(x.size for x in jax.tree.leaves(params))
  assert num_params(cfg) == allocated, f"{variant}: num_params={num_params(cfg)}, model allocates {allocated}"


def test_tiny_size_by_hand():
  """D=64 N=4 K=2 H=16 F=128 V=128, 2 layers, tied, qk-norm:
  attention 64*64 (q) + 2*64*32 (k, v) + 64*64 (o) + 2*16 (q/k norm) = 12,320; MLP 3*64*128 = 24,576;
  two layer norms 128 -> 37,024 per layer; 2 layers 74,048 + embedding 8,192 + final norm 64 = 82,304."""
  assert num_params(TINY) == 82_304, "tiny's shape changed; update the docstring working if deliberate"


# --- config.json <-> ModelConfig ---------------------------------------------------------------


def _llama_hf_v4() -> dict:
  return dict(model_type="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=1024,
              rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=64))


def test_from_hf_dict_reads_both_rope_spellings():
  v4 = _llama_hf_v4()
  v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
  v5["rope_parameters"] = {**v4["rope_scaling"], "rope_theta": 500000.0}
  old_key = {**v4, "rope_scaling": {("type" if k == "rope_type" else k): v for k, v in v4["rope_scaling"].items()}}
  want = ModelConfig(family="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, d_ff=128, rope_theta=500000.0, rms_eps=1e-5, max_position=1024,
                     rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position=64))
  for spelling, d in (("transformers<5", v4), ("transformers>=5", v5), ("legacy 'type' key", old_key)):
    assert from_hf_dict(d) == want, f"{spelling} RoPE spelling read wrongly: {from_hf_dict(d)}"
  plain = {k: v for k, v in v5.items() if k != "rope_parameters"} | dict(rope_parameters=dict(rope_theta=1e6))
  got = from_hf_dict(plain)
  assert (got.rope_theta, got.rope_scaling) == (1e6, None), "rope_parameters without a type must mean default RoPE"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_dict_round_trips(name):
  """Ours -> config.json -> ours, and also through transformers' own re-serialisation (which writes
  the >=5 `rope_parameters` spelling and adds layer_types/sliding_window fields). dtype is a run
  choice, not part of config.json, so it is passed back as an override."""
  cfg = PRESETS[name]
  hf = to_hf_dict(cfg)
  assert from_hf_dict(hf, dtype=cfg.dtype) == cfg, f"{name}: to_hf_dict -> from_hf_dict lost a field"
  rewritten = AutoConfig.for_model(**hf).to_dict()
  assert from_hf_dict(rewritten, dtype=cfg.dtype) == cfg, f"{name}: transformers' own config.json reads back wrong"


@pytest.mark.parametrize("field, change", [
    ("model_type", dict(model_type="mistral")),
    ("hidden_act", dict(hidden_act="gelu")),
    ("mlp_bias", dict(mlp_bias=True)),
    ("use_sliding_window", dict(use_sliding_window=True)),
    ("layer_types", dict(layer_types=["full_attention", "sliding_attention"])),
    ("rope type 'yarn'", dict(rope_scaling=dict(rope_type="yarn", factor=4.0))),
    ("rope type 'dynamic'", dict(rope_scaling=None, rope_parameters=dict(rope_type="dynamic", rope_theta=1e4))),
])
def test_from_hf_dict_rejects_unsupported(field, change):
  with pytest.raises(ValueError, match=field):
    from_hf_dict({**_llama_hf_v4(), **change})


@pytest.mark.parametrize("field, change", [
    ("family", dict(family="gpt2")),
    ("n_heads", dict(n_heads=6, n_kv_heads=4)),
    ("head_dim", dict(head_dim=15)),
    ("dtype", dict(dtype="fp32")),
    ("param_dtype", dict(param_dtype="float64")),
    ("vocab_size", dict(vocab_size=0)),
    ("d_model", dict(d_model=-64)),
    ("n_layers", dict(n_layers=True)),
    ("d_ff", dict(d_ff=128.0)),
    ("o_bias", dict(family="qwen2", qk_norm=False, qkv_bias=True, o_bias=True)),
])
def test_model_config_errors_name_the_field(field, change):
  with pytest.raises(ValueError, match=rf"\b{field}\b"):
    dataclasses.replace(TINY, **change)


def test_get_preset_overrides_and_lists_choices():
  assert get_preset("qwen3-8b", dtype="float32").dtype == "float32", "override ignored"
  assert PRESETS["qwen3-8b"].dtype == "bfloat16", "get_preset mutated the shared preset"
  with pytest.raises(ValueError, match="qwen3-8b"):
    get_preset("qwen-8b")
  # a misspelt field is named with the nearest (before: dataclasses' "unexpected keyword argument"), then
  # ModelConfig's own checks (what init_model.py --set and a run's model.overrides reach)
  with pytest.raises(ValueError, match="'n_layer' is not a model config field; did you mean 'n_layers'"):
    get_preset("tiny", n_layer=3)
  with pytest.raises(ValueError, match="n_heads=3 is not a multiple of n_kv_heads=2"):
    get_preset("tiny", n_heads=3)
  assert get_preset("tiny", n_layers=3, d_model=96).n_layers == 3


# --- logical axis rules ----------------------------------------------------------------------


def test_logical_to_spec_drops_absent_and_reused_axes():
  fsdp8 = make_mesh({"fsdp": 8})
  fsdp_tp = make_mesh({"fsdp": 4, "tensor": 2})
  dp_fsdp_tp = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  act = ("batch", "length", "embed")
  # batch -> ("data", "fsdp"): "data" is absent, so batch takes fsdp, and embed (-> fsdp) is then dropped.
  assert logical_to_spec(act, TRAIN_RULES, fsdp8) == P("fsdp", None, None), "activation spec on fsdp=8"
  assert logical_to_spec(act, TRAIN_RULES, dp_fsdp_tp) == P(("data", "fsdp"), None, None), "batch over 2 axes"
  q_weight = ("embed", "heads", "head_dim")
  assert logical_to_spec(q_weight, TRAIN_RULES, fsdp8) == P("fsdp", None, None), "absent tensor axis not dropped"
  assert logical_to_spec(q_weight, TRAIN_RULES, fsdp_tp) == P("fsdp", "tensor", None)
  assert logical_to_spec(q_weight, ROLLOUT_RULES, fsdp_tp) == P(None, "tensor", None), "rollout keeps embed whole"
  assert logical_to_spec(("batch", None), ROLLOUT_RULES, fsdp_tp) == P(None, None), "rollout has no data axis here"
  with pytest.raises(ValueError, match="'experts'"):
    logical_to_spec(("experts", "embed"), TRAIN_RULES, fsdp8)


def test_named_sharding_names_the_tensor_that_does_not_divide():
  """Every sharded dim must divide, except KV heads fewer than their axis: those are replicated (GQA)."""
  mesh = make_mesh({"data": 2, "tensor": 4})
  with pytest.raises(ValueError, match=r"q_proj.*heads=2.*4 ways"):
    named_sharding(("embed", "heads", "head_dim"), ROLLOUT_RULES, mesh, (64, 2, 16), what="q_proj")
  assert named_sharding(("embed", "kv_heads", "head_dim"), ROLLOUT_RULES, mesh, (64, 2, 16)).spec == P(None, None, None)
  _, abstract = abstract_model(TINY)  # tiny has N=4 heads, K=2 kv heads
  with pytest.raises(ValueError, match=r"\['self_attn'\]\['[oq]_proj'\]\['kernel'\].*heads=4.*8 ways"):
    param_shardings(abstract, make_mesh({"tensor": 8}), ROLLOUT_RULES)


def test_param_shardings_for_tiny_on_fsdp4_tensor2():
  """TRAIN_RULES: embed -> fsdp, heads/kv_heads/mlp/vocab -> tensor, head_dim replicated."""
  _, abstract = abstract_model(TINY)
  specs = jax.tree.map(lambda s: s.spec, param_shardings(abstract, make_mesh({"fsdp": 4, "tensor": 2}), TRAIN_RULES))
  attn, mlp = specs["layers"][0]["self_attn"], specs["layers"][1]["mlp"]
  want = {
      "q_proj [D,N,H]": (attn["q_proj"]["kernel"], P("fsdp", "tensor", None)),
      "k_proj [D,K,H]": (attn["k_proj"]["kernel"], P("fsdp", "tensor", None)),
      "o_proj [N,H,D]": (attn["o_proj"]["kernel"], P("tensor", None, "fsdp")),
      "q_norm [H]": (attn["q_norm"]["weight"], P(None)),
      "embed_tokens [V,D]": (specs["embed_tokens"], P("tensor", "fsdp")),
      "gate_proj [D,F]": (mlp["gate_proj"]["kernel"], P("fsdp", "tensor")),
      "up_proj [D,F]": (mlp["up_proj"]["kernel"], P("fsdp", "tensor")),
      "down_proj [F,D]": (mlp["down_proj"]["kernel"], P("tensor", "fsdp")),
      "final norm [D]": (specs["norm"]["weight"], P("fsdp")),
  }
  for what, (got, expected) in want.items():
    assert got == expected, f"{what}: got {got}, want {expected}"
  assert "lm_head" not in specs, "tiny is tied: there must be no separate lm_head"


# --- RoPE ------------------------------------------------------------------------------------


def test_rope_inv_freq_llama3_scaling_by_hand():
  """head_dim=8, theta=1e4 -> base inverse frequencies 1e4^(-i/4) = 1, 0.1, 0.01, 0.001, wavelengths
  2*pi/f = 6.28, 62.83, 628.3, 6283. With orig=64, low=1, high=4 the bands are: kept if wavelength
  < 64/4 = 16, divided by factor=8 if > 64/1 = 64, interpolated in between.
    i=0: 6.28 < 16, kept                -> 1.0
    i=1: 16 <= 62.83 <= 64, interpolated: s = (64/(20*pi) - 1) / (4 - 1) = 0.018591636 / 3 = 0.006197212;
         (1-s) * 0.1/8 + s * 0.1 = 0.0125 + 0.0875 s = 0.013042256
    i=2: 628.3 > 64, divided by 8       -> 0.00125
    i=3: 6283 > 64, divided by 8        -> 0.000125
  """
  scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64)
  np.testing.assert_allclose(rope_inv_freq(8, 10_000.0, scaling), [1.0, 0.013042256, 0.00125, 0.000125], rtol=1e-6,
                             err_msg="Llama-3 RoPE scaling puts a frequency in the wrong band or interpolates wrongly")
  np.testing.assert_allclose(rope_inv_freq(8, 10_000.0, None), [1.0, 0.1, 0.01, 0.001], rtol=1e-6,
                             err_msg="unscaled RoPE must be theta^(-2i/H)")
