"""Next-token sampling inside jit: temperature, top-k, top-p, min-p, one key per row.

Alphabet: B=batch rows, V=vocabulary, K=top_k.

Log-prob convention. `sample_tokens` returns, for each row, the log-probability

    logprob = log_softmax(logits / T)[token]      over the FULL vocabulary,

with T = cfg.temperature (T = 1 when greedy). It is NOT renormalised over the set kept by
top-k/top-p/min-p. That is the quantity a trainer recomputes from its own logits, so the two
agree up to numerics. It is not the probability the token was drawn with: under truncation that is
p / Z_kept (Z_kept = the mass kept), so the importance weight pi_train / pi_rollout the loss sees is
about 1 and does not correct for truncation; its samples lean towards the kept set. The defaults
(no top-k/top-p/min-p) sample the full distribution; truncation is a choice of biased exploration.

Truncation order (the one vLLM and HF use): temperature -> top-k -> top-p -> min-p.
  * top-k keeps tokens whose scaled logit is >= the k-th largest one (`lax.top_k`, k static).
  * top-p works on the top-k-renormalised distribution q: it keeps q >= tau*, where tau* is the
    largest threshold whose kept mass is >= top_p. That is the shortest prefix of the sorted
    distribution reaching top_p, except that ALL tokens tied with the last one are kept.
  * min-p keeps p >= min_p * max(p); the arg-max survives every filter, so the set is non-empty.
Ties at the top-k boundary are likewise all kept, so the kept set never depends on how a sort
would break ties, and the jitted version and a sort-based reference agree exactly.
The token is then drawn from the kept set with probability proportional to softmax(logits / T).

No full-vocabulary sort: tau* is found by bisecting over the bit pattern of a float32 in [0, 1]
(positive floats order like their int32 bits), each step one O(V) masked sum. The range holds
< 2^30 floats, so 32 steps land on tau* exactly: no tolerance, unlike bisecting on the value.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxrl_topo.rollout import gumbel
from jaxrl_topo.runtime.dataclass_io import check_types

_BISECT_STEPS = 32  # > log2(#float32 in [0, 1]) = 30: the bisection ends on adjacent floats.
_ONE_BITS = 0x3F800000  # int32 bit pattern of float32(1.0).
MIN_TEMPERATURE = 1e-4  # below it, sampling is refused: greedy decoding is what such a temperature means


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How to pick the next token. Frozen and hashable: pass it to jit as a static argument.

  greedy: arg-max; the other fields are then ignored (the arg-max survives any truncation).
  temperature: logits are divided by it before everything else; > 0 unless greedy.
  top_k: keep the k most likely tokens (plus ties); 0 = off.
  top_p: nucleus mass in (0, 1]; 1 = off.
  min_p: keep tokens with p >= min_p * max(p), in [0, 1); 0 = off.
  """

  greedy: bool = False
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  def __post_init__(self):
    check_types("SamplingConfig", self)  # the fields' types: greedy=1 or top_k=2.0 is refused
    # `not x > 0` instead of `x <= 0` so that NaN is rejected too.
    if not self.temperature < math.inf:  # inf, or NaN
      raise ValueError(f"temperature must be finite, got temperature={self.temperature}")
    if not self.temperature >= 0 or (not self.greedy and not self.temperature > 0):
      raise ValueError(f"temperature must be > 0 unless greedy, got temperature={self.temperature}")
    if not self.greedy and self.temperature < MIN_TEMPERATURE:
      raise ValueError(f"temperature={self.temperature} is below {MIN_TEMPERATURE}: float32 logits / temperature "
                       "lose their precision there (log-probs came out as +-inf below 1e-8); for the most likely "
                       "token use greedy decoding (greedy=True, --greedy)")
    if self.top_k < 0:
      raise ValueError(f"top_k must be an int >= 0 (0 = off), got top_k={self.top_k!r}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1] (1 = off), got top_p={self.top_p}")
    if not 0.0 <= self.min_p < 1.0:
      raise ValueError(f"min_p must be in [0, 1) (0 = off), got min_p={self.min_p}")

  @property
  def truncates(self) -> bool:
    """True when any of top-k / top-p / min-p can remove tokens."""
    return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def sequence_keys(base_key: jax.Array, seq_ids_B: jax.Array, positions_B: jax.Array) -> jax.Array:
  """keys_B[b] = fold_in(fold_in(base_key, seq_ids_B[b]), positions_B[b]).

  The key depends on which sequence and which position, never on the batch slot, so a sequence
  samples the same tokens whatever else shares its batch (continuous batching moves rows).
  """
  if not gumbel.is_threefry(base_key):
    fold = lambda seq_id, pos: jax.random.fold_in(jax.random.fold_in(base_key, seq_id), pos)
    return jax.vmap(fold)(seq_ids_B, positions_B)
  kd_B2 = jnp.broadcast_to(jax.random.key_data(base_key), (*seq_ids_B.shape, 2))  # the same bits, fused (gumbel.py)
  kd_B2 = gumbel.fold_in(gumbel.fold_in(kd_B2, seq_ids_B), positions_B)
  return jax.random.wrap_key_data(kd_B2, impl=jax.random.key_impl(base_key))


