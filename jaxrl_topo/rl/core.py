"""Masked reductions and loss aggregation: the only places where tokens are summed or averaged.

Alphabet: B=sequences (rows, group-major), T=response tokens. `mask_BT` is bool or float; 1 marks a
response token that counts, 0 a prompt/padding slot. Masked slots may hold anything finite or not:
every helper selects with `jnp.where` before multiplying, so garbage never reaches a sum, and the
gradient into a masked slot is exactly 0 (never 0 * inf = NaN).

Loss aggregation. Loss functions return an unreduced `loss_BT`; `aggregate` reduces it with
denominators taken from the GLOBAL batch (`Normalizers`). Every mode is then a sum over rows of a
per-row quantity divided by a global constant, so if the batch is cut into microbatches along B
and each piece is aggregated with the same global `Normalizers`, the pieces SUM to the full-batch
value. That is what makes gradient accumulation exact.

  mode                        value                                       used by
  token-mean                  Σ_bt l·m / n_tokens                         DAPO (arXiv 2503.14476)
  seq-mean-token-mean         Σ_b (Σ_t l·m / max(len_b, 1)) / n_seqs      GRPO (arXiv 2402.03300)
  seq-mean-token-sum          Σ_bt l·m / n_seqs
  seq-mean-token-sum-norm     Σ_bt l·m / (n_seqs · max_len)               Dr. GRPO (arXiv 2503.20783)

Example: loss = [[1, 2, 9], [3, 9, 9]], mask = [[1, 1, 0], [1, 0, 0]] (9s are masked out):
n_tokens = 3, n_seqs = 2, max_len = 3 -> token-mean 6/3 = 2; seq-mean-token-mean (1.5 + 3)/2 = 2.25;
seq-mean-token-sum 6/2 = 3; seq-mean-token-sum-norm 6/(2·3) = 1.
"""

import flax.struct
import jax
import jax.numpy as jnp


def _select(x: jax.Array, mask: jax.Array) -> jax.Array:
  """x·mask where mask != 0, exactly 0 elsewhere (whatever x holds there)."""
  mask = jnp.asarray(mask)
  return jnp.where(mask != 0, x * mask.astype(jnp.result_type(x)), 0)


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Σ x·mask over `axis`; masked slots contribute exactly 0."""
  return jnp.sum(_select(x, mask), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Σ x·mask / max(Σ mask, 1): an empty selection averages to 0, not NaN."""
  count = jnp.sum(jnp.asarray(mask, jnp.result_type(x)), axis=axis)
  return masked_sum(x, mask, axis) / jnp.maximum(count, 1)


def masked_whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
  """(x - μ) / (σ + eps) with μ, σ the masked mean and POPULATION std (ddof=0) over all masked entries.

  Masked slots come out as 0. Example: x = [1, 3, 100], mask = [1, 1, 0] -> μ = 2, σ = 1 -> [-1, 1, 0].
  """
  mean = masked_mean(x, mask)
  centred = jnp.where(jnp.asarray(mask) != 0, x - mean, 0)
  std = jnp.sqrt(masked_mean(centred**2, mask))
  return _select(centred / (std + eps), jnp.asarray(mask) != 0)


@flax.struct.dataclass
class Normalizers:
  """Global denominators for `aggregate`, computed once over the FULL batch (all microbatches, all hosts).

  n_tokens: Σ mask over the batch, floored at 1.
  n_seqs: number of rows B (rows with no response token count too: they add 0 to the numerator and 1
    here, so a fixed batch shape gives a fixed constant); `normalizers(..., count_empty_rows=False)`
    counts only rows holding >= 1 token (use it when the batch is padded with dummy rows).
  max_len: T, the response-length budget; Dr. GRPO's constant.
  All three are float32 scalars (arrays, so the trainer can pass them through jit).
  """

  n_tokens: jax.Array
  n_seqs: jax.Array
  max_len: jax.Array


def normalizers(mask_BT: jax.Array, *, count_empty_rows: bool = True) -> Normalizers:
  """Denominators over the full batch `mask_BT` (pass the global batch, not a microbatch)."""
  mask_BT = jnp.asarray(mask_BT, jnp.float32)
  B, T = mask_BT.shape
  n_seqs = jnp.float32(B) if count_empty_rows else jnp.sum(jnp.any(mask_BT != 0, axis=1), dtype=jnp.float32)
  return Normalizers(
      n_tokens=jnp.maximum(jnp.sum(mask_BT), 1.0), n_seqs=jnp.maximum(n_seqs, 1.0), max_len=jnp.float32(T))


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(loss_BT: jax.Array, mask_BT: jax.Array, mode: str, norm: Normalizers) -> jax.Array:
  """Reduces a per-token loss to a scalar; see the module docstring for the four modes and an example.

  `mode` is a Python string (static under jit). With the same global `norm`, aggregates of
  microbatches split along B sum to the full-batch aggregate.
  """
  if mode not in AGG_MODES:
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {AGG_MODES}")
  if mode == "seq-mean-token-mean":
    len_B = jnp.sum(jnp.asarray(mask_BT, jnp.float32), axis=1)
    return jnp.sum(masked_sum(loss_BT, mask_BT, axis=1) / jnp.maximum(len_B, 1.0)) / norm.n_seqs
  total = masked_sum(loss_BT, mask_BT)
  if mode == "token-mean":
    return total / norm.n_tokens
  if mode == "seq-mean-token-sum":
    return total / norm.n_seqs
  return total / (norm.n_seqs * norm.max_len)
