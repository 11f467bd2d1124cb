# `make demo` and `make test` work on a fresh machine with only Python 3.11+ and pip:
# each creates (or reuses) .venv in the repo root and installs what it needs into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Tests fake 8 CPU devices; the demo and launchers see the machine as it is. Most of the suite's time
# is XLA compiling tiny programs, so tests compile cheaply: LLVM at less optimisation (about a third
# less wall time), the older loop emitters instead of XLA:CPU's MLIR fusion emitters and LLVM modules
# not split for parallel codegen (about a third less CPU time again). Same semantics: XLA's CPU backend
# does not use fast-math either way. tests/subproc.py gives child processes the same flags.
TEST_XLA_FLAGS := --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1
TEST_ENV := XLA_FLAGS="$(TEST_XLA_FLAGS)" JAX_PLATFORMS=cpu

# Installs go through scripts/venv_install.sh: a dropped connection or a failed install is retried in a
# new venv, up to three times, so no half-installed package is left to count as installed.
INSTALL := scripts/venv_install.sh $(PYTHON)

.PHONY: demo test test-fast test-readme test-benchmarks test-jetstream lint install install-test clean

# Stamps re-run the install whenever pyproject.toml changes.
$(VENV)/.core: pyproject.toml
	$(INSTALL) $(VENV) -e .
	touch $@

$(VENV)/.test: pyproject.toml
	$(INSTALL) $(VENV) -e '.[test]'
	touch $@ $(VENV)/.core

install: $(VENV)/.core
install-test: $(VENV)/.test

# The demo: a random-init char-level model, a short supervised warm-up, then GRPO on string
# reversal (configs/grpo_task.py:tiny); prints held-out accuracy before and after RL.
demo: $(VENV)/.core
	rm -rf runs/demo
	$(BIN)/python launchers/train.py --config=configs/grpo_task.py:tiny --workdir=runs/demo
	@echo "--- runs/demo: summary.json, metrics.jsonl, reward_curve.png, tb/ (tensorboard --logdir runs/demo/tb)"
	@cat runs/demo/summary.json

lint: $(VENV)/.test
	$(BIN)/ruff check .

# Two xdist workers: much of the suite is single-threaded XLA compilation, so the second core is
# otherwise idle; tests/conftest.py groups tests that share module fixtures onto one worker.
PYTEST_WORKERS ?= 2
test: lint
	$(TEST_ENV) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not readme and not benchmarks" --durations=30

test-fast: lint
	$(TEST_ENV) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow and not readme and not benchmarks"

# Every command README.md shows, run as written on this CPU (tests/test_readme.py; about 9 minutes).
test-readme: $(VENV)/.test
	$(TEST_ENV) $(BIN)/python -m pytest -m readme tests/test_readme.py

# Every CPU benchmark script at its smallest setting, in subprocesses (tests/test_benchmarks_run.py; about
# 3.5 minutes): they run nowhere else, so without this they stop running unseen.
test-benchmarks: $(VENV)/.test
	$(TEST_ENV) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m benchmarks tests/test_benchmarks_run.py --durations=20

# Serving through JetStream (an optional extra, about 3 GB with TensorFlow): its own venv, so the core
# suite keeps proving that nothing needs it. pip's cache is shared with .venv's installs.
JS_VENV := .venv-jetstream
$(JS_VENV)/.installed: pyproject.toml
	$(INSTALL) $(JS_VENV) -e '.[test,jetstream]'
	touch $@

test-jetstream: $(JS_VENV)/.installed
	$(TEST_ENV) $(JS_VENV)/bin/python -m pytest tests_jetstream

clean:
	rm -rf $(VENV) $(JS_VENV) runs .pytest_cache .ruff_cache
