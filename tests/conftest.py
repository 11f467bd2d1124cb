"""Test set-up: 8 fake CPU devices, strict numerics, before JAX picks a backend."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

# Many tests build a fresh jit of the same program (a train step per experiment); a session-wide
# persistent compilation cache turns those recompilations into disk hits. Fresh per session.
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jaxrl_test_xla_cache_"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")  # fp32 parity tests mean fp32


def pytest_configure(config):
  assert jax.device_count() == 8, f"conftest wants 8 fake CPU devices, got {jax.devices()}"
