"""Training attention (models/attention.py) against the dense reference: values, gradients, memory.

The reference is today's dense masked softmax (`layers.gqa_attention` + `causal_segment_mask`).
Inputs are packed rows (several segments, then padding) and padded rows (one segment), with a tile
size that does not divide T so the padded tail of the last tile is exercised too.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_topo.models import attention
from jaxrl_topo.models.model import abstract_model, forward, init_params
from jaxrl_topo.models.presets import PRESETS

B, T, H = 2, 45, 16


def _segments(rng, packed: bool):
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    if packed:  # three sequences of random length, then padding
      cuts = np.sort(rng.choice(np.arange(2, T - 4), 3, replace=False))
      for i, (lo, hi) in enumerate(zip([0, *cuts[:2]], cuts, strict=True)):
        seg[b, lo:hi] = i + 1
    else:
      seg[b, : T - 7 * b] = 1
  return seg


def _qkv(rng, N, K, dtype):
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  return f(B, T, N, H), f(B, T, K, H), f(B, T, K, H), f(B, T, N, H)


@functools.partial(jax.jit, static_argnames=("impl", "block"))
def _value_and_grads(q, k, v, w, seg, *, impl, block=16):
  loss = lambda q, k, v: jnp.sum(attention.attention(q, k, v, seg, impl=impl, block=block).astype(jnp.float32) * w)
  out = attention.attention(q, k, v, seg, impl=impl, block=block)
  return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("impl", ["flash", "xla"])
@pytest.mark.parametrize("N, K", [(4, 4), (4, 2), (8, 2), (8, 1)], ids=["G1", "G2", "G4", "G8"])
def test_attention_equals_reference_fp32(N, K, impl, packed):
  rng = np.random.default_rng(N * 10 + K)
  q, k, v, w = _qkv(rng, N, K, jnp.float32)
  seg = jnp.asarray(_segments(rng, packed))
  want, want_g = _value_and_grads(q, k, v, w, seg, impl="reference")
  got, got_g = _value_and_grads(q, k, v, w, seg, impl=impl)
  np.testing.assert_allclose(got, want, atol=2e-6, err_msg=f"{impl} output")
  for name, g, r in zip("qkv", got_g, want_g, strict=True):
    np.testing.assert_allclose(g, r, atol=1e-5, err_msg=f"{impl} d{name}")


@pytest.mark.parametrize("N, K", [(4, 1), (8, 8)], ids=["G4", "G1"])
def test_flash_bf16_is_as_close_as_the_reference_is(N, K):
  """bf16 inputs: flash and the bf16 reference are each within bf16 rounding of the fp32 truth,
  and flash is no further from it than the reference (it accumulates in fp32 throughout)."""
  rng = np.random.default_rng(7)
  q, k, v, w = _qkv(rng, N, K, jnp.float32)
  seg = jnp.asarray(_segments(rng, True))
  truth, truth_g = _value_and_grads(q, k, v, w, seg, impl="reference")
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  for impl in ("flash", "reference"):
    out, grads = _value_and_grads(*bf, w, seg, impl=impl)
    assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
    err = float(jnp.abs(out.astype(jnp.float32) - truth).max())
    assert err < 0.03, f"{impl} bf16 output off by {err}"
    gerr = max(float(jnp.abs(g.astype(jnp.float32) - t).max() / jnp.abs(t).max()) for g, t in zip(grads, truth_g,
                                                                                                  strict=True))
    assert gerr < 0.03, f"{impl} bf16 gradients off by {gerr:.3f} of their max"


def test_block_size_does_not_change_the_result():
  rng = np.random.default_rng(3)
  q, k, v, w = _qkv(rng, 4, 2, jnp.float32)
  seg = jnp.asarray(_segments(rng, True))
  outs = [_value_and_grads(q, k, v, w, seg, impl="flash", block=b)[0] for b in (8, 16, 64)]
  for o in outs[1:]:
    np.testing.assert_allclose(o, outs[0], atol=2e-6)


FAMILIES = {
    "qwen3": PRESETS["tiny"],
    "llama": dataclasses.replace(PRESETS["tiny"], family="llama", qk_norm=False, tie_embeddings=False,
                                 n_kv_heads=1),
    "qwen2": dataclasses.replace(PRESETS["tiny"], family="qwen2", qk_norm=False, qkv_bias=True, n_kv_heads=4),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_logits_and_grads_flash_equal_reference(family):
  """Each family's model, packed rows: logits and parameter gradients equal the reference attention's."""
  cfg = dataclasses.replace(FAMILIES[family], attn_block=8)
  _, params = init_params(cfg, jax.random.key(0))
  params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), params)
  rng = np.random.default_rng(0)
  seg = _segments(rng, True)
  pos = np.zeros_like(seg)
  for b in range(B):
    for s in np.unique(seg[b]):
      idx = np.nonzero(seg[b] == s)[0]
      pos[b, idx] = np.arange(len(idx))
  tokens = rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32)
  results = {}
  for impl in ("flash", "reference"):
    graphdef, _ = abstract_model(dataclasses.replace(cfg, attention=impl))
    f = lambda p, g=graphdef: forward(g, p, tokens, pos, seg)[0]
    loss = lambda p, f=f: jnp.sum(jnp.where(seg[..., None] > 0, jax.nn.log_softmax(f(p)), 0.0)[..., 0])
    results[impl] = jax.jit(lambda p, f=f, loss=loss: (f(p), jax.grad(loss)(p)))(params)
  np.testing.assert_allclose(results["flash"][0], results["reference"][0], atol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), results["flash"][1], results["reference"][1])


def _temp_bytes(impl: str, T_: int) -> int:
  """Compiled scratch of one attention layer's forward + backward at T_ tokens (nothing runs)."""
  shape = jax.ShapeDtypeStruct((4, T_, 4, 64), jnp.float32)
  kv = jax.ShapeDtypeStruct((4, T_, 2, 64), jnp.float32)
  seg = jax.ShapeDtypeStruct((4, T_), jnp.int32)
  loss = lambda q, k, v, s: jnp.sum(attention.attention(q, k, v, s, impl=impl, block=128) ** 2)
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, kv, kv, seg).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_flash_scratch_grows_linearly_the_reference_quadratically():
  """4x the tokens: flash's scratch grows about 4x (at most 6x), the reference's about 16x."""
  flash = [_temp_bytes("flash", t) for t in (512, 2048)]
  ref = [_temp_bytes("reference", t) for t in (512, 2048)]
  assert flash[1] <= 6 * flash[0], f"flash scratch {flash}: not linear in T"
  assert ref[1] >= 12 * ref[0], f"reference scratch {ref}: expected quadratic growth"
  assert flash[1] * 4 < ref[1], f"at 2,048 tokens flash {flash[1]} vs reference {ref[1]} bytes"


