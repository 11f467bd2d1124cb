"""Tests for rl/core.py and rl/advantages.py: hand-worked values, microbatch invariance, masking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_topo.rl import advantages as adv
from jaxrl_topo.rl.core import AGG_MODES, aggregate, masked_mean, masked_sum, masked_whiten, normalizers

GARBAGE = 1e30  # finite but absurd: what a padded slot may hold; it must never leak into a result.
SQ2 = np.sqrt(2.0)

# Eager dispatch compiles every primitive on its own and is slow on CPU: call through jit, as the trainer does.
grpo = jax.jit(adv.grpo, static_argnames=("group_size", "scale_by_std", "std_ddof"))
dr_grpo = jax.jit(adv.dr_grpo, static_argnames="group_size")
rloo = jax.jit(adv.rloo, static_argnames="group_size")
reinforce_pp = jax.jit(adv.reinforce_pp, static_argnames="gamma")
reinforce_pp_baseline = jax.jit(adv.reinforce_pp_baseline, static_argnames="group_size")
gae = jax.jit(adv.gae, static_argnames=("gamma", "lam"))
aggregate_jit = jax.jit(aggregate, static_argnames="mode")


def test_masked_helpers_by_hand():
  """x = [[1, 2, G], [3, G, G]] with G masked out: sum 6, mean 2, row means [1.5, 3]; whiten of [1, 3] is ±1."""
  x = jnp.array([[1.0, 2.0, GARBAGE], [3.0, -GARBAGE, GARBAGE]])
  m = jnp.array([[1, 1, 0], [1, 0, 0]], bool)
  np.testing.assert_allclose(masked_sum(x, m), 6.0)
  np.testing.assert_allclose(masked_mean(x, m), 2.0)
  np.testing.assert_allclose(masked_mean(x, m, axis=1), [1.5, 3.0])
  np.testing.assert_allclose(masked_mean(x, jnp.zeros_like(m)), 0.0, err_msg="empty mask must average to 0")
  # mean 2, population std sqrt((1 + 0 + 1)/3) = sqrt(2/3); masked slots come out as 0.
  np.testing.assert_allclose(masked_whiten(x, m), [[-np.sqrt(1.5), 0, 0], [np.sqrt(1.5), 0, 0]], rtol=1e-6)


def test_masked_sum_gradient_is_zero_not_nan_on_garbage():
  """d/dx Σ x·m is m even where x is inf: the select happens before the multiply."""
  x = jnp.array([1.0, jnp.inf, 2.0])
  g = jax.grad(lambda x: masked_sum(x, jnp.array([1.0, 0.0, 1.0])))(x)
  np.testing.assert_array_equal(g, [1.0, 0.0, 1.0])


def test_aggregate_modes_by_hand():
  """loss [[1, 2, 9], [3, 9, 9]], mask [[1, 1, 0], [1, 0, 0]]: n_tokens 3, n_seqs 2, max_len 3.

  token-mean 6/3 = 2; seq-mean-token-mean ((1+2)/2 + 3/1)/2 = 2.25; seq-mean-token-sum 6/2 = 3;
  seq-mean-token-sum-norm 6/(2·3) = 1.
  """
  loss = jnp.array([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
  mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  norm = normalizers(mask)
  np.testing.assert_allclose([norm.n_tokens, norm.n_seqs, norm.max_len], [3.0, 2.0, 3.0])
  want = {"token-mean": 2.0, "seq-mean-token-mean": 2.25, "seq-mean-token-sum": 3.0, "seq-mean-token-sum-norm": 1.0}
  assert set(want) == set(AGG_MODES)
  for mode, value in want.items():
    np.testing.assert_allclose(aggregate(loss, mask, mode, norm), value, rtol=1e-6, err_msg=mode)


def test_normalizers_empty_rows():
  """Rows without tokens count in n_seqs by default (B = 3) and not with count_empty_rows=False (2)."""
  mask = jnp.array([[1, 1], [0, 0], [0, 1]], bool)
  assert float(normalizers(mask).n_seqs) == 3.0
  assert float(normalizers(mask, count_empty_rows=False).n_seqs) == 2.0
  assert float(normalizers(jnp.zeros((2, 4))).n_tokens) == 1.0  # floored: an all-padding batch gives 0, not NaN


def test_aggregate_rejects_unknown_mode():
  with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
    aggregate(jnp.ones((1, 2)), jnp.ones((1, 2)), "sequence-mean", normalizers(jnp.ones((1, 2))))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("pieces", [1, 2, 4])
def test_aggregate_microbatches_sum_to_full_batch(mode, pieces):
  """Aggregating each microbatch with the GLOBAL normalisers and summing gives the full-batch value.

  A failure means gradient accumulation weighs microbatches wrongly (a per-microbatch denominator).
  Lengths differ per row and row 3 is empty, so a per-microbatch token count would give another number.
  """
  rng = np.random.default_rng(0)
  loss = rng.normal(size=(8, 6)).astype(np.float32)
  mask = rng.uniform(size=(8, 6)) < np.linspace(0.1, 0.9, 8)[:, None]
  mask[3] = False
  norm = normalizers(mask)
  full = aggregate_jit(loss, mask, mode, norm)
  pairs = zip(np.split(loss, pieces), np.split(mask, pieces), strict=True)
  parts = [aggregate_jit(l, m, mode, norm) for l, m in pairs]
  np.testing.assert_allclose(sum(parts), full, rtol=1e-5, atol=1e-7)
  # And the full value against a plain numpy transcription of the formula.
  l, m = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
  want = {"token-mean": (l * m).sum() / m.sum(),
          "seq-mean-token-mean": ((l * m).sum(1) / np.maximum(m.sum(1), 1)).sum() / 8,
          "seq-mean-token-sum": (l * m).sum() / 8,
          "seq-mean-token-sum-norm": (l * m).sum() / (8 * 6)}[mode]
  np.testing.assert_allclose(full, want, rtol=1e-5)


def test_grpo_by_hand():
  """G=4, r = [0, 0, 1, 3]: mean 1, std(ddof=1) = sqrt(6/3) = √2 -> [-1/√2, -1/√2, 0, 2/√2].

  Second group [2, 2, 2, 2]: std 0, so A = 0/eps = 0 (never NaN). ddof=0: std = sqrt(6/4) = √1.5.
  Dr. GRPO (no std): [-1, -1, 0, 2].
  """
  r = jnp.array([0.0, 0.0, 1.0, 3.0, 2.0, 2.0, 2.0, 2.0])
  np.testing.assert_allclose(grpo(r, 4), [-1 / SQ2, -1 / SQ2, 0, 2 / SQ2, 0, 0, 0, 0], rtol=1e-5)
  np.testing.assert_allclose(grpo(r, 4, std_ddof=0)[:4], np.array([-1, -1, 0, 2]) / np.sqrt(1.5), rtol=1e-5)
  np.testing.assert_allclose(dr_grpo(r, 4), [-1, -1, 0, 2, 0, 0, 0, 0])
  np.testing.assert_allclose(grpo(r, 4, scale_by_std=False), dr_grpo(r, 4))


def test_grpo_groups_are_rows_b_over_G():
  """Group-major, G=2: r = [0, 1 | 5, 5] pairs rows (0, 1) and (2, 3), never (0, 2).

  Pair 1: mean 0.5, std(ddof=1) = sqrt(0.5/1) = 1/√2 -> ∓0.5·√2 = ∓1/√2. Pair 2: equal rewards -> 0.
  """
  a = grpo(jnp.array([0.0, 1.0, 5.0, 5.0]), 2)
  np.testing.assert_allclose(a, [-1 / SQ2, 1 / SQ2, 0, 0], rtol=1e-5)


def test_group_size_errors():
  with pytest.raises(ValueError, match="divide"):
    adv.grpo(jnp.zeros(6), 4)
  with pytest.raises(ValueError, match="ddof"):
    adv.grpo(jnp.zeros(3), 1)
  with pytest.raises(ValueError, match="RLOO"):
    adv.rloo(jnp.zeros(3), 1)


def test_rloo_by_hand():
  """G=4, r = [0, 0, 1, 3]: the others average 4/3, 4/3, 1, 1/3 -> [-4/3, -4/3, 0, 8/3] = 4/3·(r - mean)."""
  r = jnp.array([0.0, 0.0, 1.0, 3.0])
  np.testing.assert_allclose(rloo(r, 4), [-4 / 3, -4 / 3, 0, 8 / 3], rtol=1e-6, atol=1e-7)
  r2 = np.random.default_rng(1).normal(size=12).astype(np.float32)
  np.testing.assert_allclose(rloo(r2, 3), 1.5 * dr_grpo(r2, 3), rtol=1e-5, atol=1e-6)


def test_token_placement_by_hand():
  """broadcast: [2, -1] over masks [[1,1,0],[0,1,1]] -> [[2,2,0],[0,-1,-1]].

  Outcome reward on the last response token: [[0,2,0],[0,0,-1]]; an empty row gets nothing.
  """
  mask = jnp.array([[1, 1, 0], [0, 1, 1], [0, 0, 0]], bool)
  a = jnp.array([2.0, -1.0, 7.0])
  np.testing.assert_array_equal(adv.broadcast_to_tokens(a, mask), [[2, 2, 0], [0, -1, -1], [0, 0, 0]])
  np.testing.assert_array_equal(adv.sequence_rewards_to_tokens(a, mask), [[0, 2, 0], [0, 0, -1], [0, 0, 0]])


def test_reinforce_pp_by_hand():
  """Row 1: r = [0, 0, 1], γ = 0.5 -> G = [0.25, 0.5, 1]. Row 2: one token, r = 0.5 -> G = 0.5 (masked slots skipped).

  Batch-whitened over the 4 tokens [0.25, 0.5, 1, 0.5]: μ = 0.5625, deviations [-0.3125, -0.0625, 0.4375, -0.0625],
  σ = sqrt(0.296875/4) = 0.272431 -> [-1.147079, -0.229416, 1.605910 | -0.229416].
  The masked slot of row 2 holds a huge reward that must change nothing.
  """
  r = jnp.array([[0.0, 0.0, 1.0], [0.5, GARBAGE, 0.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
  got = reinforce_pp(r, mask, gamma=0.5)
  np.testing.assert_allclose(got, [[-1.147079, -0.229416, 1.605910], [-0.229416, 0, 0]], rtol=1e-5)


def test_reinforce_pp_skips_masked_gap():
  """Mask [1, 0, 1] with r = [0, 9, 1], γ = 0.5: the gap costs no discount -> G = [0.5, 0, 1] before whitening."""
  r = jnp.array([[0.0, 9.0, 1.0]])
  got = reinforce_pp(r, jnp.array([[1, 0, 1]], bool), gamma=0.5)
  np.testing.assert_allclose(got, [[-1.0, 0.0, 1.0]], rtol=1e-5)  # whiten([0.5, 1]) = [-1, 1]


def test_reinforce_pp_baseline_by_hand():
  """G=2, r = [1, 0], 1 and 3 tokens: centred [0.5, -0.5] -> tokens [0.5 | -0.5 ×3]; μ = -0.25, σ = √0.1875.

  -> [0.75/σ | -0.25/σ ×3] = [1.732051 | -0.577350 ×3].
  """
  mask = jnp.array([[1, 0, 0], [1, 1, 1]], bool)
  got = reinforce_pp_baseline(jnp.array([1.0, 0.0]), 2, mask)
  s = np.sqrt(0.1875)
  np.testing.assert_allclose(got, [[0.75 / s, 0, 0], [-0.25 / s] * 3], rtol=1e-5)
  np.testing.assert_allclose(0.75 / s, 1.732051, rtol=1e-6)


def test_gae_by_hand():
  """1×3, r = [0, 0, 1], V = [0.5, 0.6, 0.7], γ = 0.9, λ = 0.8 (γλ = 0.72), V after the end = 0:

  δ_3 = 1 - 0.7 = 0.3, δ_2 = 0.9·0.7 - 0.6 = 0.03, δ_1 = 0.9·0.6 - 0.5 = 0.04;
  A_3 = 0.3, A_2 = 0.03 + 0.72·0.3 = 0.246, A_1 = 0.04 + 0.72·0.246 = 0.21712; R = A + V = [0.71712, 0.846, 1].
  A 4th, masked slot holding garbage changes nothing and comes out 0.
  """
  r = jnp.array([[0.0, 0.0, 1.0, GARBAGE]])
  v = jnp.array([[0.5, 0.6, 0.7, -GARBAGE]])
  a, ret = gae(r, v, jnp.array([[1, 1, 1, 0]], bool), gamma=0.9, lam=0.8)
  np.testing.assert_allclose(a, [[0.21712, 0.246, 0.3, 0]], rtol=1e-5)
  np.testing.assert_allclose(ret, [[0.71712, 0.846, 1.0, 0]], rtol=1e-5)


def test_gae_lambda_one_is_monte_carlo():
  """γ = λ = 1: A_t = Σ_{k>=t} r_k - V_t, so returns are reward-to-go whatever V is; a masked gap is skipped."""
  r, v = np.random.default_rng(2).normal(size=(2, 3, 5)).astype(np.float32)
  mask = jnp.array([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], bool)
  a, ret = jax.jit(lambda r, v: gae(r, v, mask, gamma=1.0, lam=1.0))(r, v)
  rm = np.where(mask, r, 0)
  to_go = np.where(mask, np.cumsum(rm[:, ::-1], axis=1)[:, ::-1], 0)
  np.testing.assert_allclose(ret, to_go, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(a, np.where(mask, to_go - v, 0), rtol=1e-5, atol=1e-6)


def test_advantage_registry_shares_one_signature():
  """Each name maps to fn(rewards_B, group_size, mask_BT) -> adv_BT matching the per-sequence function."""
  r = jnp.array([0.0, 0.0, 1.0, 3.0])
  mask = jnp.array([[1, 1], [1, 0], [1, 1], [0, 1]], bool)
  assert set(adv.ADVANTAGE_FNS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"}
  fns = {name: jax.jit(fn, static_argnums=1) for name, fn in adv.ADVANTAGE_FNS.items()}
  np.testing.assert_allclose(fns["grpo"](r, 4, mask), adv.broadcast_to_tokens(grpo(r, 4), mask))
  np.testing.assert_allclose(fns["rloo"](r, 4, mask)[3], [0, 8 / 3], rtol=1e-6)
  np.testing.assert_allclose(fns["dr_grpo"](r, 4, mask)[0], [-1, -1])
  got = fns["reinforce_pp_baseline"](r, 4, mask)
  np.testing.assert_allclose(masked_mean(got, mask), 0.0, atol=1e-6)  # batch-whitened over the 6 tokens
  np.testing.assert_allclose(masked_mean(got**2, mask), 1.0, rtol=1e-5)


def _step_advantages(rewards_B, mask_BT, **loss):
  """The train step's advantages (train/step.py) for a LossConfig built from `loss`, zero values, one microbatch."""
  from types import SimpleNamespace

  from jaxrl_topo.train.config import LossConfig
  from jaxrl_topo.train.step import _advantages

  lc = LossConfig(**loss)

  def advantages(rewards_MB, mask_MBT):  # the batch holds only what _advantages reads
    batch = SimpleNamespace(rewards_MB=rewards_MB, mask_MBT=mask_MBT, sampler_logp_MBT=None)
    return _advantages(batch, {"old_values": jnp.zeros_like(mask_MBT)}, lc)[0]

  mask = jnp.asarray(mask_BT, jnp.float32)[None]
  return np.asarray(jax.jit(advantages)(jnp.asarray(rewards_B, jnp.float32)[None], mask)[0])


