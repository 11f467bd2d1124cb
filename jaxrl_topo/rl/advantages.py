"""Advantage estimators: small pure functions of rewards (and values), chosen by name.

Alphabet: B=sequences, G=group size (completions per prompt), P=prompts (B = P·G), T=response tokens.
Rows are group-major: row b answers prompt b // G. Outcome rewards are one scalar per row
(`rewards_B`); token-level estimators take `[B, T]` rewards, e.g. from `sequence_rewards_to_tokens`.
Every token-level output is exactly 0 at masked slots.
"""

import jax
import jax.numpy as jnp

from jaxrl_topo.rl.core import masked_whiten


def _groups(rewards_B: jax.Array, group_size: int) -> jax.Array:
  """[B] -> [P, G], checking that the groups tile the batch."""
  (B,) = rewards_B.shape
  if group_size < 1 or B % group_size:
    raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch size B={B}")
  return rewards_B.reshape(B // group_size, group_size)


def grpo(rewards_B: jax.Array, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6,
         std_ddof: int = 1) -> jax.Array:
  """Group-relative advantage, GRPO (arXiv 2402.03300 §4.1.2): A_i = (r_i - mean_g r) / (std_g r + eps).

  std uses `std_ddof=1` (the unbiased estimate, torch.std's default, as in the common GRPO
  implementations); pass 0 for the population std. `scale_by_std=False` gives Dr. GRPO's
  A_i = r_i - mean_g r (arXiv 2503.20783), which removes the question-difficulty bias.
  Example, G=4, r = [0, 0, 1, 3]: mean 1, std(ddof=1) = sqrt((1+1+0+4)/3) = √2 ->
  A = [-1/√2, -1/√2, 0, 2/√2]; Dr. GRPO: [-1, -1, 0, 2]. A group of equal rewards gives A = 0.
  """
  r_PG = _groups(rewards_B, group_size)
  centred_PG = r_PG - jnp.mean(r_PG, axis=1, keepdims=True)
  if scale_by_std:
    if group_size <= std_ddof:
      raise ValueError(f"std with ddof={std_ddof} needs group_size > {std_ddof}, got {group_size}")
    centred_PG = centred_PG / (jnp.std(r_PG, axis=1, ddof=std_ddof, keepdims=True) + eps)
  return centred_PG.reshape(-1)


def dr_grpo(rewards_B: jax.Array, group_size: int) -> jax.Array:
  """Dr. GRPO (arXiv 2503.20783): A_i = r_i - mean_g r, i.e. `grpo(..., scale_by_std=False)`."""
  return grpo(rewards_B, group_size, scale_by_std=False)


def rloo(rewards_B: jax.Array, group_size: int) -> jax.Array:
  """REINFORCE leave-one-out (arXiv 2402.14740): A_i = r_i - mean_{j≠i} r_j = G/(G-1)·(r_i - mean_g r).

  Example, G=4, r = [0, 0, 1, 3]: the other three sum to 4, 4, 3, 1 ->
  A = [0 - 4/3, 0 - 4/3, 1 - 1, 3 - 1/3] = [-4/3, -4/3, 0, 8/3].
  """
  if group_size < 2:
    raise ValueError(f"RLOO needs group_size >= 2, got {group_size}")
  r_PG = _groups(rewards_B, group_size)
  others_PG = (jnp.sum(r_PG, axis=1, keepdims=True) - r_PG) / (group_size - 1)
  return (r_PG - others_PG).reshape(-1)


def broadcast_to_tokens(adv_B: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """adv_BT[b, t] = adv_B[b] on response tokens, 0 on masked slots."""
  return jnp.where(jnp.asarray(mask_BT) != 0, adv_B[:, None], 0.0).astype(adv_B.dtype)


def sequence_rewards_to_tokens(rewards_B: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """Puts each row's outcome reward on its LAST response token; 0 elsewhere (and on empty rows).

  Example: r = [5], mask = [[1, 1, 0]] -> [[0, 5, 0]].
  """
  on_BT = jnp.asarray(mask_BT) != 0
  T = on_BT.shape[1]
  last_B = T - 1 - jnp.argmax(on_BT[:, ::-1], axis=1)  # argmax finds the first True of the reversed row
  at_last_BT = (jnp.arange(T)[None, :] == last_B[:, None]) & jnp.any(on_BT, axis=1)[:, None]
  return jnp.where(at_last_BT, rewards_B[:, None], 0.0).astype(rewards_B.dtype)


def _discounted_returns(rewards_BT: jax.Array, on_BT: jax.Array, gamma: float) -> jax.Array:
  """G_t = r_t + γ·G_next over response tokens only: masked slots are skipped (no reward, no discount)."""

  def step(next_B, xs):
    r_B, on_B = xs
    g_B = r_B + gamma * next_B
    return jnp.where(on_B, g_B, next_B), jnp.where(on_B, g_B, 0.0)

  init_B = jnp.zeros(rewards_BT.shape[:1], rewards_BT.dtype)
  _, g_TB = jax.lax.scan(step, init_B, (jnp.where(on_BT, rewards_BT, 0.0).T, on_BT.T), reverse=True)
  return g_TB.T


def reinforce_pp(token_rewards_BT: jax.Array, mask_BT: jax.Array, *, gamma: float = 1.0) -> jax.Array:
  """REINFORCE++ (arXiv 2501.03262): returns G_t = Σ_{k>=t} γ^(k-t) r_k, whitened over the whole batch.

  k and t run over response tokens (masked slots are skipped, so a masked gap costs no discount).
  The whitening uses every masked token of the batch (global batch normalisation, population std).
  Any per-token KL penalty belongs in `token_rewards_BT` (r_t = outcome·[t last] - β·kl_t).
  Example, one row, r = [0, 0, 1], γ = 0.5 -> G = [0.25, 0.5, 1]; mean 7/12, then / std.
  """
  on_BT = jnp.asarray(mask_BT) != 0
  return masked_whiten(_discounted_returns(token_rewards_BT, on_BT, gamma), on_BT)


def reinforce_pp_baseline(rewards_B: jax.Array, group_size: int, mask_BT: jax.Array) -> jax.Array:
  """REINFORCE++-baseline (arXiv 2501.03262): A = r_i - mean_g r, broadcast to tokens, then batch-whitened.

  The whitening is over all masked tokens, so longer answers weigh more in μ and σ.
  Example, G=2, r = [1, 0], masks with 1 and 3 tokens: centred [0.5, -0.5] -> tokens
  [0.5 | -0.5, -0.5, -0.5]: μ = -0.25, σ = √0.1875 = 0.433 -> [1.732 | -0.577, -0.577, -0.577].
  """
  return masked_whiten(broadcast_to_tokens(dr_grpo(rewards_B, group_size), mask_BT), mask_BT)


def gae(rewards_BT: jax.Array, values_BT: jax.Array, mask_BT: jax.Array, *, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation (arXiv 1506.02438) as a reverse `lax.scan` over T.

  δ_t = r_t + γ·V_{t+1} - V_t,   A_t = δ_t + γλ·A_{t+1},   returns R_t = A_t + V_t.
  "t+1" is the next RESPONSE token (masked slots are skipped); after the last one V = A = 0 (the
  episode ends). Both outputs are 0 at masked slots. Whitening A, if wanted, is the caller's call.
  Example, 1×3, r = [0, 0, 1], V = [0.5, 0.6, 0.7], γ = 0.9, λ = 0.8:
    δ = [0.04, 0.03, 0.3];  A_3 = 0.3, A_2 = 0.03 + 0.72·0.3 = 0.246, A_1 = 0.04 + 0.72·0.246 = 0.21712;
    R = [0.71712, 0.846, 1.0].
  """
  on_BT = jnp.asarray(mask_BT) != 0
  r_TB = jnp.where(on_BT, rewards_BT, 0.0).T
  v_TB = jnp.where(on_BT, values_BT, 0.0).T

  def step(carry, xs):
    next_v_B, next_a_B = carry
    r_B, v_B, on_B = xs
    a_B = r_B + gamma * next_v_B - v_B + gamma * lam * next_a_B
    return (jnp.where(on_B, v_B, next_v_B), jnp.where(on_B, a_B, next_a_B)), jnp.where(on_B, a_B, 0.0)

  zeros_B = jnp.zeros(r_TB.shape[1:], r_TB.dtype)
  _, a_TB = jax.lax.scan(step, (zeros_B, zeros_B), (r_TB, v_TB, on_BT.T), reverse=True)
  return a_TB.T, a_TB.T + v_TB.T


def _per_token(adv_fn):
  """Lifts a per-sequence estimator to the shared (rewards_B, group_size, mask_BT) -> adv_BT form."""
  return lambda rewards_B, group_size, mask_BT, **kw: broadcast_to_tokens(adv_fn(rewards_B, group_size, **kw), mask_BT)


# Outcome-reward estimators, selected by config name. Uniform signature:
#   fn(rewards_B, group_size, mask_BT, **estimator_options) -> adv_BT   (0 at masked slots)
ADVANTAGE_FNS = {
    "grpo": _per_token(grpo),
    "dr_grpo": _per_token(dr_grpo),
    "rloo": _per_token(rloo),
    "reinforce_pp_baseline": reinforce_pp_baseline,
}
