"""Invariants of the transformer forward: causality, packing, cached decode, sharding, dtype, attention.

Every comparison starts from one set of parameters. They are randomised well past the 0.02-std
init: norm scales 1 +- 0.1, biases +- 0.1, kernels ~0.1. That sharpens attention, so a leak across
positions, segments or cache slots moves the logits by far more than the 1e-5 tolerances.
Runs in ~25 s on 2 idle CPU cores (~40 s on a busy box); each new shape or mesh is one XLA compile.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxrl_topo.models.layers import DenseKVCache, gqa_attention
from jaxrl_topo.models.model import abstract_model, forward, init_params, param_shardings
from jaxrl_topo.models.presets import PRESETS
from jaxrl_topo.topology.rules import ROLLOUT_RULES, TRAIN_RULES, ActivationSharding, logical_to_spec, make_mesh

TINY = PRESETS["tiny"]  # fp32 compute, qwen3 (qk-norm), N=4 K=2 H=16, tied
ATOL = 1e-5  # fp32 (matmul precision "highest" in conftest); only summation order differs


def _randomise(params, seed, std=0.1):
  """Adds N(0, std) noise to every leaf, in numpy: a jitted threefry version takes seconds to compile."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + rng.normal(0, std, x.shape).astype(x.dtype)), params)


@functools.cache
def _init(cfg):
  return init_params(cfg, jax.random.key(0))


@functools.cache
def _model(cfg=TINY):
  graphdef, params = _init(cfg)
  return graphdef, _randomise(params, seed=1)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, tokens_BT, positions_BT, segment_ids_BT=None):
  return forward(graphdef, params, tokens_BT, positions_BT, segment_ids_BT)[0]


@functools.partial(jax.jit, static_argnums=0)
def _cached(graphdef, params, tokens_BT, positions_BT, cache):
  return forward(graphdef, params, tokens_BT, positions_BT, None, cache)


def _tokens(seed, shape, vocab=TINY.vocab_size):  # numpy inputs: eager jax ops would each compile a kernel
  return np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int32)


def _arange(B, T):
  return np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))


def _alone(graphdef, params, tokens_T):
  """Logits of one unpadded sequence run by itself: the reference every fast path must match."""
  T = tokens_T.shape[0]
  return _logits(graphdef, params, tokens_T[None], _arange(1, T))[0]


def test_changing_a_token_never_changes_earlier_logits():
  graphdef, params = _model()
  B, T = 2, 8
  tokens = _tokens(0, (B, T))
  base = np.asarray(_logits(graphdef, params, tokens, _arange(B, T)))
  for t in (0, 3, T - 1):
    changed = tokens.copy()
    changed[:, t] = (tokens[:, t] + 1) % TINY.vocab_size
    got = np.asarray(_logits(graphdef, params, changed, _arange(B, T)))
    # Exact: masked keys get probability exactly 0, and the unchanged prefix runs the same arithmetic.
    np.testing.assert_array_equal(got[:, :t], base[:, :t], err_msg=f"token {t} leaked into earlier positions")
    assert np.abs(got[:, t] - base[:, t]).max() > 1e-2, f"changing token {t} did not change its own logits"


def test_forward_names_a_shape_it_cannot_take():
  """Before (a new user's trial): 1-D tokens failed as "zip() argument 2 is longer than argument 1", and positions
  of another length as "mul got incompatible shapes for broadcasting" from inside the model."""
  graphdef, params = _model()
  abstract = jax.ShapeDtypeStruct((4, 8), jnp.int32)
  for tokens, positions, says in (((8,), (8,), r"^forward: tokens must be \[batch, time\] token ids, got shape \(8,\)"),
                                  ((4, 8), (4, 4), r"^forward: positions has shape \(4, 4\), tokens \(4, 8\)")):
    with pytest.raises(ValueError, match=says):
      jax.eval_shape(functools.partial(forward, graphdef), params, jax.ShapeDtypeStruct(tokens, jnp.int32),
                     jax.ShapeDtypeStruct(positions, jnp.int32))
  out = jax.eval_shape(functools.partial(forward, graphdef), params, abstract, jax.ShapeDtypeStruct((1, 8), jnp.int32))
  assert out[0].shape == (4, 8, TINY.vocab_size)  # positions shared by every row broadcast


