"""Off-policy corrections for stale or mismatched rollouts: truncated IS weights and their ESS.

Alphabet: B=sequences, T=response tokens. μ = the sampler's log-probs (what the rollout engine
returned with each token), π_old = the trainer's log-probs at the start of the step.

Decoupled PPO for asynchronous RL (AReaL, arXiv 2505.24298). When trajectories come from weights
that are several versions old, or from a sampler whose numerics differ from the trainer's, the
behaviour policy μ that drew the tokens is not the policy PPO should stay close to. Decoupled PPO
separates the two roles: the PPO ratio ρ = π_θ / π_prox uses the PROXIMAL policy, the trainer's
parameters at the start of this step (`old_logp`, recomputed by a forward pass), so the trust
region is measured from where the optimiser actually is; and the mismatch between π_prox and μ is
corrected by a separate importance weight w = min(π_prox / μ, C), detached and truncated at C so
that one very stale token cannot dominate the batch. The trainer multiplies the per-token policy
loss by w (`loss_BT * w_BT`) BEFORE `core.aggregate`. In colocated on-policy mode π_prox = μ up to
numerics, w ≈ 1, and the correction only absorbs sampler/trainer mismatch.

Masking (`mask_low`/`mask_high`) instead drops tokens whose raw weight π_prox/μ lies outside a
range: their `keep_BT` is False and their weight 0. To have dropped tokens leave the denominator as
well, aggregate with `keep_BT` as the mask and `normalizers(keep_BT)` over the global batch.

`level` says what one weight covers (the names verl uses for its rollout correction):
  token      each token its own ratio r_t = π_prox/μ (the default).
  sequence   every token of a sequence the product Π_t r_t: the unbiased sequence-level weight, whose
             variance grows with the length.
  geometric  every token of a sequence the geometric mean exp(mean_t log r_t): the same length-normalised
             form as GSPO's own ratio, so a GSPO objective stays sequence-level with the correction on.
Sequence and geometric weights are capped and masked as a whole: a sequence is kept or dropped entirely.
"""

import jax
import jax.numpy as jnp

from jaxrl_topo.rl.core import masked_mean, masked_sum

IS_LEVELS = ("token", "sequence", "geometric")


def effective_sample_size(w_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """Normalised ESS = (Σ w)² / (n · Σ w²) over the n masked tokens, in (0, 1]; 0 if every w is 0.

  1 when all weights are equal; 1/n when one token holds all the weight.
  Example: w = [1, 1, 1, 1] -> 16 / (4·4) = 1;  w = [4, 0, 0, 0] -> 16 / (4·16) = 1/4.
  """
  n = jnp.sum(jnp.asarray(mask_BT) != 0, dtype=jnp.float32)
  total, total_sq = masked_sum(w_BT, mask_BT), masked_sum(w_BT**2, mask_BT)
  denom = n * total_sq
  return jnp.where(denom > 0, total**2 / jnp.where(denom > 0, denom, 1.0), 0.0)


def truncated_is_weight(old_logp_BT: jax.Array, sampler_logp_BT: jax.Array, mask_BT: jax.Array, *,
                        cap: float = 2.0, mask_low: float | None = None, mask_high: float | None = None,
                        level: str = "token") -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Truncated importance weights w = sg(min(raw ratio, cap)), the raw ratio per token or per sequence (`level`,
  see the module docstring).

  Returns (w_BT, keep_BT, metrics). keep_BT = mask & (mask_low <= raw ratio <= mask_high), with
  either bound optional; w is 0 wherever keep is False (masked or dropped slots).
  Example, cap = 2, mask_high = 5, raw ratios [0.5, 1, 3, 8] on four response tokens:
  w = [0.5, 1, 2, 0], keep = [1, 1, 1, 0]; clipped_frac = 1/4 (the 3; the dropped 8 is not
  counted), masked_frac = 1/4, weight_mean over kept tokens = 3.5/3.
  The same ratios as one sequence, cap = 2: level "sequence" gives every token min(0.5·1·3·8, 2) = 2,
  "geometric" min(12^(1/4), 2) = 1.8612; with mask_high = 5 "sequence" drops the whole sequence (12 > 5).
  Metrics (means over response tokens): is/weight_mean and is/weight_max (over kept tokens),
  is/clipped_frac (kept tokens whose raw ratio exceeded `cap`), is/masked_frac (dropped), is/ess
  (`effective_sample_size` of w over kept tokens).
  """
  if not cap > 0:
    raise ValueError(f"cap must be > 0, got {cap}")
  if mask_low is not None and mask_high is not None and not mask_low < mask_high:
    raise ValueError(f"need mask_low < mask_high, got {mask_low} and {mask_high}")
  if level not in IS_LEVELS:
    raise ValueError(f"level={level!r}; expected one of {IS_LEVELS}")
  on_BT = jnp.asarray(mask_BT) != 0
  log_r_BT = jnp.where(on_BT, old_logp_BT - sampler_logp_BT, 0.0)
  if level != "token":  # one ratio per sequence, on each of its tokens
    log_r_B = masked_sum(log_r_BT, on_BT, axis=1) if level == "sequence" else masked_mean(log_r_BT, on_BT, axis=1)
    log_r_BT = jnp.where(on_BT, log_r_B[:, None], 0.0)
  raw_BT = jnp.exp(log_r_BT)
  keep_BT = on_BT
  if mask_low is not None:
    keep_BT = keep_BT & (raw_BT >= mask_low)
  if mask_high is not None:
    keep_BT = keep_BT & (raw_BT <= mask_high)
  w_BT = jax.lax.stop_gradient(jnp.where(keep_BT, jnp.minimum(raw_BT, cap), 0.0))
  metrics = {
      "is/weight_mean": masked_mean(w_BT, keep_BT),
      "is/weight_max": jnp.max(w_BT),
      "is/clipped_frac": masked_mean((keep_BT & (raw_BT > cap)).astype(jnp.float32), on_BT),
      "is/masked_frac": masked_mean((on_BT & ~keep_BT).astype(jnp.float32), on_BT),
      "is/ess": effective_sample_size(w_BT, keep_BT),
  }
  return w_BT, keep_BT, jax.lax.stop_gradient(metrics)
