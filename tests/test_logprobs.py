"""Chunked log-probs against the explicit-logits path, and both against numpy (STYLE H11).

Letters: N tokens, D hidden, V vocab. A failure in the equality tests means the chunked scan drops,
duplicates or misaligns tokens (padding of the last chunk) or applies the temperature differently;
a failure in the memory test means the [N, V] logits (or their cotangent) are live again.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_topo.train.logprobs import chunked_logprobs, logprobs_from_logits


def _case(N, D, V, seed=0):
  kh, kw, kt = jax.random.split(jax.random.key(seed), 3)
  h_ND = jax.random.normal(kh, (N, D), jnp.float32)
  w_DV = jax.random.normal(kw, (D, V), jnp.float32) * 0.5
  t_N = jax.random.randint(kt, (N,), 0, V)
  return h_ND, w_DV, t_N


def _naive(h_ND, w_DV, t_N, temperature):
  return logprobs_from_logits(h_ND @ w_DV, t_N, temperature)


# (N, chunk, temperature): N not a multiple of the chunk; chunk > N; chunk == N; T != 1 with both.
CASES = [(37, 8, 1.0), (37, 64, 1.0), (32, 32, 1.0), (37, 8, 0.7), (20, 64, 1.6)]


@pytest.mark.parametrize("N,chunk,temperature", CASES)
def test_chunked_matches_naive_values(N, chunk, temperature):
  h_ND, w_DV, t_N = _case(N, D=16, V=50)
  got = jax.jit(chunked_logprobs, static_argnames=("chunk", "temperature"))(
      h_ND, w_DV, t_N, chunk=chunk, temperature=temperature)
  want = jax.jit(_naive, static_argnums=3)(h_ND, w_DV, t_N, temperature)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
  assert got[0].shape == (N,) and got[1].shape == (N,)


@pytest.mark.parametrize("N,chunk,temperature", CASES)
def test_chunked_matches_naive_gradients(N, chunk, temperature):
  """Gradients of sum(a * logp + b * entropy) w.r.t. h and w; a, b random so no token is left out."""
  h_ND, w_DV, t_N = _case(N, D=16, V=50, seed=1)
  a_N, b_N = jax.random.normal(jax.random.key(2), (2, N))

  def objective(impl):
    def f(h, w):
      logp_N, ent_N = impl(h, w)
      return jnp.sum(a_N * logp_N + b_N * ent_N)
    return jax.jit(jax.grad(f, argnums=(0, 1)))

  got = objective(lambda h, w: chunked_logprobs(h, w, t_N, chunk=chunk, temperature=temperature))(h_ND, w_DV)
  want = objective(lambda h, w: _naive(h, w, t_N, temperature))(h_ND, w_DV)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(got[1]).max()) > 1e-3  # a real gradient was compared, not two zeros


def _numpy_reference(logits_NV, t_N, temperature):
  z = np.asarray(logits_NV, np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  logsm_NV = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return logsm_NV[np.arange(len(t_N)), t_N], -(np.exp(logsm_NV) * logsm_NV).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_logprobs_from_logits_matches_numpy(temperature):
  logits_NV = np.random.default_rng(0).normal(size=(6, 11)).astype(np.float32) * 4.0
  logits_NV[0] += 80.0  # a large shift: logsumexp must stay stable
  logits_NV[1, 3] = 60.0  # a near-one-hot row: entropy near 0, logp of the peak near 0
  t_N = np.array([0, 3, 10, 5, 7, 1])
  logp, ent = logprobs_from_logits(jnp.asarray(logits_NV), jnp.asarray(t_N), temperature)
  want_logp, want_ent = _numpy_reference(logits_NV, t_N, temperature)
  np.testing.assert_allclose(logp, want_logp, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(ent, want_ent, atol=1e-5, rtol=1e-5)
  assert abs(float(logp[1])) < 1e-5 and float(ent[1]) < 1e-5


def test_uniform_logits_by_hand():
  """All-equal logits over V=4: logp = -log 4 for every target and entropy = log 4, at any T."""
  logp, ent = logprobs_from_logits(jnp.full((3, 4), 2.5), jnp.array([0, 1, 3]), 0.7)
  np.testing.assert_allclose(logp, [-np.log(4)] * 3, rtol=1e-6)
  np.testing.assert_allclose(ent, [np.log(4)] * 3, rtol=1e-6)


def test_chunked_grad_memory_is_a_fraction_of_naive():
  """AOT only: value-and-grad of sum(logp) at N=2048, V=65536 (naive fp32 logits are 512 MiB)."""
  N, D, V, chunk = 2048, 64, 65536, 256
  args = (jax.ShapeDtypeStruct((N, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
          jax.ShapeDtypeStruct((N,), jnp.int32))

  def temp_bytes(impl):
    f = jax.value_and_grad(lambda h, w, t: jnp.sum(impl(h, w, t)[0]), argnums=(0, 1))
    stats = jax.jit(f).lower(*args).compile().memory_analysis()
    if stats is None:
      pytest.skip(f"memory_analysis() returns None on {jax.default_backend()} with jax {jax.__version__}")
    return stats.temp_size_in_bytes

  naive = temp_bytes(lambda h, w, t: _naive(h, w, t, 1.0))
  chunked = temp_bytes(lambda h, w, t: chunked_logprobs(h, w, t, chunk=chunk))
  assert naive >= N * V * 4, f"naive temp {naive} B is below one [N, V] fp32 logits array ({N * V * 4} B)"
  assert chunked < naive / 4, f"chunked temp {chunked} B is not < 1/4 of naive temp {naive} B (chunk={chunk})"