def test_packed_segments_match_each_sequence_alone():
  """Row = A (5 tokens, segment 1) + B (3 tokens, segment 2) + 2 padding (segment 0), positions restart."""
  graphdef, params = _model()
  a, b = _tokens(1, (5,)), _tokens(2, (3,))
  tokens = np.concatenate([a, b, [7, 9]]).astype(np.int32)[None]
  segments = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 0, 0]], np.int32)
  positions = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]], np.int32)
  packed = np.asarray(_logits(graphdef, params, tokens, positions, segments))[0]
  np.testing.assert_allclose(packed[:5], _alone(graphdef, params, a), atol=ATOL,
                             err_msg="sequence A differs when packed: segment ids are not reaching the mask")
  np.testing.assert_allclose(packed[5:8], _alone(graphdef, params, b), atol=ATOL,
                             err_msg="sequence B differs when packed: it attends to sequence A")
  other_pad_tokens = tokens.copy()
  other_pad_tokens[0, 8:] = 0
  other_pad = np.asarray(_logits(graphdef, params, other_pad_tokens, positions, segments))[0]
  np.testing.assert_array_equal(other_pad[:8], packed[:8], err_msg="padding tokens changed real tokens' logits")
  unpadded = np.asarray(_logits(graphdef, params, tokens[:, :8], positions[:, :8], segments[:, :8]))[0]
  np.testing.assert_allclose(unpadded, packed[:8], atol=ATOL, err_msg="a padded tail changed real tokens' logits")


def test_prefill_then_decode_matches_full_forward_ragged():
  """Three right-padded prompts of lengths 5, 2, 7 in one prefill, then 4 decode steps, each row at its
  own next position (5+i, 2+i, 7+i). The short rows' padding is written to the cache at slots >= length;
  decode must overwrite those slots before its mask admits them, so it is never read."""
  graphdef, params = _model()
  lengths, n_new, T_prompt = np.array([5, 2, 7]), 4, 7
  B, T_full = len(lengths), T_prompt + n_new
  # Row b holds its whole sequence (prompt + the tokens decode will be fed) in [:lengths[b] + n_new].
  full_BT = _tokens(10, (B, T_full))
  prompt_BT = np.where(np.arange(T_prompt) < lengths[:, None], full_BT[:, :T_prompt], 3)  # pad id 3
  cache = DenseKVCache.zeros(TINY, B, max_len=16)
  prefill, cache = _cached(graphdef, params, prompt_BT, _arange(B, T_prompt), cache)
  decoded = []
  for i in range(n_new):
    positions_B1 = (lengths + i)[:, None].astype(np.int32)
    step_logits, cache = _cached(graphdef, params, np.take_along_axis(full_BT, positions_B1, 1), positions_B1, cache)
    decoded.append(np.asarray(step_logits[:, 0]))
  # Reference: the full rows in one plain forward; by causality, what lies past a row's end is irrelevant.
  want_BTV = np.asarray(_logits(graphdef, params, full_BT, _arange(B, T_full)))
  for b, L in enumerate(lengths):
    np.testing.assert_allclose(prefill[b, :L], want_BTV[b, :L], atol=ATOL, err_msg=f"row {b}: prefill != forward")
    np.testing.assert_allclose(np.stack([d[b] for d in decoded]), want_BTV[b, L:L + n_new], atol=ATOL,
                               err_msg=f"row {b} (prompt {L}): decode != full forward")


