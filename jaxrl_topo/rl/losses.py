"""Policy losses, KL estimators and the clipped value loss: per-token, unreduced, chosen by name.

Alphabet: B=sequences, T=response tokens. Log-probs are fp32 log π(y_t | y_<t) of the sampled tokens.
Each loss returns `(loss_BT, metrics)`: `loss_BT` is 0 at masked slots and is reduced later by
`core.aggregate` with global normalisers; `metrics` are masked means over the arrays given (so over
one microbatch when called per microbatch), under `stop_gradient`, with namespaced keys.
Masked slots may hold garbage: log-ratios are zeroed there BEFORE `exp`, so neither values nor
gradients can pick up inf/NaN from padding.

Every policy loss shares the signature fn(logp_BT, old_logp_BT, adv_BT, mask_BT, **hyper).
`old_logp` is the policy that produced (or, in decoupled PPO, proximally precedes) the update;
on the first minibatch of an on-policy step logp == old_logp and every ratio is exactly 1.
"""

import jax
import jax.numpy as jnp

from jaxrl_topo.rl.core import masked_mean

Metrics = dict[str, jax.Array]


def _log_ratio(logp_BT: jax.Array, other_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """logp - other on response tokens, exactly 0 (ratio 1) on masked slots."""
  return jnp.where(jnp.asarray(mask_BT) != 0, logp_BT - other_BT, 0.0)


def _masked_max(x_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """max over response tokens of a non-negative quantity; 0 for an empty mask."""
  return jnp.max(jnp.where(jnp.asarray(mask_BT) != 0, x_BT, 0.0))


def _zero_masked(loss_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  return jnp.where(jnp.asarray(mask_BT) != 0, loss_BT, 0.0)


KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(logp_BT: jax.Array, ref_logp_BT: jax.Array, kind: str, *, mask_BT: jax.Array | None = None
               ) -> jax.Array:
  """Per-token estimators of KL(π || π_ref) from samples of π (http://joschu.net/blog/kl-approx.html).

  With d = ref_logp - logp:  k1 = -d (unbiased, can be < 0),  k2 = d²/2 (biased, >= 0),
  k3 = e^d - d - 1 (unbiased, >= 0). Example, logp = log 0.5, ref = log 0.25 (d = -ln 2):
  k1 = ln 2 = 0.693147, k2 = (ln 2)²/2 = 0.240227, k3 = 0.5 + ln 2 - 1 = 0.193147.
  Pass `mask_BT` to zero masked slots before `exp` (needed if they hold garbage).
  """
  if kind not in KL_KINDS:
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}")
  d_BT = ref_logp_BT - logp_BT if mask_BT is None else _log_ratio(ref_logp_BT, logp_BT, mask_BT)
  if kind == "k1":
    return -d_BT
  if kind == "k2":
    return 0.5 * d_BT**2
  return jnp.exp(d_BT) - d_BT - 1.0


def kl_loss(logp_BT: jax.Array, ref_logp_BT: jax.Array, mask_BT: jax.Array, *, kind: str = "k3"
            ) -> tuple[jax.Array, Metrics]:
  """KL-to-reference loss term (GRPO adds β·k3 to the loss): `kl_penalty` zeroed on masked slots + kl/mean."""
  kl_BT = _zero_masked(kl_penalty(logp_BT, ref_logp_BT, kind, mask_BT=mask_BT), mask_BT)
  return kl_BT, jax.lax.stop_gradient({"kl/mean": masked_mean(kl_BT, mask_BT)})


def ppo_clip(logp_BT: jax.Array, old_logp_BT: jax.Array, adv_BT: jax.Array, mask_BT: jax.Array, *,
             clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None
             ) -> tuple[jax.Array, Metrics]:
  """PPO clipped surrogate (arXiv 1707.06347), per token, with ρ = exp(logp - old_logp):

    loss = max(-ρ·A, -clip(ρ, 1 - ε_low, 1 + ε_high)·A)      (= -min of the two objectives)
    dual clip (arXiv 1912.09729), A < 0 only:  loss = min(loss, -c·A) = min(loss, c·|A|), c > 1.

  ε_high > ε_low is DAPO's clip-higher (arXiv 2503.14476, ε_low = 0.2, ε_high = 0.28).
  Example, ε = 0.2, c = 3: (ρ, A) = (1.1, 1) -> -1.1 (unclipped); (1.5, 1) -> -1.2 (clipped high);
  (0.5, -1) -> 0.8 (clipped low); (4, -1) -> min(4, 3) = 3 (dual clip).
  Metrics: policy/clip_frac (tokens whose clipped branch is strictly larger, i.e. active),
  policy/clip_frac_low|high, policy/dual_clip_frac, policy/ratio_mean, policy/ratio_max and
  policy/approx_kl = mean of k3 = ρ - 1 - log ρ, an unbiased, non-negative estimate of KL(old || new).
  """
  if dual_clip is not None and not dual_clip > 1.0:
    raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
  log_ratio_BT = _log_ratio(logp_BT, old_logp_BT, mask_BT)
  ratio_BT = jnp.exp(log_ratio_BT)
  unclipped_BT = -adv_BT * ratio_BT
  clipped_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
  loss_BT = jnp.maximum(unclipped_BT, clipped_BT)
  is_clipped_BT = clipped_BT > unclipped_BT
  is_dual_BT = jnp.zeros_like(is_clipped_BT)
  if dual_clip is not None:
    bound_BT = -adv_BT * dual_clip
    is_dual_BT = (adv_BT < 0) & (loss_BT > bound_BT)
    loss_BT = jnp.where(is_dual_BT, bound_BT, loss_BT)
  metrics = {
      "policy/clip_frac": masked_mean(is_clipped_BT.astype(jnp.float32), mask_BT),
      "policy/clip_frac_high": masked_mean((is_clipped_BT & (adv_BT > 0)).astype(jnp.float32), mask_BT),
      "policy/clip_frac_low": masked_mean((is_clipped_BT & (adv_BT < 0)).astype(jnp.float32), mask_BT),
      "policy/dual_clip_frac": masked_mean(is_dual_BT.astype(jnp.float32), mask_BT),
      "policy/ratio_mean": masked_mean(ratio_BT, mask_BT),
      "policy/ratio_max": _masked_max(ratio_BT, mask_BT),
      "policy/approx_kl": masked_mean(ratio_BT - 1.0 - log_ratio_BT, mask_BT),
  }
  return _zero_masked(loss_BT, mask_BT), jax.lax.stop_gradient(metrics)


def gspo(logp_BT: jax.Array, old_logp_BT: jax.Array, adv_BT: jax.Array, mask_BT: jax.Array, *,
         clip_low: float = 3e-4, clip_high: float = 4e-4) -> tuple[jax.Array, Metrics]:
  """GSPO (arXiv 2507.18071), token form ("GSPO-token"), with a length-normalised sequence ratio

    s_b = exp(mean_t (logp - old_logp)),   s_bt = sg(s_b) · exp(logp_bt - sg(logp_bt))   (value s_b),
    loss_bt = max(-s_bt·A_bt, -clip(s_bt, 1 - ε_low, 1 + ε_high)·A_bt).

  ∂s_bt/∂logp_bt = s_b, so under any aggregation that weighs a row's tokens equally the gradient is
  the sequence-level GSPO gradient. A_bt is normally a sequence advantage broadcast to tokens.
  Defaults ε = (3e-4, 4e-4) are the paper's. Example, ε = 0.2, A = 1: row 1 log-ratios [0, 0.2] -> s = e^0.1
  = 1.10517, not clipped, loss -1.10517 per token; row 2 log-ratios [0.5, 0.5] -> s = e^0.5 = 1.6487,
  clipped to 1.2, loss -1.2 per token and no gradient.
  Metrics: policy/clip_frac over SEQUENCES (rows with a token), policy/ratio_mean|max of s_b,
  policy/approx_kl = token mean of k3 (as in `ppo_clip`).
  """
  on_BT = jnp.asarray(mask_BT) != 0
  log_ratio_BT = _log_ratio(logp_BT, old_logp_BT, mask_BT)
  log_s_B = masked_mean(log_ratio_BT, mask_BT, axis=1)
  sg_logp_BT = jax.lax.stop_gradient(logp_BT)
  log_s_BT = jax.lax.stop_gradient(log_s_B)[:, None] + jnp.where(on_BT, logp_BT - sg_logp_BT, 0.0)
  s_BT = jnp.exp(log_s_BT)
  unclipped_BT = -adv_BT * s_BT
  clipped_BT = -adv_BT * jnp.clip(s_BT, 1.0 - clip_low, 1.0 + clip_high)
  loss_BT = jnp.maximum(unclipped_BT, clipped_BT)
  has_B = jnp.any(on_BT, axis=1)
  seq_clipped_B = jnp.any(on_BT & (clipped_BT > unclipped_BT), axis=1)
  s_B = jnp.exp(log_s_B)
  metrics = {
      "policy/clip_frac": masked_mean(seq_clipped_B.astype(jnp.float32), has_B),
      "policy/ratio_mean": masked_mean(s_B, has_B),
      "policy/ratio_max": _masked_max(s_B, has_B),
      "policy/approx_kl": masked_mean(jnp.exp(log_ratio_BT) - 1.0 - log_ratio_BT, mask_BT),
  }
  return _zero_masked(loss_BT, mask_BT), jax.lax.stop_gradient(metrics)


def cispo(logp_BT: jax.Array, old_logp_BT: jax.Array, adv_BT: jax.Array, mask_BT: jax.Array, *,
          clip_high: float = 0.28, clip_low: float | None = None) -> tuple[jax.Array, Metrics]:
  """CISPO (MiniMax-M1, arXiv 2506.13585 eq. 4): truncate the IS weight instead of dropping tokens.

    w = sg(clip(ρ, 1 - ε_low, 1 + ε_high)),   loss = -w·A·logp,   so ∇loss = -w·A·∇logp.

  Every token keeps a gradient (PPO zeroes clipped ones). The paper sets no lower bound and tunes
  only ε_high without publishing one value; `clip_low=None` means no lower bound, and the default
  ε_high = 0.28 is DAPO's clip-higher value (public configs range up to ~5). The loss VALUE is only a
  surrogate (it is not 0 on-policy); its gradient is what matters.
  Example: logp = log 0.5, old = log 0.25 (ρ = 2), A = 1, ε_high = 0.28 -> w = 1.28,
  loss = -1.28·ln 0.5 = 0.887228, ∂loss/∂logp = -1.28.
  Metrics: policy/clip_frac (tokens with w ≠ ρ), policy/ratio_mean|max, policy/approx_kl (k3).
  """
  log_ratio_BT = _log_ratio(logp_BT, old_logp_BT, mask_BT)
  ratio_BT = jnp.exp(log_ratio_BT)
  low = -jnp.inf if clip_low is None else 1.0 - clip_low
  w_BT = jax.lax.stop_gradient(jnp.clip(ratio_BT, low, 1.0 + clip_high))
  loss_BT = -w_BT * adv_BT * jnp.where(jnp.asarray(mask_BT) != 0, logp_BT, 0.0)
  metrics = {
      "policy/clip_frac": masked_mean((w_BT != ratio_BT).astype(jnp.float32), mask_BT),
      "policy/ratio_mean": masked_mean(ratio_BT, mask_BT),
      "policy/ratio_max": _masked_max(ratio_BT, mask_BT),
      "policy/approx_kl": masked_mean(ratio_BT - 1.0 - log_ratio_BT, mask_BT),
  }
  return _zero_masked(loss_BT, mask_BT), jax.lax.stop_gradient(metrics)


def value_loss(values_BT: jax.Array, old_values_BT: jax.Array, returns_BT: jax.Array, mask_BT: jax.Array, *,
               clip: float = 0.2) -> tuple[jax.Array, Metrics]:
  """Clipped value loss (PPO2 baselines): ½·max((V - R)², (V_old + clip(V - V_old, -c, c) - R)²).

  Example, c = 0.2, R = 1: V_old = 0.5, V = 0.0 -> max((0 - 1)², (0.3 - 1)²)/2 = max(1, 0.49)/2 = 0.5
  (unclipped branch); V_old = 2.0, V = 1.0 -> max(0, (1.8 - 1)²)/2 = 0.32 (clipped branch: no gradient).
  Metrics: value/clip_frac (the clipped term strictly larger), value/mean, value/mse (unclipped).
  """
  on_BT = jnp.asarray(mask_BT) != 0
  err_BT = jnp.where(on_BT, values_BT - returns_BT, 0.0)
  step_BT = jnp.where(on_BT, values_BT - old_values_BT, 0.0)
  err_clipped_BT = jnp.where(on_BT, old_values_BT - returns_BT, 0.0) + jnp.clip(step_BT, -clip, clip)
  loss_BT = 0.5 * jnp.maximum(err_BT**2, err_clipped_BT**2)
  metrics = {
      "value/clip_frac": masked_mean((err_clipped_BT**2 > err_BT**2).astype(jnp.float32), mask_BT),
      "value/mean": masked_mean(values_BT, mask_BT),
      "value/mse": masked_mean(err_BT**2, mask_BT),
  }
  return _zero_masked(loss_BT, mask_BT), jax.lax.stop_gradient(metrics)


# The policy losses by their LossConfig.policy_loss name (train/step.py calls each with its own
# hyper-parameters); shared signature fn(logp_BT, old_logp_BT, adv_BT, mask_BT, **hyper).
POLICY_LOSS_FNS = {"ppo": ppo_clip, "gspo": gspo, "cispo": cispo}