def test_the_steps_grpo_std_follows_the_configs_ddof():
  """r = [0, 0, 1, 3]: mean 1, squared deviations 6; unbiased std √(6/3) = √2, population std √(6/4) = √1.5."""
  r, mask = [0.0, 0.0, 1.0, 3.0], np.ones((4, 2))
  centred = np.array([-1.0, -1.0, 0.0, 2.0])[:, None] * mask
  for ddof, std in ((1, SQ2), (0, np.sqrt(1.5))):
    got = _step_advantages(r, mask, group_size=4, grpo_std_ddof=ddof)
    np.testing.assert_allclose(got, centred / (std + 1e-6), rtol=1e-6, err_msg=f"grpo_std_ddof={ddof}")


def test_the_steps_gae_whitening_can_be_switched_off():
  """Zero values, gamma 1, lam 0.95, reward at the last token: A_t = 0.95^(T-1-t) r, raw or whitened."""
  mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
  raw = np.array([[0.95 * 2, 2, 0], [0.95**2, 0.95, 1]])
  got = _step_advantages([2.0, 1.0], mask, group_size=2, advantage="gae", critic="shared", gae_whiten=False)
  np.testing.assert_allclose(got, raw, rtol=1e-6)
  on = raw[mask != 0]
  whitened = _step_advantages([2.0, 1.0], mask, group_size=2, advantage="gae", critic="shared")
  np.testing.assert_allclose(whitened[mask != 0], (on - on.mean()) / (on.std() + 1e-8), rtol=1e-5)