def test_decode_step_compiles_once():
  """One jitted T=1 step fed token by token (positions 0..5, different tokens): one trace, and the
  logits it produces are those of the full forward over the same 6 tokens."""
  graphdef, params = _model()
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, cache, tokens_B1, positions_B1):
    logits, cache = forward(graphdef, params, tokens_B1, positions_B1, None, cache)
    return logits[:, 0], cache

  seq = _tokens(20, (6,))
  cache = DenseKVCache.zeros(TINY, 1, max_len=8)
  got = []
  for t in range(6):  # a retrace (e.g. a Python int position, a static length) raises here
    logits, cache = step(params, cache, seq[t].reshape(1, 1), np.full((1, 1), t, np.int32))
    got.append(np.asarray(logits[0]))
  np.testing.assert_allclose(np.stack(got), _alone(graphdef, params, seq), atol=ATOL,
                             err_msg="token-by-token decode != full forward")


# --- sharding --------------------------------------------------------------------------------

# Heads and kv heads divide every tensor axis used below (8 and 4 over tensor=2 or 4).
SHARD_CFG = dataclasses.replace(TINY, n_heads=8, n_kv_heads=4, head_dim=8)
MESHES = [
    ("train", {"fsdp": 8}),
    ("train", {"fsdp": 4, "tensor": 2}),
    ("train", {"data": 2, "fsdp": 2, "tensor": 2}),
    ("rollout", {"fsdp": 4, "tensor": 2}),
    ("rollout", {"data": 2, "tensor": 4}),
]
RULES = {"train": TRAIN_RULES, "rollout": ROLLOUT_RULES}


@pytest.mark.parametrize("rules_name, axes", MESHES, ids=[f"{r}-{a}" for r, a in MESHES])
def test_sharded_logits_match_single_device(rules_name, axes):
  graphdef, params = _model(SHARD_CFG)  # initialised once, on one device
  B, T = 8, 8
  tokens = _tokens(30, (B, T))
  want = np.asarray(_logits(graphdef, params, tokens, _arange(B, T)))
  mesh, rules = make_mesh(axes), RULES[rules_name]
  sharded_graphdef, abstract = abstract_model(SHARD_CFG, ActivationSharding(mesh, rules))
  sharded = jax.device_put(params, param_shardings(abstract, mesh, rules))
  got = _logits(sharded_graphdef, sharded, tokens, _arange(B, T))
  np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, err_msg=f"{rules_name} rules on {axes} change logits")
  want_sharding = NamedSharding(mesh, logical_to_spec(("batch", "length", "vocab"), rules, mesh))
  assert got.sharding.is_equivalent_to(want_sharding, got.ndim), (
      f"logits laid out as {got.sharding.spec}, rules say {want_sharding.spec}: the constraint is not applied")


def test_init_params_op_by_op_draws_the_compiled_values_up_to_rounding(caplog):
  """compiled=False (benchmarks: no 1-minute compile of one init program on a GPU) compiles no whole-model init
  program and draws the same parameters: same tree, shapes and dtypes, values equal but for the last bits; with a
  mesh it refuses (it cannot shard). A 1-layer model, so no earlier test compiled its init program."""
  cfg = dataclasses.replace(TINY, n_layers=1)
  with caplog.at_level("WARNING"), jax.log_compiles():
    _, got = init_params(cfg, jax.random.key(0), compiled=False)
  assert not [r for r in caplog.messages if "jit(init)" in r], "compiled=False compiled the whole init"
  caplog.clear()
  with caplog.at_level("WARNING"), jax.log_compiles():
    _, want = init_params(cfg, jax.random.key(0))  # the check's own control: the compiled init is logged
  assert [r for r in caplog.messages if "jit(init)" in r], "jax.log_compiles logged no init compile: check is blind"
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  chex.assert_trees_all_close(got, want, atol=1e-6, rtol=0)
  _, other = init_params(TINY, jax.random.key(1), compiled=False)  # the key matters: not a constant init
  assert not np.allclose(other["embed_tokens"], got["embed_tokens"])
  with pytest.raises(ValueError, match="compiled=False"):
    init_params(TINY, jax.random.key(0), make_mesh({"fsdp": 8}), TRAIN_RULES, compiled=False)


