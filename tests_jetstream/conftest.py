"""`make test-jetstream`: the JetStream serving tests, in .venv-jetstream (the optional extra installed).

The core suite (tests/) never imports jetstream; these tests need it. 8 fake CPU devices, fp32
parity, as in tests/conftest.py.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # jetstream imports TensorFlow (through seqio)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
