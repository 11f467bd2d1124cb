"""Per-token log-probs and entropies without ever holding a [tokens x vocab] logits array.

The output projection runs over chunks of C tokens inside a `lax.scan`, and each chunk is
rematerialised in the backward pass (`jax.checkpoint`), so the live logits are [C, V] instead of
[N, V]: at V = 152k and N = 16k tokens that is 9.7 GB of fp32 logits (plus as much again for
their cotangent) down to C/N of it.

Convention (the sampler's, rollout/sampling.py): logp = log_softmax(logits / T)[target] over the
full vocabulary, T the rollout temperature; entropy is that distribution's, in nats.
Letters: N tokens, C chunk, D hidden, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def logprobs_from_logits(logits_NV, targets_N, temperature: float = 1.0):
  """(logp_N, entropy_N) from explicit logits, in fp32: the reference the chunked path must match."""
  logits_NV = logits_NV.astype(jnp.float32) / temperature
  logits_NV = logits_NV - jax.lax.stop_gradient(logits_NV.max(axis=-1, keepdims=True))  # entropy: no cancellation
  logz_N = jax.nn.logsumexp(logits_NV, axis=-1)
  logp_N = jnp.take_along_axis(logits_NV, targets_N[:, None], axis=-1)[:, 0] - logz_N
  probs_NV = jnp.exp(logits_NV - logz_N[:, None])
  entropy_N = logz_N - jnp.sum(probs_NV * logits_NV, axis=-1)
  return logp_N, entropy_N


def chunked_logprobs(h_ND, w_DV, targets_N, *, chunk: int = 1024, temperature: float = 1.0):
  """(logp_N, entropy_N) of `targets_N` under logits h @ w, computed `chunk` tokens at a time.

  N is padded up to a multiple of `chunk` (the padding is sliced off), so any N works.
  """
  N, D = h_ND.shape
  C = min(chunk, N)
  n_chunks = -(-N // C)
  pad = n_chunks * C - N
  h_KCD = jnp.pad(h_ND, ((0, pad), (0, 0))).reshape(n_chunks, C, D)
  t_KC = jnp.pad(targets_N, (0, pad)).reshape(n_chunks, C)

  @jax.checkpoint  # backward recomputes this chunk's logits instead of keeping all of them
  def one_chunk(h_CD, t_C):
    logits_CV = jnp.einsum("CD,DV->CV", h_CD, w_DV.astype(h_CD.dtype), preferred_element_type=jnp.float32)
    return logprobs_from_logits(logits_CV, t_C, temperature)

  _, (logp_KC, ent_KC) = jax.lax.scan(lambda _, xs: (None, one_chunk(*xs)), None, (h_KCD, t_KC))
  return logp_KC.reshape(-1)[:N], ent_KC.reshape(-1)[:N]