def test_init_params_on_a_mesh_is_born_sharded():
  # A misspelt axis (a new user's trial) left every weight whole on each device, silently.
  with pytest.raises(ValueError, match=r"^mesh axis 'fdsp' is none of \('data', 'fsdp', 'tensor'\) \(did you mean "
                                       r"'fsdp'\?\): the sharding rules place nothing on another name"):
    make_mesh({"fdsp": 8})
  mesh = make_mesh({"fsdp": 4, "tensor": 2})
  _, abstract = abstract_model(TINY)
  want = param_shardings(abstract, mesh, TRAIN_RULES)
  _, params = init_params(TINY, jax.random.key(0), mesh, TRAIN_RULES)
  _, reference = _init(TINY)  # same key, no mesh

  def check(path, x, sharding, ref):
    name = jax.tree_util.keystr(path)
    assert x.sharding.is_equivalent_to(sharding, x.ndim), (
        f"{name}: spec {x.sharding.spec}, param_shardings says {sharding.spec}")
    shard_shape = sharding.shard_shape(x.shape)  # each sharded dim divided by its mesh axes' sizes
    for shard in x.addressable_shards:
      assert shard.data.shape == shard_shape, f"{name}: shard {shard.data.shape}, expected {shard_shape} of {x.shape}"
    np.testing.assert_array_equal(x, ref, err_msg=f"{name}: sharded init draws different values than unsharded")

  jax.tree_util.tree_map_with_path(check, params, want, reference)
  attn, mlp = params["layers"][0]["self_attn"], params["layers"][1]["mlp"]
  by_hand = {  # tiny: D=64 N=4 H=16 F=128 V=128 over fsdp=4 (embed) x tensor=2 (heads, mlp, vocab)
      "q_proj [D/4, N/2, H]": (attn["q_proj"]["kernel"], (16, 2, 16)),
      "embed_tokens [V/2, D/4]": (params["embed_tokens"], (64, 16)),
      "down_proj [F/2, D/4]": (mlp["down_proj"]["kernel"], (64, 16)),
      "q_norm [H] whole": (attn["q_norm"]["weight"], (16,)),
  }
  for name, (x, shard_shape) in by_hand.items():
    assert x.addressable_shards[0].data.shape == shard_shape, f"{name}: one device holds {x.addressable_shards[0]}"


# --- dtypes and attention --------------------------------------------------------------------


def test_bf16_compute_is_close_to_fp32():
  """bf16 keeps 8 significant bits (unit roundoff 2^-9 = 0.2%). Activations and weights are rounded at
  every matmul input/output across 2 layers, so logits should agree to a few percent of their
  spread; 5% of max|logit| is the bound. Norms, softmax and the logits einsum stay fp32."""
  graphdef, params = _model()
  bf16_graphdef, _ = abstract_model(dataclasses.replace(TINY, dtype="bfloat16"))
  B, T = 2, 8
  tokens = _tokens(40, (B, T))
  want = np.asarray(_logits(graphdef, params, tokens, _arange(B, T)))
  got = _logits(bf16_graphdef, params, tokens, _arange(B, T))
  assert got.dtype == jnp.float32, f"logits must be float32 whatever the compute dtype, got {got.dtype}"
  err = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
  assert err < 0.05, f"bf16 logits off by {err:.3f} of max|logit|: more than bf16 rounding explains"
  assert err > 1e-4, f"bf16 logits match fp32 to {err:.1e}: compute did not run in bf16"


