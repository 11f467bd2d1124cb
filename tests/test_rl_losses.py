"""Tests for rl/losses.py and rl/offpolicy.py: hand-worked values, gradients vs finite differences, masking."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_topo.rl.core import aggregate, normalizers
from jaxrl_topo.rl.losses import KL_KINDS, POLICY_LOSS_FNS, cispo, gspo, kl_loss, kl_penalty, ppo_clip, value_loss
from jaxrl_topo.rl.offpolicy import effective_sample_size, truncated_is_weight

GARBAGE = 1e4  # exp(1e4) overflows fp32: an unsanitised masked slot would turn into inf or NaN.
LN2 = np.log(2.0)


def _jit(fn, **hyper):
  """fn with its hyper-parameters bound, jitted: eager dispatch compiles op by op and is slow on CPU."""
  return jax.jit(functools.partial(fn, **hyper))


def _jit_grad(fn, **hyper):
  """∂/∂(first argument) of fn(...)[0].sum(), jitted; later arguments are data (no gradient)."""
  return jax.jit(jax.grad(lambda x, *args: fn(x, *args, **hyper)[0].sum()))


def _k3(ratio):
  return ratio - 1 - np.log(ratio)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
  """logp = log 0.5, ref = log 0.25, d = ref - logp = -ln 2:

  k1 = -d = ln 2 = 0.693147; k2 = d²/2 = 0.240227; k3 = e^d - d - 1 = 0.5 + ln 2 - 1 = 0.193147.
  """
  logp, ref = jnp.log(jnp.array([[0.5]])), jnp.log(jnp.array([[0.25]]))
  want = {"k1": LN2, "k2": LN2**2 / 2, "k3": 0.5 + LN2 - 1}
  assert set(want) == set(KL_KINDS)
  for kind, value in want.items():
    np.testing.assert_allclose(kl_penalty(logp, ref, kind), [[value]], rtol=1e-6, err_msg=kind)
  np.testing.assert_allclose([0.693147, 0.240227, 0.193147], list(want.values()), rtol=1e-5)
  with pytest.raises(ValueError, match="k3"):
    kl_penalty(logp, ref, "k4")


def test_kl_loss_masks_and_reports_mean():
  """Tokens (0.5 vs 0.25) and (0.25 vs 0.25) plus a garbage slot: k3 = [0.193147, 0, 0], kl/mean = 0.193147/2."""
  logp = jnp.log(jnp.array([[0.5, 0.25, 1.0]])).at[0, 2].set(-GARBAGE)
  ref = jnp.log(jnp.array([[0.25, 0.25, 1.0]])).at[0, 2].set(GARBAGE)
  kl, metrics = _jit(kl_loss)(logp, ref, jnp.array([[1, 1, 0]], bool))
  np.testing.assert_allclose(kl, [[0.5 + LN2 - 1, 0, 0]], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(metrics["kl/mean"], (0.5 + LN2 - 1) / 2, rtol=1e-6)


# ---------------------------------------------------------------- PPO


def test_ppo_each_branch_by_hand():
  """ε_low = ε_high = 0.2, dual clip c = 3; (ρ, A) per token:

    (1.1,  1): max(-1.1, -1.1) = -1.1  unclipped, ∂/∂logp = -A·ρ = -1.1
    (1.5,  1): max(-1.5, -1.2) = -1.2  clipped high, no gradient
    (0.5, -1): max( 0.5,  0.8) =  0.8  clipped low, no gradient
    (4.0, -1): max( 4.0,  1.2) =  4.0 -> min(4, c·|A| = 3) = 3  dual clip, no gradient (without it: ∂ = 4)
  clip_frac 2/4 (1 high, 1 low), dual_clip_frac 1/4, ratio mean 7.1/4 = 1.775, max 4,
  approx_kl = mean(ρ - 1 - ln ρ) = (0.004690 + 0.094535 + 0.193147 + 1.613706)/4 = 0.476519.
  """
  ratio = np.array([1.1, 1.5, 0.5, 4.0])
  old = jnp.array([[0.3, -1.0, -2.0, -0.5]])
  logp = old + jnp.log(jnp.asarray(ratio))[None, :]
  a = jnp.array([[1.0, 1.0, -1.0, -1.0]])
  mask = jnp.ones((1, 4), bool)
  loss, m = _jit(ppo_clip, dual_clip=3.0)(logp, old, a, mask)
  np.testing.assert_allclose(loss, [[-1.1, -1.2, 0.8, 3.0]], rtol=1e-5)
  want = {"policy/clip_frac": 0.5, "policy/clip_frac_high": 0.25, "policy/clip_frac_low": 0.25,
          "policy/dual_clip_frac": 0.25, "policy/ratio_mean": 1.775, "policy/ratio_max": 4.0,
          "policy/approx_kl": 0.476519}
  for key, value in want.items():
    np.testing.assert_allclose(m[key], value, rtol=1e-5, err_msg=key)
  np.testing.assert_allclose(_k3(ratio).mean(), 0.476519, rtol=1e-5)
  np.testing.assert_allclose(_jit_grad(ppo_clip, dual_clip=3.0)(logp, old, a, mask), [[-1.1, 0, 0, 0]], rtol=1e-5)
  np.testing.assert_allclose(_jit_grad(ppo_clip)(logp, old, a, mask), [[-1.1, 0, 0, 4.0]], rtol=1e-5)


def test_ppo_clip_higher():
  """DAPO clip-higher: ρ = 1.25, A = 1 is clipped to -1.2 at ε_high = 0.2 but kept (-1.25) at ε_high = 0.28."""
  logp, old, a, mask = jnp.log(jnp.array([[1.25]])), jnp.zeros((1, 1)), jnp.ones((1, 1)), jnp.ones((1, 1))
  np.testing.assert_allclose(ppo_clip(logp, old, a, mask)[0], [[-1.2]], rtol=1e-6)
  loss, m = ppo_clip(logp, old, a, mask, clip_low=0.2, clip_high=0.28)
  np.testing.assert_allclose(loss, [[-1.25]], rtol=1e-6)
  assert float(m["policy/clip_frac"]) == 0.0
  with pytest.raises(ValueError, match="dual_clip"):
    ppo_clip(logp, old, a, mask, dual_clip=1.0)


# ---------------------------------------------------------------- GSPO, CISPO, value


def test_gspo_two_sequences_by_hand():
  """ε = 0.2, A = 1 for both rows; row 2 also has a garbage slot that is masked out.

  Row 1 log-ratios [0, 0.2]: s = e^0.1 = 1.105171, inside [0.8, 1.2]: loss -1.105171 per token, and
  ∂(token-mean)/∂logp_1t = -A·s/n_tokens = -1.105171/4. Row 2 [0.5, 0.5]: s = e^0.5 = 1.648721 > 1.2:
  loss -1.2 per token, gradient 0. Sequence clip_frac 1/2, ratio mean (1.105171 + 1.648721)/2 = 1.376946.
  """
  old = jnp.array([[-1.0, -2.0, 0.0], [-0.5, -0.7, GARBAGE]])
  logp = old + jnp.array([[0.0, 0.2, 0.0], [0.5, 0.5, -2 * GARBAGE]])
  mask = jnp.array([[1, 1, 0], [1, 1, 0]], bool)
  a = jnp.ones((2, 3))
  loss, m = _jit(gspo, clip_low=0.2, clip_high=0.2)(logp, old, a, mask)
  np.testing.assert_allclose(loss, [[-1.105171, -1.105171, 0], [-1.2, -1.2, 0]], rtol=1e-5)
  np.testing.assert_allclose(m["policy/clip_frac"], 0.5)
  np.testing.assert_allclose(m["policy/ratio_mean"], 1.376946, rtol=1e-5)
  np.testing.assert_allclose(m["policy/ratio_max"], 1.648721, rtol=1e-5)
  norm = normalizers(mask)
  g = jax.jit(jax.grad(lambda lp: aggregate(gspo(lp, old, a, mask, clip_low=0.2, clip_high=0.2)[0], mask,
                                            "token-mean", norm)))(logp)
  np.testing.assert_allclose(g, [[-1.105171 / 4, -1.105171 / 4, 0], [0, 0, 0]], rtol=1e-5)


def test_cispo_value_and_gradient_by_hand():
  """Token 1: logp = ln 0.5, old = ln 0.25 (ρ = 2), A = 1, ε_high = 0.28: w = 1.28, loss = -1.28·ln 0.5 = 0.887228,
  ∂/∂logp = -w·A = -1.28. Token 2: ρ = 0.5, A = -2, logp = ln 0.25: no lower bound -> w = 0.5,
  loss = 0.5·2·ln 0.25 = -1.386294, ∂ = +1; with ε_low = 0.2, w = 0.8: loss = 1.6·ln 0.25 = -2.218071, ∂ = +1.6.
  Unlike PPO, the truncated token keeps a gradient.
  """
  logp = jnp.log(jnp.array([[0.5, 0.25]]))
  old = jnp.log(jnp.array([[0.25, 0.5]]))
  a = jnp.array([[1.0, -2.0]])
  mask = jnp.ones((1, 2))
  for clip_low, want_loss, want_grad in [(None, [0.887228, -1.386294], [-1.28, 1.0]),
                                         (0.2, [0.887228, -2.218071], [-1.28, 1.6])]:
    loss, m = _jit(cispo, clip_high=0.28, clip_low=clip_low)(logp, old, a, mask)
    np.testing.assert_allclose(loss, [want_loss], rtol=1e-5)
    grad = _jit_grad(cispo, clip_high=0.28, clip_low=clip_low)(logp, old, a, mask)
    np.testing.assert_allclose(grad, [want_grad], rtol=1e-5)
    np.testing.assert_allclose(m["policy/clip_frac"], 0.5 if clip_low is None else 1.0)


def test_value_loss_both_branches():
  """c = 0.2, R = 1. Token 1: V_old = 0.5, V = 0: max((0-1)², (0.5-0.2-1)² = 0.49)/2 = 0.5, unclipped,
  ∂/∂V = V - R = -1. Token 2: V_old = 2, V = 1: max(0, (2-0.2-1)² = 0.64)/2 = 0.32, clipped, ∂/∂V = 0.
  Token 3 is masked garbage.
  clip_frac 1/2, value/mean 0.5, value/mse (1 + 0)/2 = 0.5.
  """
  v = jnp.array([[0.0, 1.0, GARBAGE]])
  old = jnp.array([[0.5, 2.0, -GARBAGE]])
  ret = jnp.array([[1.0, 1.0, GARBAGE]])
  mask = jnp.array([[1, 1, 0]], bool)
  loss, m = _jit(value_loss, clip=0.2)(v, old, ret, mask)
  np.testing.assert_allclose(loss, [[0.5, 0.32, 0]], rtol=1e-5)
  np.testing.assert_allclose([m["value/clip_frac"], m["value/mean"], m["value/mse"]], [0.5, 0.5, 0.5], rtol=1e-6)
  np.testing.assert_allclose(_jit_grad(value_loss, clip=0.2)(v, old, ret, mask), [[-1, 0, 0]], atol=1e-6)


# ---------------------------------------------------------------- invariants


def _random_case(seed, B=4, T=5):
  rng = np.random.default_rng(seed)
  logp = -np.abs(rng.normal(size=(B, T)))
  old = logp + 0.3 * rng.normal(size=(B, T))
  a = np.broadcast_to(rng.normal(size=(B, 1)), (B, T))
  mask = rng.uniform(size=(B, T)) < 0.7
  mask[:, 0] = True
  return (*(jnp.asarray(x, jnp.float32) for x in (logp, old, a)), jnp.asarray(mask))


@pytest.mark.parametrize("name", sorted(POLICY_LOSS_FNS))
def test_on_policy_ratio_is_exactly_one(name):
  """logp == old_logp: every ratio is exactly 1, nothing is clipped, and the policy gradient is -A·∇logp.

  For PPO/GSPO the loss itself is -A on response tokens (bitwise); for CISPO it is -A·logp.
  """
  logp, _, a, mask = _random_case(0)
  loss, m = jax.jit(POLICY_LOSS_FNS[name])(logp, logp, a, mask)
  assert float(m["policy/ratio_mean"]) == 1.0 and float(m["policy/ratio_max"]) == 1.0
  assert float(m["policy/clip_frac"]) == 0.0 and float(m["policy/approx_kl"]) == 0.0
  want = -a * logp if name == "cispo" else -a
  np.testing.assert_array_equal(loss, jnp.where(mask, want, 0.0))
  grad = _jit_grad(POLICY_LOSS_FNS[name])(logp, logp, a, mask)  # old_logp is data: no gradient through it
  if name == "gspo":  # ∂s_bt/∂logp_bt = s_b = 1 as well
    np.testing.assert_allclose(grad, jnp.where(mask, -a, 0.0), rtol=1e-6)
  else:
    np.testing.assert_array_equal(grad, jnp.where(mask, -a, 0.0))


def _dirty(x, mask, value):
  return jnp.where(mask, x, value)


@pytest.mark.parametrize("name", sorted(POLICY_LOSS_FNS))
def test_masked_slots_never_matter(name):
  """Overwriting masked slots of logp/old/A with ±1e4 changes no loss, metric or gradient; no inf/NaN anywhere.

  With sign +1 the masked log-ratio is +2e4, so an unsanitised exp gives inf and a NaN gradient (inf·0).
  """
  logp, old, a, mask = _random_case(1)
  clean_args = (logp, old, a, mask)
  for fn in (_jit(POLICY_LOSS_FNS[name]), _jit_grad(POLICY_LOSS_FNS[name]), _jit(value_loss), _jit_grad(value_loss)):
    clean = fn(*clean_args)
    for sign in (1.0, -1.0):
      dirty = fn(_dirty(logp, mask, sign * GARBAGE), _dirty(old, mask, -sign * GARBAGE), _dirty(a, mask, GARBAGE), mask)
      for got, want in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean), strict=True):
        np.testing.assert_array_equal(got, want)
  assert np.all(np.asarray(_jit_grad(POLICY_LOSS_FNS[name])(*clean_args))[~np.asarray(mask)] == 0)


# ---------------------------------------------------------------- gradients vs finite differences (float64)

_T, _V = 4, 3
_TOKENS = np.array([[0, 1, 2, 0], [2, 2, 1, 0], [1, 0, 0, 2], [0, 1, 1, 1]])
_MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 0]], bool)


def _toy_logp(theta_TV):
  """Softmax policy with logits θ[t] shared by all rows: logp_bt = log softmax(θ_t)[y_bt]."""
  lsm_BTV = jnp.broadcast_to(jax.nn.log_softmax(theta_TV, axis=-1), (*_TOKENS.shape, _V))
  return jnp.take_along_axis(lsm_BTV, jnp.asarray(_TOKENS)[..., None], axis=-1)[..., 0]


def _toy(seed):
  """θ, old log-probs at a perturbed θ, and per-sequence advantages broadcast to tokens (float64, under enable_x64)."""
  rng = np.random.default_rng(seed)
  theta = rng.normal(size=(_T, _V))
  old = _toy_logp(jnp.asarray(theta + 0.4 * rng.normal(size=(_T, _V))))
  a = np.where(_MASK, rng.normal(size=(_TOKENS.shape[0], 1)), 0.0)
  return jnp.asarray(theta), old, jnp.asarray(a)


def _central_differences(f, theta, h=1e-6):
  """(f(θ + h·e_i) - f(θ - h·e_i)) / 2h for each coordinate (a loop: f compiles once)."""
  steps = np.eye(theta.size).reshape(-1, *theta.shape) * h
  return np.array([(f(theta + e) - f(theta - e)) / (2 * h) for e in steps]).reshape(theta.shape)


# The three "sum" modes are Σ l·m over different constants, so token-mean covers their gradients.
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name,hyper", [("ppo", dict(clip_low=0.1, clip_high=0.15, dual_clip=1.3)),
                                        ("gspo", dict(clip_low=0.05, clip_high=0.05))])
def test_policy_gradient_matches_finite_differences(name, hyper, mode):
  """∇θ aggregate(loss(logp(θ))) == central differences of the same scalar, per-token and per-sequence weighting.

  The hyper-parameters are chosen so that both clipped and unclipped tokens (and for PPO dual-clipped ones)
  occur, asserted below; for GSPO this also checks that the detached token form has the sequence-level gradient.
  """
  with jax.enable_x64(True):
    theta, old, a = _toy(14)  # seed picked so every branch occurs with >= 0.03 margin to each clip boundary
    mask = jnp.asarray(_MASK)
    norm = normalizers(mask)
    f = jax.jit(lambda th: aggregate(POLICY_LOSS_FNS[name](_toy_logp(th), old, a, mask, **hyper)[0], mask, mode, norm))
    _, m = _jit(POLICY_LOSS_FNS[name], **hyper)(_toy_logp(theta), old, a, mask)
    assert 0 < float(m["policy/clip_frac"]) < 1, "toy problem no longer exercises both branches"
    if name == "ppo":
      assert float(m["policy/dual_clip_frac"]) > 0
    np.testing.assert_allclose(jax.jit(jax.grad(f))(theta), _central_differences(f, theta), rtol=1e-4, atol=1e-9)


def test_cispo_gradient_is_minus_w_a_grad_logp():
  """CISPO's gradient is -Σ w·A·∇logp / n_tokens with w frozen: checked against central differences of the
  frozen-weight surrogate AND against the closed form ∇θ_t log softmax(θ_t)[y] = onehot(y) - softmax(θ_t).
  """
  with jax.enable_x64(True):
    theta, old, a = _toy(4)
    mask = jnp.asarray(_MASK)
    norm = normalizers(mask)
    hyper = dict(clip_high=0.1, clip_low=0.1)
    loss = lambda th: aggregate(cispo(_toy_logp(th), old, a, mask, **hyper)[0], mask, "token-mean", norm)
    got = jax.jit(jax.grad(loss))(theta)
    ratio = jnp.exp(_toy_logp(theta) - old)
    w = jnp.clip(ratio, 0.9, 1.1)
    assert 0 < float(jnp.mean(jnp.where(mask, w != ratio, False))) < 1
    frozen = jax.jit(lambda th: aggregate(-w * a * _toy_logp(th), mask, "token-mean", norm))
    np.testing.assert_allclose(got, _central_differences(frozen, theta), rtol=1e-4, atol=1e-9)
    coef_BT = jnp.where(mask, -w * a, 0.0) / float(mask.sum())
    dlogp_BTV = jax.nn.one_hot(_TOKENS, _V, dtype=theta.dtype) - jax.nn.softmax(theta, axis=-1)[None]
    np.testing.assert_allclose(got, jnp.einsum("BT,BTV->TV", coef_BT, dlogp_BTV), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- off-policy weights


def test_truncated_is_weight_by_hand():
  """Raw ratios π_old/μ = [0.5, 1, 3, 8] on four tokens plus one masked garbage slot; cap = 2.

  mask_high = 5: w = [0.5, 1, 2, 0], keep = [1, 1, 1, 0]; clipped 1/4 (the 3), masked 1/4 (the 8),
  weight mean over kept 3.5/3, max 2, ESS (3.5)²/(3·(0.25 + 1 + 4)) = 12.25/15.75 = 7/9.
  Adding mask_low = 0.6 drops the 0.5 too: w = [0, 1, 2, 0], masked 2/4, ESS 9/(2·5) = 0.9.
  """
  mu = jnp.array([[-1.0, -2.0, -0.5, -3.0, GARBAGE]])
  old = mu + jnp.log(jnp.array([[0.5, 1.0, 3.0, 8.0, 1.0]]))
  old = old.at[0, 4].set(-GARBAGE)
  mask = jnp.array([[1, 1, 1, 1, 0]], bool)
  w, keep, m = _jit(truncated_is_weight, cap=2.0, mask_high=5.0)(old, mu, mask)
  np.testing.assert_allclose(w, [[0.5, 1, 2, 0, 0]], rtol=1e-5)
  np.testing.assert_array_equal(keep, [[1, 1, 1, 0, 0]])
  want = {"is/clipped_frac": 0.25, "is/masked_frac": 0.25, "is/weight_mean": 3.5 / 3, "is/weight_max": 2.0,
          "is/ess": 7 / 9}
  for key, value in want.items():
    np.testing.assert_allclose(m[key], value, rtol=1e-5, err_msg=key)
  w, keep, m = _jit(truncated_is_weight, cap=2.0, mask_low=0.6, mask_high=5.0)(old, mu, mask)
  np.testing.assert_allclose(w, [[0, 1, 2, 0, 0]], rtol=1e-5)
  np.testing.assert_allclose([m["is/masked_frac"], m["is/ess"]], [0.5, 0.9], rtol=1e-5)
  assert float(jnp.abs(jax.jit(jax.grad(lambda o: truncated_is_weight(o, mu, mask)[0].sum()))(old)).sum()) == 0.0


def test_sequence_level_is_weights_by_hand():
  """The same raw ratios [0.5, 1, 3, 8] as one sequence, and a second sequence of ratios [2, 0.5] (one masked garbage
  slot each), cap = 2. level sequence: Π = 12 -> min(12, 2) = 2 on every token of row 0; row 1 Π = 1 -> 1.
  level geometric: 12^(1/4) = 1.86121 (under the cap) on row 0; row 1 (2 · 0.5)^(1/2) = 1. mask_high = 5 drops
  all of row 0 under sequence (12 > 5), none under geometric (1.86 <= 5): masked_frac 4/6 and 0."""
  mu = jnp.array([[-1.0, -2.0, -0.5, -3.0, GARBAGE], [-1.0, -0.3, GARBAGE, GARBAGE, GARBAGE]])
  old = mu + jnp.log(jnp.array([[0.5, 1.0, 3.0, 8.0, 1.0], [2.0, 0.5, 1.0, 1.0, 1.0]]))
  old = old.at[0, 4].set(-GARBAGE).at[1, 2:].set(-GARBAGE)
  mask = jnp.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], bool)
  g = 12 ** 0.25
  for level, want_w in (("sequence", [[2, 2, 2, 2, 0], [1, 1, 0, 0, 0]]),
                        ("geometric", [[g, g, g, g, 0], [1, 1, 0, 0, 0]])):
    w, keep, _ = _jit(truncated_is_weight, cap=2.0, level=level)(old, mu, mask)
    np.testing.assert_allclose(w, want_w, rtol=1e-5, err_msg=level)
    np.testing.assert_array_equal(keep, mask)
  w, keep, m = _jit(truncated_is_weight, cap=2.0, mask_high=5.0, level="sequence")(old, mu, mask)
  np.testing.assert_allclose(w, [[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], rtol=1e-5)
  np.testing.assert_allclose(m["is/masked_frac"], 4 / 6, rtol=1e-5)
  _, _, m = _jit(truncated_is_weight, cap=2.0, mask_high=5.0, level="geometric")(old, mu, mask)
  assert float(m["is/masked_frac"]) == 0.0
  with pytest.raises(ValueError, match="level='seq'; expected one of"):
    truncated_is_weight(old, mu, mask, level="seq")


def test_truncated_is_weight_on_policy_and_errors():
  """π_old == μ: every weight is exactly 1 and the ESS is 1."""
  logp, _, _, mask = _random_case(2)
  w, keep, m = _jit(truncated_is_weight, mask_low=0.5, mask_high=2.0)(logp, logp, mask)
  np.testing.assert_array_equal(w, jnp.where(mask, 1.0, 0.0))
  np.testing.assert_array_equal(keep, mask)
  assert float(m["is/ess"]) == 1.0 and float(m["is/clipped_frac"]) == 0.0
  with pytest.raises(ValueError, match="mask_low < mask_high"):
    truncated_is_weight(logp, logp, mask, mask_low=2.0, mask_high=0.5)


def test_effective_sample_size_by_hand():
  """(Σw)²/(n·Σw²): [1,1,1,1] -> 16/16 = 1; [4,0,0,0] -> 16/(4·16) = 1/4; but with only the 4 unmasked, n = 1 -> 1.

  [[1, 2], [3, G]] with G masked: 36/(3·14) = 6/7. All-zero weights -> 0 (not NaN).
  """
  full = jnp.ones((1, 4), bool)
  np.testing.assert_allclose(effective_sample_size(jnp.ones((1, 4)), full), 1.0)
  np.testing.assert_allclose(effective_sample_size(jnp.array([[4.0, 0, 0, 0]]), full), 0.25)
  np.testing.assert_allclose(effective_sample_size(jnp.array([[4.0, 0, 0, 0]]), jnp.array([[1, 0, 0, 0]])), 1.0)
  np.testing.assert_allclose(effective_sample_size(jnp.array([[1.0, 2], [3, GARBAGE]]), jnp.array([[1, 1], [1, 0]])),
                             6 / 7, rtol=1e-6)
  assert float(effective_sample_size(jnp.zeros((2, 2)), jnp.ones((2, 2)))) == 0.0