@pytest.mark.parametrize("N, K", [(4, 2), (8, 1)], ids=["G2", "G8"])
def test_cached_prefill_attention_equals_the_masked_reference(N, K):
  """Prefill over a contiguous cache of S = 70 slots (not a multiple of the 32-token block): each query
  sees the slots up to its own position."""
  from jaxrl_topo.models.layers import gqa_attention

  rng = np.random.default_rng(N + K)
  S, Tq = 70, 12
  q = jnp.asarray(rng.normal(size=(B, Tq, N, H)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32) for _ in range(2))
  positions = jnp.asarray(rng.integers(0, S, (B, Tq)), jnp.int32)
  want = gqa_attention(q, k, v, jnp.arange(S)[None, None, :] <= positions[:, :, None])
  got = jax.jit(functools.partial(attention.cached_attention, block=32))(q, k, v, positions)
  np.testing.assert_allclose(got, want, atol=2e-6)


def test_auto_trains_with_cudnn_only_where_its_limits_allow():
  """model.attention=auto (the default): cuDNN on an Ampere-or-newer GPU for bf16 padded rows with head_dim a multiple
  of 8 up to 128; flash for packed rows, fp32, another head_dim, an older GPU, or a CPU; a name given is kept."""
  training_attention = attention.training_attention
  gpu = dict(platform="gpu", dtype="bfloat16", packed=False, head_dim=64, compute_capability="9.0")
  assert training_attention("auto", **gpu) == "cudnn"
  for change in (dict(packed=True), dict(dtype="float32"), dict(head_dim=20), dict(head_dim=256),
                 dict(compute_capability="7.0"), dict(compute_capability=None), dict(compute_capability="gfx90a"),
                 dict(platform="cpu")):
    assert training_attention("auto", **{**gpu, **change}) == "flash", change
  assert training_attention("xla", **gpu) == "xla" and training_attention("flash", **gpu) == "flash"
