"""Test set-up: 8 fake CPU devices, strict numerics, before JAX picks a backend."""

import gc
import os
import shutil
import tempfile

from subproc import FAST_COMPILE

# Fast compiles for tiny programs (see the Makefile's TEST_XLA_FLAGS); `make test` sets the same.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
from subproc import SESSION_CACHE  # noqa: E402

jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")  # fp32 parity tests mean fp32


_CACHE_ENV = SESSION_CACHE  # children started through subproc.cpu_env share it
_OWNED_CACHE = pytest.StashKey[str]()


def pytest_configure(config):
  # Many tests build a fresh jit of the same program (a train step per experiment); a session-wide
  # persistent compilation cache turns those recompilations into disk hits. Fresh per session and removed
  # when it ends: the main process makes it and its xdist workers (`make test` runs two) inherit its path.
  # A JAXRL_TEST_XLA_CACHE set by the user names a cache to keep across sessions instead.
  cache = os.environ.get(_CACHE_ENV)
  if not cache:
    cache = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jaxrl_test_xla_cache_")
    config.stash[_OWNED_CACHE] = cache
  os.makedirs(cache, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", cache)
  assert jax.device_count() == 8, f"conftest wants 8 fake CPU devices, got {jax.devices()}"


def pytest_unconfigure(config):
  if _OWNED_CACHE in config.stash:  # the process that made the session's cache, after its workers are done
    shutil.rmtree(config.stash[_OWNED_CACHE], ignore_errors=True)


# `make test` runs two xdist workers with --dist loadgroup. Whole files stay on one worker (their
# module fixtures and cached compiles are built once), except the two heaviest files, split so
# the workers finish together: test_multiprocess per test, test_rl_loop per shared fixture.
_SPLIT_BY_FIXTURE = {"test_rl_loop.py": ("launched", "mode_runs")}
_SPLIT_PER_TEST = ("test_multiprocess.py",)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  for item in items:
    name = item.path.name
    if name in _SPLIT_PER_TEST:
      continue
    if name in _SPLIT_BY_FIXTURE:
      shared = [f for f in _SPLIT_BY_FIXTURE[name] if f in item.fixturenames]
      if shared:
        item.add_marker(pytest.mark.xdist_group(f"{name}:{shared[0]}"))
      continue
    item.add_marker(pytest.mark.xdist_group(name))


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
  """XLA:CPU executables keep their JIT-linked code in memory mappings, and a process may hold at most
  vm.max_map_count (65,530): one process running test_engine, test_engine_sharded and test_generate
  reached 46,503, and `make test` workers aborted inside XLA. So each test file's compiled programs go
  when the file is done (peak about 30,600, in test_engine); the persistent compilation cache above
  makes a later recompile a disk read."""
  yield
  jax.clear_caches()
  gc.collect()
