"""The sampler's randomness with JAX's own bits, computed as one fused elementwise pass.

`fold_in` and `gumbel_BV` return exactly what `jax.random.fold_in` and `jax.random.gumbel` return for
threefry keys under JAX's default PRNG settings (`jax_threefry_partitionable`, gumbel mode "low"):
tests/test_sampling.py checks them bit for bit. The difference is the program. On CPU JAX lowers
threefry with a rolled loop (5 trips of 4 rounds, a few kernels each, for every call); a decode step
calls it three times (two fold-ins for the row keys, then the bits of the noise). On a 2-core CPU the
fixed-length workload's decode ran 1.2-1.3x faster with no sampling at all (benchmarks/RESULTS.md).
Written out here, the 20 rounds are plain uint32 arithmetic that XLA fuses with the uniform -> gumbel
transform into one loop over [B, V].

Threefry-2x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): 20 rounds
of add / rotate / xor on two 32-bit words, the key injected every 4 rounds. Keys are the uint32
pairs of `jax.random.key_data`. Alphabet: B rows, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotl(x, r: int):
  return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
  """The Threefry-2x32 block function, unrolled; every argument uint32, broadcast together."""
  ks = (k0, k1, k0 ^ k1 ^ _PARITY)
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1


def is_threefry(keys) -> bool:
  """Whether `keys` (typed key array) use the threefry2x32 implementation, the only one this module reproduces."""
  return jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key) and "threefry" in str(jax.random.key_impl(keys))


def fold_in(kd_B2, data_B):
  """jax.random.fold_in on key data [B, 2] (uint32) and one 32-bit integer per row: new key data [B, 2]."""
  zero = jnp.zeros(data_B.shape, jnp.uint32)
  y0, y1 = threefry2x32(kd_B2[:, 0], kd_B2[:, 1], zero, data_B.astype(jnp.uint32))
  return jnp.stack([y0, y1], axis=-1)


def gumbel_BV(kd_B2, V: int):
  """jax.random.gumbel(key_b, (V,), float32) for every row b of key data [B, 2]: [B, V] float32."""
  count_1V = jnp.arange(V, dtype=jnp.uint32)[None, :]
  y0, y1 = threefry2x32(kd_B2[:, :1], kd_B2[:, 1:], jnp.zeros_like(count_1V), count_1V)
  bits = y0 ^ y1
  # uniform on [tiny, 1): 23 random mantissa bits under exponent 0, minus 1, scaled, as jax.random.uniform does
  tiny = np.float32(np.finfo(np.float32).tiny)
  floats = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32) - np.float32(1)
  u = jnp.maximum(tiny, floats * (np.float32(1) - tiny) + tiny)
  return -jnp.log(-jnp.log(u))
