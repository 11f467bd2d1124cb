"""JetStream is an optional extra (issue 16): the core never imports it, and serving without it says
how to install it. (The serving tests themselves run in .venv-jetstream: `make test-jetstream`.)"""

import importlib
import importlib.util
import os
import pkgutil
import subprocess
import sys

import pytest

import jaxrl_topo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_core_module_imports_jetstream():
  names = [m.name for m in pkgutil.walk_packages(jaxrl_topo.__path__, "jaxrl_topo.")
           if not m.name.startswith("jaxrl_topo.serving.jetstream")]
  code = ("import importlib, sys\n"
          f"for n in {names!r}: importlib.import_module(n)\n"
          "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jetstream', 'tensorflow', 'seqio'))\n"
          "assert not bad, bad\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("jetstream") is not None, reason="the extra is installed here")
def test_serve_without_the_extra_names_the_pip_command(tmp_path):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "serve.py"), f"--model={tmp_path}"],
                     capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode != 0
  assert "pip install -e '.[jetstream]'" in r.stderr, r.stderr[-2000:]


def test_serve_configs_sampling_is_checked_without_the_extra():
  """ServeConfig's (launchers/serve.py's) top_p / top_k / min_p (before: serving sampled at a temperature only)."""
  from jaxrl_topo.rollout.sampling import SamplingConfig
  from jaxrl_topo.serving.server import ServeConfig

  sc = ServeConfig(greedy=False, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05)
  assert sc.sampling == SamplingConfig(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05)
  assert ServeConfig(top_k=5).sampling == SamplingConfig(greedy=True)  # greedy ignores them
  with pytest.raises(ValueError, match="top_p must be in"):
    ServeConfig(greedy=False, top_p=0.0)
  with pytest.raises(ValueError, match="page_size=64 must be <= max_len=32"):  # serve.py's --page_size
    ServeConfig(page_size=64, max_len=32)