def _reference_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS):
  """Plain numpy, float64: every query head n reads kv head n // (N/K)."""
  N, K, H = q_BTNH.shape[2], k_BSKH.shape[2], q_BTNH.shape[3]
  kv_of_head = np.arange(N) // (N // K)
  k, v = np.asarray(k_BSKH, np.float64)[:, :, kv_of_head], np.asarray(v_BSKH, np.float64)[:, :, kv_of_head]
  logits_BNTS = np.einsum("btnh,bsnh->bnts", np.asarray(q_BTNH, np.float64), k) / np.sqrt(H)
  logits_BNTS = np.where(mask_BTS[:, None], logits_BNTS, -np.inf)
  probs = np.exp(logits_BNTS - logits_BNTS.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", probs, v)


_gqa = jax.jit(gqa_attention)


@pytest.mark.parametrize("K", [4, 2, 1], ids=lambda k: f"K={k}")
def test_gqa_attention_matches_references(K):
  B, T, S, N, H = 2, 5, 7, 4, 8
  rng = np.random.default_rng(K)
  q = rng.normal(size=(B, T, N, H)).astype(np.float32) * 2
  k, v = rng.normal(size=(2, B, S, K, H)).astype(np.float32)
  mask = rng.random((B, T, S)) < 0.5
  mask[:, :, 0] = True  # no fully masked rows: the two implementations need not agree there
  got = np.asarray(_gqa(q, k, v, mask))
  np.testing.assert_allclose(got, _reference_attention(q, k, v, mask), atol=ATOL,
                             err_msg=f"GQA with K={K} differs from the numpy reference")
  jax_ref = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="xla"))(
      q, k, v, mask=jnp.asarray(mask)[:, None])
  np.testing.assert_allclose(got, np.asarray(jax_ref), atol=ATOL,
                             err_msg=f"GQA with K={K} differs from jax.nn.dot_product_attention")


def test_fully_masked_row_is_uniform_not_nan():
  """The -1e30 fill is finite by design: a row with no admissible key averages v uniformly."""
  v = np.random.default_rng(0).normal(size=(1, 3, 1, 4)).astype(np.float32)
  out = _gqa(np.ones((1, 1, 2, 4), np.float32), np.ones((1, 3, 1, 4), np.float32), v, np.zeros((1, 1, 3), bool))
  np.testing.assert_allclose(out[0, 0], np.broadcast_to(v[0].mean(0), (2, 4)), atol=1e-6,
                             err_msg="a fully masked row should give mean(v), not NaN or a one-hot")


def test_make_apply_fn_is_forward_without_the_cache():
  """The train step's generic `apply_fn(params, tokens, positions, segment_ids)` is our forward's logits."""
  from jaxrl_topo.models.model import make_apply_fn
  graphdef, params = init_params(TINY, jax.random.key(3))
  tokens = jnp.asarray(np.random.RandomState(3).randint(0, TINY.vocab_size, (2, 7)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
  segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1]], jnp.int32)
  got = make_apply_fn(graphdef)(params, tokens, positions, segments)
  want, cache = forward(graphdef, params, tokens, positions, segments)
  assert cache is None
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("n, minimum, maximum, want", [(1, 8, None, 8), (9, 8, None, 16), (16, 8, None, 16),
                                                       (17, 16, 24, 24), (100, 16, 512, 128)])
def test_bucket_length(n, minimum, maximum, want):
  from jaxrl_topo.rollout.dense import bucket_length
  assert bucket_length(n, minimum, maximum) == want


def test_projection_contracts_in_the_activations_order_and_never_transposes_its_kernel():
  """o_proj's "BTNH,NHD->BTD" as one dot_general over (N, H) in that order: jnp.einsum contracted (H, N), and XLA
  then transposed the whole [N, H, D] kernel at every call (every layer of every decode step)."""
  from flax import nnx

  from jaxrl_topo.models.transformer import Projection, contraction

  assert contraction("BTNH,NHD->BTD") == ((2, 3), (0, 1)) and contraction("BTD,DKH->BTKH") == ((2,), (0,))
  with pytest.raises(ValueError, match="free dims"):
    contraction("BTNH,NHD->DBT")
  N, H, D = 4, 64, 256
  proj = Projection(nnx.Rngs(params=0), "BTNH,NHD->BTD", (N, H, D), ("heads", "head_dim", "embed"), jnp.float32)
  x = jax.random.normal(jax.random.key(1), (8, 1, N, H))
  np.testing.assert_allclose(proj(x), jnp.einsum("BTNH,NHD->BTD", x, proj.kernel[...]), rtol=1e-5, atol=1e-5)
  graphdef, state = nnx.split(proj)
  hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).compile().as_text()
  assert "dot" in hlo and f"f32[{H},{N},{D}]" not in hlo  # no [H, N, D] transpose of the kernel
