"""How the trainer reads per-token log-probs (and values) out of any model.

`PolicyFns` is the seam between the train step and a model. Give it either
  hidden(params, tokens_RS, positions_RS, segment_ids_RS) -> h_RSD  and  unembed(params) -> w_DV
(our models: log-probs in chunks, value heads on the hidden states), or
  apply(params, tokens_RS, positions_RS, segment_ids_RS) -> logits_RSV
(any JAX model: full logits, no value head). Letters: R rows, S row length, B sequences, T response
tokens, D hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from jaxrl_topo.train.logprobs import chunked_logprobs, logprobs_from_logits


@dataclasses.dataclass(frozen=True)
class PolicyFns:
  """How the train step runs a policy: `apply(params, tokens_RS, positions_RS, segment_ids_RS) -> logits_RSV`
  (any model), or `hidden(...) -> h_RSD` with `unembed(params) -> w_DV` (chunked log-probs, no [tokens x vocab]
  array; a critic's value head reads `hidden`, so critics need this form: `model_fns(graphdef)`)."""

  apply: Callable | None = None
  hidden: Callable | None = None
  unembed: Callable | None = None

  def __post_init__(self):
    if (self.apply is None) == (self.hidden is None) or (self.hidden is None) != (self.unembed is None):
      raise ValueError("PolicyFns needs either apply=..., or hidden=... together with unembed=...")


def model_fns(graphdef) -> PolicyFns:
  """PolicyFns for our Transformer (build the graphdef with remat=True to rematerialise blocks)."""
  def hidden(params, tokens_RS, positions_RS, segment_ids_RS):
    return nnx.merge(graphdef, params).hidden(tokens_RS, positions_RS, segment_ids_RS)[0]

  def unembed(params):
    return nnx.merge(graphdef, params).unembed_DV()

  return PolicyFns(hidden=hidden, unembed=unembed)


def _gather_BT(x_RSX, gather_BT):
  """Rows -> sequence view: x at flat row position gather_BT[b, t]; X is any trailing dim."""
  R, S, X = x_RSX.shape
  return jnp.take(x_RSX.reshape(R * S, X), gather_BT.reshape(-1), axis=0).reshape(*gather_BT.shape, X)


def sequence_hidden(fns: PolicyFns, params, rows: tuple, gather_BT):
  """Hidden states [B, T, D] at the positions that predict each response token."""
  return _gather_BT(fns.hidden(params, *rows), gather_BT)


def sequence_logprobs(fns: PolicyFns, params, rows: tuple, gather_BT, targets_BT, *, temperature: float,
                      chunk: int):
  """(logp_BT, entropy_BT, h_BTD or None) of the response tokens under `params`."""
  B, T = targets_BT.shape
  if fns.hidden is not None:
    h_BTD = sequence_hidden(fns, params, rows, gather_BT)
    logp_N, ent_N = chunked_logprobs(h_BTD.reshape(B * T, -1), fns.unembed(params), targets_BT.reshape(-1),
                                     chunk=chunk, temperature=temperature)
    return logp_N.reshape(B, T), ent_N.reshape(B, T), h_BTD
  logits_BTV = _gather_BT(fns.apply(params, *rows), gather_BT)
  logp_N, ent_N = logprobs_from_logits(logits_BTV.reshape(B * T, -1), targets_BT.reshape(-1), temperature)
  return logp_N.reshape(B, T), ent_N.reshape(B, T), None
