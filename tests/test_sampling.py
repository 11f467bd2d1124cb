"""Tests for rollout/sampling.py: kept sets vs a sorting reference, frequencies, log-probs, keys."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_topo.rollout.sampling import SamplingConfig, sample_tokens, sequence_keys, truncation_mask

V = 1000  # not a power of two, so nothing lines up with a reduction tree by luck.
# Eager vmap runs op by op and is slow on CPU; tests go through jit like the engine does.
_sample = jax.jit(sample_tokens, static_argnames="cfg")
_mask = jax.jit(truncation_mask, static_argnames="cfg")


def reference_keep(logits_V: np.ndarray, cfg: SamplingConfig) -> tuple[np.ndarray, float]:
  """Sort-based kept set; also returns how close top_p came to a cumulative-mass step.

  Starts from the same float32 logits / T as the code under test, then works in float64.
  """
  x = (logits_V.astype(np.float32) / np.float32(cfg.temperature)).astype(np.float64)
  p = np.exp(x - x.max())
  p /= p.sum()
  order = np.argsort(-x, kind="stable")
  keep = x >= x[order[cfg.top_k - 1]] if cfg.top_k else np.ones_like(x, bool)  # ties kept
  margin = np.inf
  if cfg.top_p < 1:
    cum = np.cumsum(np.where(keep, p, 0)[order]) / p[keep].sum()
    keep &= p >= p[order[np.argmax(cum >= cfg.top_p)]]  # shortest prefix, then its ties
    margin = np.abs(cum - cfg.top_p).min()
  return keep & (p >= cfg.min_p * p.max()), margin


def _random_logits(seed, B, scale=3.0):
  return np.array(jax.random.normal(jax.random.key(seed), (B, V)) * scale, np.float32)


CONFIGS = [
    SamplingConfig(top_p=0.5),
    SamplingConfig(top_p=0.9, temperature=0.7),
    SamplingConfig(top_p=0.99, temperature=1.3),
    SamplingConfig(top_p=0.2),
    SamplingConfig(top_k=50),
    SamplingConfig(top_k=7, top_p=0.8),
    SamplingConfig(min_p=0.05),
    SamplingConfig(top_k=100, top_p=0.95, min_p=0.01, temperature=0.6),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=repr)
def test_kept_set_matches_sorting_reference(cfg):
  logits_BV = _random_logits(0, 64)
  logits_BV[32:] = np.round(logits_BV[32:] * 2) / 2  # a coarse grid: many ties, some at the boundary
  got_BV = np.asarray(_mask(logits_BV, cfg=cfg))
  n_checked = 0
  for b in range(logits_BV.shape[0]):
    want_V, margin = reference_keep(logits_BV[b], cfg)
    # top_p within float32 summation error (~log2(V) * 6e-8 < 1e-6) of a cumulative-mass step:
    # float32 and float64 may both be right and disagree, so such rows are skipped.
    if margin < 1e-6:
      continue
    n_checked += 1
    np.testing.assert_array_equal(got_BV[b], want_V, err_msg=f"row {b}: kept set differs")
  assert n_checked >= 60, "too many rows skipped as ambiguous"
  assert got_BV.sum(-1).min() >= 1 and got_BV.sum(-1).max() < V  # truncation did something


def test_boundary_ties_are_all_kept():
  """p = [.4, .2, .2, .1, .1]: sorted cumsum .4, .6 reaches 0.5 at a token tied with another.

  top_p=0.5 keeps {0, 1, 2} (mass .8), not an arbitrary one of the tied 0.2s; top_k=2 likewise.
  """
  logits_1V = np.log(np.array([[0.4, 0.2, 0.2, 0.1, 0.1]], np.float32))
  for cfg in (SamplingConfig(top_p=0.5), SamplingConfig(top_k=2)):
    got = np.asarray(_mask(logits_1V, cfg))[0]
    np.testing.assert_array_equal(got, [True, True, True, False, False], err_msg=repr(cfg))
    np.testing.assert_array_equal(got, reference_keep(logits_1V[0], cfg)[0])
  got = np.asarray(_mask(logits_1V, SamplingConfig(min_p=0.45)))[0]
  np.testing.assert_array_equal(got, [True, True, True, False, False])  # .1 < .18 <= .2


@pytest.mark.parametrize(
    "cfg",
    [SamplingConfig(top_k=4, top_p=0.8, temperature=0.8), SamplingConfig(temperature=1.5),
     SamplingConfig(min_p=0.2)],
    ids=repr,
)
def test_frequencies_match_truncated_distribution(cfg):
  N = 20_000
  logits_V = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0], np.float32)
  keys_N = sequence_keys(jax.random.key(1), jnp.arange(N), jnp.zeros(N, jnp.int32))
  tokens_N, _ = _sample(
      jnp.broadcast_to(logits_V, (N, logits_V.size)), keys_N, cfg=cfg)
  freq = np.bincount(np.asarray(tokens_N), minlength=logits_V.size) / N
  keep, _ = reference_keep(logits_V, cfg)
  p = np.where(keep, np.exp(logits_V / cfg.temperature), 0.0)
  p /= p.sum()
  # Each frequency is a binomial mean with std sqrt(p(1-p)/N) <= 0.0035; 5 std devs over 7
  # tokens makes a false alarm ~1e-5 per test while a wrong order or renormalisation (>= 0.02
  # off on some token here) still fails. Dropped tokens must have exactly zero count.
  assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / N) + 1e-12), (freq, p)


@pytest.mark.parametrize(
    "cfg",
    [SamplingConfig(temperature=0.7), SamplingConfig(top_p=0.9, temperature=1.3),
     SamplingConfig(top_k=20, min_p=0.02)],
    ids=repr,
)
def test_logprob_is_full_vocab_log_softmax(cfg):
  logits_BV = _random_logits(2, 32)
  keys_B = jax.random.split(jax.random.key(3), 32)
  tokens_B, logprobs_B = _sample(jnp.asarray(logits_BV), keys_B, cfg)
  assert tokens_B.dtype == jnp.int32 and logprobs_B.dtype == jnp.float32
  want_BV = np.asarray(jax.nn.log_softmax(jnp.asarray(logits_BV) / cfg.temperature, axis=-1))
  want_B = np.take_along_axis(want_BV, np.asarray(tokens_B)[:, None], -1)[:, 0]
  np.testing.assert_allclose(logprobs_B, want_B, atol=1e-6, rtol=0,
                             err_msg="log-prob was renormalised or computed at another T")
  keep_BV = np.asarray(_mask(logits_BV, cfg))
  assert keep_BV[np.arange(32), np.asarray(tokens_B)].all(), "sampled a truncated token"


def test_greedy_is_argmax_with_untempered_logprob():
  logits_BV = np.array(_random_logits(4, 16))
  logits_BV[0, [3, 9]] = logits_BV[0].max() + 1.0  # tie: argmax picks the lower index
  cfg = SamplingConfig(greedy=True, temperature=0.0)
  tokens_B, logprobs_B = _sample(jnp.asarray(logits_BV), None, cfg)
  np.testing.assert_array_equal(tokens_B, logits_BV.argmax(-1))
  assert tokens_B[0] == 3
  want_BV = np.asarray(jax.nn.log_softmax(jnp.asarray(logits_BV), axis=-1))
  np.testing.assert_allclose(logprobs_B, want_BV[np.arange(16), logits_BV.argmax(-1)], atol=1e-6)


def test_top_k_one_equals_greedy():
  logits_BV = jnp.asarray(_random_logits(5, 16))
  keys_B = jax.random.split(jax.random.key(6), 16)
  got = _sample(logits_BV, keys_B, SamplingConfig(top_k=1))
  want = _sample(logits_BV, keys_B, SamplingConfig(greedy=True))
  chex.assert_trees_all_close(got, want, atol=1e-6)


def test_all_keeping_truncation_draws_like_fast_path():
  """min_p tiny keeps every token, so the truncation path must consume the key identically."""
  logits_BV = jnp.asarray(_random_logits(7, 16, scale=1.0))
  keys_B = jax.random.split(jax.random.key(8), 16)
  slow = SamplingConfig(min_p=1e-30)
  assert slow.truncates and np.asarray(_mask(logits_BV, slow)).all()
  chex.assert_trees_all_equal(_sample(logits_BV, keys_B, slow),
                              _sample(logits_BV, keys_B, SamplingConfig()))


def test_determinism_and_slot_independence():
  cfg = SamplingConfig(top_p=0.9)
  logits_BV = jnp.asarray(_random_logits(9, 12, scale=1.0))
  seq_ids_B, positions_B = jnp.arange(100, 112), jnp.full(12, 5)
  keys_B = sequence_keys(jax.random.key(10), seq_ids_B, positions_B)
  tokens_B, logprobs_B = _sample(logits_BV, keys_B, cfg)
  chex.assert_trees_all_equal((tokens_B, logprobs_B), _sample(logits_BV, keys_B, cfg))
  perm = np.random.default_rng(0).permutation(12)
  keys_perm = sequence_keys(jax.random.key(10), seq_ids_B[perm], positions_B[perm])
  got = _sample(logits_BV[perm], keys_perm, cfg)
  chex.assert_trees_all_equal(got, (tokens_B[perm], logprobs_B[perm]))
  other_B, _ = _sample(logits_BV, jax.random.split(jax.random.key(11), 12), cfg)
  assert (other_B != tokens_B).any(), "different keys gave identical samples"


def test_sequence_keys_differ_per_sequence_and_position():
  ids, pos = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
  keys_B = sequence_keys(jax.random.key(0), jnp.asarray(ids.ravel()), jnp.asarray(pos.ravel()))
  data_BK = np.asarray(jax.random.key_data(keys_B))
  assert len({row.tobytes() for row in data_BK}) == 64
  other = sequence_keys(jax.random.key(1), jnp.asarray(ids.ravel()), jnp.asarray(pos.ravel()))
  assert (np.asarray(jax.random.key_data(other)) != data_BK).any(axis=-1).all()


def test_compiles_once_for_a_fixed_config():
  chex.clear_trace_counter()
  fn = jax.jit(chex.assert_max_traces(sample_tokens, n=1), static_argnames="cfg")
  cfg = SamplingConfig(top_k=5, top_p=0.9, min_p=0.01)
  for seed in range(3):  # new values, same shapes: no retrace
    keys_B = jax.random.split(jax.random.key(seed), 4)
    jax.block_until_ready(fn(jnp.asarray(_random_logits(seed, 4)), keys_B, cfg=cfg))
  assert hash(cfg) == hash(SamplingConfig(top_k=5, top_p=0.9, min_p=0.01))


def test_top_p_and_min_p_compile_to_no_sort():
  """top-p's threshold is bisected, not read off a sorted vocabulary: the compiled program holds no sort op.
  (top-k goes through lax.top_k, which XLA:CPU itself lowers to a sort; GPU backends have a top-k kernel.)"""
  keys_B = jax.random.split(jax.random.key(0), 4)
  hlo = jax.jit(sample_tokens, static_argnames="cfg").lower(
      jnp.zeros((4, 1000)), keys_B, cfg=SamplingConfig(top_p=0.9, min_p=0.01)).compile().as_text()
  assert " sort(" not in hlo


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(temperature=0.0), "temperature"), (dict(temperature=-1.0), "temperature"),
     (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top_p"),
     (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2.0), "top_k"),
     (dict(min_p=-0.1), "min_p"), (dict(min_p=1.0), "min_p"), (dict(greedy=1), "greedy"),
     (dict(temperature="1"), "temperature"), (dict(temperature=1e-5), "temperature")],
)
def test_config_validation(kwargs, field):
  with pytest.raises(ValueError, match=f"{field}="):
    SamplingConfig(**kwargs)


def test_log_probs_stay_finite_and_at_most_zero_at_the_lowest_temperature():
  """A new user's trial: --temperature=1e-30 wrote log-probs of -inf and +inf (and JSON that is not JSON), and
  1e-3 gave +4e-8. Temperatures below MIN_TEMPERATURE are refused (greedy is what they mean); at it and above, the
  log-probs are a float64 reference's and 0 at most. Dividing the logits by T before subtracting their max, as
  before, missed by up to 0.003 here (the suite's XLA flags; +5e-8 with XLA's defaults)."""
  keys_B = jax.random.split(jax.random.key(1), 8)
  for scale in (3.0, 30.0):
    logits_BV = scale * jax.random.normal(jax.random.key(0), (8, 128))
    for t in (1e-4, 1e-3, 0.7):
      tok_B, lp_B = jax.jit(sample_tokens, static_argnames="cfg")(logits_BV, keys_B, cfg=SamplingConfig(temperature=t))
      scaled_BV = np.asarray(logits_BV, np.float64) / np.float32(t)
      want_BV = scaled_BV - scaled_BV.max(-1, keepdims=True)
      want_BV -= np.log(np.exp(want_BV).sum(-1, keepdims=True))
      np.testing.assert_allclose(lp_B, want_BV[np.arange(8), tok_B], rtol=1e-6, atol=1e-6, err_msg=f"{scale} {t}")
      assert float(lp_B.max()) <= 0.0, (scale, t, lp_B)
  with pytest.raises(ValueError, match="^temperature=1e-30 is below 0.0001: .* use greedy decoding"):
    SamplingConfig(temperature=1e-30)
  assert SamplingConfig(greedy=True, temperature=1e-30).greedy  # greedy ignores the temperature


def test_configs_built_in_python_check_their_scalar_types():
  """The Python API's configs skip the ConfigDict path's type checks; a wrong scalar type used to pass and fail
  deep in a jit or a schedule (OptimConfig(warmup_steps=2.5) trained with a fractional warm-up). NumPy scalars
  stand for Python ones; an int stands for a float; a bool stands for no number."""
  from jaxrl_topo.rollout.engine_config import EngineConfig
  from jaxrl_topo.train.batch import Completion
  from jaxrl_topo.train.config import LoraConfig, LossConfig, OptimConfig, TrainConfig

  for make, says in [
      (lambda: OptimConfig(warmup_steps=2.5), "OptimConfig.warmup_steps=2.5 must be of type int, not float"),
      (lambda: OptimConfig(lr=True), "OptimConfig.lr=True must be of type float, not bool"),
      (lambda: LossConfig(group_size=4, clip_low="0.2"), "LossConfig.clip_low='0.2' must be of type float, not str"),
      (lambda: EngineConfig(n_slots=8.0), "EngineConfig.n_slots=8.0 must be of type int, not float"),
      # before: a bare string adapted v_proj alone (matched by letters), a dict loss and a str seed passed
      (lambda: LoraConfig(rank=4, targets="qkv_proj"), "LoraConfig.targets='qkv_proj' must be a tuple of projection"),
      (lambda: TrainConfig(loss={"group_size": 4}), "TrainConfig.loss must be a LossConfig, not dict"),
      (lambda: TrainConfig(loss=LossConfig(group_size=4), seed="0"), "TrainConfig.seed='0' must be of type int")]:
    with pytest.raises(ValueError, match=re.escape(says)):
      make()
  assert EngineConfig(n_slots=np.int64(4), page_size=8).n_slots == 4
  assert OptimConfig(lr=1, max_grad_norm=np.float32(0.5)).lr == 1
  assert SamplingConfig(temperature=np.float64(0.7), top_k=np.int32(3)).top_k == 3
  assert Completion(np.array([1, 2]), np.array([3]), 1.0, np.array([-0.5])).reward == 1.0  # before: "truth value"
  with pytest.raises(ValueError, match="non-empty prompt"):
    Completion(np.array([], np.int32), [3], 1.0, [-0.5])


def test_config_truncates_and_greedy_accepts_zero_temperature():
  assert not SamplingConfig().truncates
  assert all(c.truncates for c in CONFIGS)
  assert SamplingConfig(greedy=True, temperature=0.0).greedy


# The sampler's noise is JAX's own (rollout/gumbel.py writes threefry out so that XLA fuses it): every draw must be
# the one jax.random.categorical makes with the same key, and every key the one jax.random.fold_in makes.
_seq_keys = jax.jit(sequence_keys)


def _reference_keys(key, seq_B, pos_B):
  return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(key, s), p))(seq_B, pos_B)


def test_sequence_keys_are_jax_fold_in_bit_for_bit():
  seq = jnp.array([0, 1, 5, -1, 2**31 - 1, 123456], jnp.int32)
  pos = jnp.array([0, 3, 77, 12, 9, 2**20], jnp.int32)
  for key in (jax.random.key(7), jax.random.key(2**40 + 3)):
    want = jax.random.key_data(_reference_keys(key, seq, pos))
    np.testing.assert_array_equal(jax.random.key_data(_seq_keys(key, seq, pos)), want)


@pytest.mark.parametrize("vocab", [1, 7, 512, 1000])
def test_gumbel_noise_is_jax_gumbel_bit_for_bit(vocab):
  from jaxrl_topo.rollout.gumbel import gumbel_BV

  keys = _reference_keys(jax.random.key(3), jnp.arange(6, dtype=jnp.int32), jnp.arange(6, dtype=jnp.int32) * 11)
  want = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
  got = jax.jit(gumbel_BV, static_argnums=1)(jax.random.key_data(keys), vocab)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.7), SamplingConfig(top_k=5, top_p=0.9)], ids=str)
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_draws_are_jax_categorical_bit_for_bit(cfg, impl):
  """Threefry keys take the fused path, other implementations jax.random itself: the same draws either way."""
  logits = _random_logits(5, 64)
  keys = _reference_keys(jax.random.key(11, impl=impl), jnp.arange(64, dtype=jnp.int32), jnp.full((64,), 9, jnp.int32))
  scaled = logits / np.float32(cfg.temperature)
  if cfg.truncates:
    scaled = np.where(_mask(logits, cfg), scaled, -np.inf)
  want = jax.vmap(jax.random.categorical)(keys, scaled)
  tokens, _ = _sample(logits, keys, cfg=cfg)
  np.testing.assert_array_equal(tokens, want)


def test_argmax_is_jnp_argmax_with_ties_nans_and_infinities():
  from jaxrl_topo.rollout.sampling import argmax_BV

  x = np.random.default_rng(0).integers(0, 4, (64, 33)).astype(np.float32)  # many ties
  x[3, 5] = np.nan
  x[4, :] = -np.inf
  x[5, 7] = np.inf
  x[6, [2, 9]] = np.nan
  x[7, :] = np.nan
  x[8, [1, 4]] = np.inf
  np.testing.assert_array_equal(jax.jit(argmax_BV)(x), jnp.argmax(x, axis=-1))
