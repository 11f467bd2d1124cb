"""A simple dense-cache decoder: one jitted call prefills a batch and decodes it to the end.

This is the obviously-correct reference the paged engine is checked against, and what
`launchers/generate.py` runs. Prompts arrive right-padded to a bucketed length with their true
lengths; each row's cache slot s holds its token at position s (layers.DenseKVCache), so ragged
rows need no left-padding and no position shifting.

The token sampled at step i of row b uses the key (seed, seq_ids[b], position), so a sequence's
output does not depend on its batch slot or on what else is in the batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_topo.models.layers import DenseKVCache
from jaxrl_topo.rollout.sampling import SamplingConfig, sample_tokens, sequence_keys


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  """Static settings of one decode call (hashable: a change compiles a new program)."""

  max_new_tokens: int
  sampling: SamplingConfig = SamplingConfig(greedy=True)
  eos_ids: tuple[int, ...] = ()
  pad_id: int = 0

  def __post_init__(self):
    if self.max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be positive")


def bucket_length(n: int, minimum: int, maximum: int | None = None) -> int:
  """n rounded up to a power of two (at least `minimum`, at most `maximum`): prompt shapes compile a
  handful of programs, not one per length."""
  b = max(minimum, 1 << (n - 1).bit_length())
  return b if maximum is None else min(b, maximum)


def _is_eos(tokens_B, eos_ids: tuple[int, ...]):
  if not eos_ids:
    return jnp.zeros(tokens_B.shape, bool)
  return jnp.isin(tokens_B, jnp.asarray(eos_ids, tokens_B.dtype))


@functools.partial(jax.jit, static_argnames=("graphdef", "decode"))
def generate_dense(graphdef, params, prompts_BT, prompt_lens_B, seq_ids_B, key, *, decode: DecodeConfig):
  """Returns (tokens_BM, logprobs_BM, lengths_B, stopped_B) for M = max_new_tokens.

  tokens_BM: completion tokens, the stop token included; `pad_id` after a row finishes.
  logprobs_BM: each token's log-prob under the sampling convention of rollout/sampling.py.
  lengths_B: completion length per row (stop token counted); stopped_B: True if an EOS ended it.
  """
  model = nnx.merge(graphdef, params)
  B, T = prompts_BT.shape
  M = decode.max_new_tokens
  cache = DenseKVCache.zeros(model.cfg, B, T + M)
  positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  h_BTD, cache = model.hidden(prompts_BT, positions_BT, None, cache)
  h_B1D = jnp.take_along_axis(h_BTD, (prompt_lens_B - 1)[:, None, None], axis=1)

  def sample(h_B1D, positions_B):
    logits_BV = model.logits(h_B1D)[:, 0]
    return sample_tokens(logits_BV, sequence_keys(key, seq_ids_B, positions_B), decode.sampling)

  tok_B, lp_B = sample(h_B1D, prompt_lens_B)
  tokens_BM = jnp.full((B, M), decode.pad_id, jnp.int32).at[:, 0].set(tok_B)
  logprobs_BM = jnp.zeros((B, M), jnp.float32).at[:, 0].set(lp_B)
  done_B = _is_eos(tok_B, decode.eos_ids)

  def cond(carry):
    i, _, _, _, done_B, _ = carry
    return (i < M) & ~jnp.all(done_B)

  def body(carry):
    i, cache, tokens_BM, logprobs_BM, done_B, lengths_B = carry
    positions_B = prompt_lens_B + i - 1  # position of the token fed in (sampled at step i - 1)
    last_B1 = jax.lax.dynamic_slice_in_dim(tokens_BM, i - 1, 1, axis=1)
    h_B1D, cache = model.hidden(last_B1, positions_B[:, None], None, cache)
    tok_B, lp_B = sample(h_B1D, positions_B + 1)
    tok_B = jnp.where(done_B, decode.pad_id, tok_B)
    tokens_BM = jax.lax.dynamic_update_slice(tokens_BM, tok_B[:, None], (0, i))
    logprobs_BM = jax.lax.dynamic_update_slice(logprobs_BM, jnp.where(done_B, 0.0, lp_B)[:, None], (0, i))
    lengths_B = lengths_B + ~done_B
    done_B = done_B | _is_eos(tok_B, decode.eos_ids)
    return i + 1, cache, tokens_BM, logprobs_BM, done_B, lengths_B

  carry = (jnp.int32(1), cache, tokens_BM, logprobs_BM, done_B, jnp.ones((B,), jnp.int32))
  _, _, tokens_BM, logprobs_BM, stopped_B, lengths_B = jax.lax.while_loop(cond, body, carry)
  return tokens_BM, logprobs_BM, lengths_B, stopped_B
