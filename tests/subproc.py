"""Environments for the tests' child processes (launchers, CLIs, killed runs) on the CPU.

A child compiles its programs from scratch, so it takes the suite's fast-compile XLA flags (see the
Makefile's TEST_XLA_FLAGS: about a third less compile time, same numerics) with its own fake-device count."""

from __future__ import annotations

import os

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")


def cpu_env(devices: int = 1, **extra: str) -> dict:
  """os.environ with JAX on the CPU, `devices` fake devices and fast compiles, then `extra` on top. The child shares
  the session's persistent compilation cache (conftest.py) unless the caller names one: launchers run by several
  tests compile the same programs."""
  flags = FAST_COMPILE + (f" --xla_force_host_platform_device_count={devices}" if devices > 1 else "")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
  if os.environ.get(SESSION_CACHE) and "JAX_COMPILATION_CACHE_DIR" not in env:
    env.update(JAX_COMPILATION_CACHE_DIR=os.environ[SESSION_CACHE], JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2")
  return {**env, **extra}


SESSION_CACHE = "JAXRL_TEST_XLA_CACHE"  # conftest.py's: the session's compilation cache directory