def _scale(logits_BV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """logits / T in float32: bf16 logits would make ties and a coarse softmax."""
  return logits_BV.astype(jnp.float32) / (1.0 if cfg.greedy else cfg.temperature)


def _top_p_threshold(probs_V: jax.Array, keep_V: jax.Array, top_p: float) -> jax.Array:
  """tau* = max{tau : sum_{keep, p >= tau} p >= top_p * sum_keep p}, found by bisection on bits.

  Masses are compared unnormalised (top_p * total) so no division rounds q. Invariant: `lo` is
  feasible (tau = 0 keeps everything), `hi` is not (above 1.0 nothing is kept), so the loop
  ends with lo = the largest feasible float, which is a kept token's probability.
  """
  kept_V = jnp.where(keep_V, probs_V, 0.0)
  target = top_p * kept_V.sum()

  def step(_, lo_hi):
    lo, hi = lo_hi
    mid = lo + (hi - lo) // 2
    tau = jax.lax.bitcast_convert_type(mid, jnp.float32)
    feasible = jnp.where(probs_V >= tau, kept_V, 0.0).sum() >= target
    return jnp.where(feasible, mid, lo), jnp.where(feasible, hi, mid)

  init = (jnp.int32(0), jnp.int32(_ONE_BITS + 1))
  lo, _ = jax.lax.fori_loop(0, _BISECT_STEPS, step, init)
  return jax.lax.bitcast_convert_type(lo, jnp.float32)


def _keep_row(scaled_V: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Kept-token mask of one row, in the order top-k -> top-p -> min-p (module docstring)."""
  V = scaled_V.shape[0]
  probs_V = jax.nn.softmax(scaled_V)
  keep_V = jnp.ones((V,), jnp.bool_)
  if 0 < cfg.top_k < V:  # k >= V keeps everything: skip the top_k call.
    kth = jax.lax.top_k(scaled_V, cfg.top_k)[0][cfg.top_k - 1]
    keep_V = scaled_V >= kth
  if cfg.top_p < 1.0:
    keep_V = keep_V & (probs_V >= _top_p_threshold(probs_V, keep_V, cfg.top_p))
  if cfg.min_p > 0.0:
    keep_V = keep_V & (probs_V >= cfg.min_p * probs_V.max())
  return keep_V


def truncation_mask(logits_BV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """keep_BV: the tokens that top-k/top-p/min-p leave on the temperature-scaled logits."""
  return _keep_BV(_scale(logits_BV, cfg), cfg)


def _keep_BV(scaled_BV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  return jax.vmap(functools.partial(_keep_row, cfg=cfg))(scaled_BV)


def _draw(scaled_BV: jax.Array, keys_B: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """One draw per row from softmax(scaled) restricted to the kept set: gumbel-max, argmax(gumbel + scaled),
  which is jax.random.categorical bit for bit (its noise computed in one fused pass: gumbel.py)."""
  if cfg.truncates:
    scaled_BV = jnp.where(_keep_BV(scaled_BV, cfg), scaled_BV, -jnp.inf)
  if not gumbel.is_threefry(keys_B):
    return jax.vmap(jax.random.categorical)(keys_B, scaled_BV)
  return argmax_BV(gumbel.gumbel_BV(jax.random.key_data(keys_B), scaled_BV.shape[-1]) + scaled_BV)


def argmax_BV(x_BV: jax.Array) -> jax.Array:
  """jnp.argmax(x_BV, axis=-1) (the first maximum; the first NaN if a row has one) as plain max / min reductions.
  XLA:CPU runs jnp.argmax's paired (value, index) reduction element by element, with whatever is fused into
  it (the gumbel noise: threefry and two logs); over [32, 512] that was 4x slower than the sampler is now."""
  V = x_BV.shape[-1]
  iota_1V = jnp.arange(V, dtype=jnp.int32)[None, :]
  first_max_B = jnp.min(jnp.where(x_BV == x_BV.max(-1, keepdims=True), iota_1V, V), axis=-1)
  first_nan_B = jnp.min(jnp.where(jnp.isnan(x_BV), iota_1V, V), axis=-1)
  return jnp.where(first_nan_B < V, first_nan_B, first_max_B)


def sample_tokens(
    logits_BV: jax.Array, keys_B: jax.Array, cfg: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
  """Samples one token per row; returns (tokens_B int32, logprobs_B float32).

  logprobs_B = log_softmax(logits_BV / T)[tokens_B] over the full vocabulary (not renormalised
  after truncation; see the module docstring). Greedy: tokens_B = argmax (ties -> lowest index)
  and T = 1. Row b uses only keys_B[b]. Jit with `static_argnames="cfg"`.
  """
  scaled_BV = _scale(logits_BV, cfg)
  if cfg.greedy:
    tokens_B = argmax_BV(scaled_BV)
  else:
    tokens_B = _draw(scaled_BV, keys_B, cfg)
  tokens_B = tokens_B.astype(jnp.int32)
  # log_softmax(logits / T) with the max subtracted before the division: the top token's shifted logit is exactly 0,
  # so a log-prob is <= 0 and finite at any temperature. Divided first, the scaled logits' rounding (|logit| / T
  # ulps, where XLA computes them twice) read as +-0.003 at T = 1e-4 and as +-inf at 1e-9.
  logits_BV = logits_BV.astype(jnp.float32)
  shifted_BV = (logits_BV - logits_BV.max(axis=-1, keepdims=True)) / (1.0 if cfg.greedy else cfg.temperature)
  logprobs_B = jnp.take_along_axis(shifted_BV, tokens_B[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(shifted_BV, -1)
  return tokens_B, logprobs_B
