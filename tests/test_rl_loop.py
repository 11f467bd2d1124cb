"""The RL controller end to end on the fake 8-device CPU: three modes, one algorithm, resume.

Each mode trains the `tiny` demo config for a few steps on an 8-device topology (trainer fsdp=4,
rollout data=2 x tensor=2): colocated on devices 0-3, disaggregated / async with the rollout on 4-7.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from jaxrl_topo.runtime import run as run_lib
from jaxrl_topo.runtime.config import from_config_dict
from jaxrl_topo.runtime.metrics import comparable, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, arg: str, **overrides):
  """configs/<name>.py:<arg> with dotted overrides, as the launcher applies them."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(arg)
  for dotted, value in overrides.items():
    node = c
    *path, last = dotted.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return c


TOPO = {"colocated": dict(mode="colocated", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2}),
        "disaggregated": dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2}),
        "async": dict(mode="async", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2})}


def _cfg(mode: str, steps: int, **kw):
  c = load_config("grpo_task", "tiny", **{"run.steps": steps, "run.eval_every": 0, "run.tensorboard": False,
                                          "run.plot": False, "reward.n_workers": 0, "run.sft_steps": 10,
                                          "data.batch_size": 4, "rl.group_size": 4, "rollout.n_slots": 16, **kw})
  c.topology = TOPO[mode]
  return from_config_dict(c)


def _params(workdir):
  from jaxrl_topo.runtime.checkpoint import Checkpointer
  with Checkpointer(os.path.join(workdir, "checkpoints")) as ck:
    step = ck.latest_step()
    import orbax.checkpoint as ocp  # noqa: F401
  return step


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "async"])
def test_each_mode_trains_and_stays_within_the_staleness_bound(mode, tmp_path):
  eta = {"colocated": 0, "disaggregated": 1, "async": 2}[mode]
  cfg = _cfg(mode, steps=6, **{"run.max_staleness": eta, "run.land_after_chunks": 1})
  summary = run_lib.train(cfg, str(tmp_path), progress=False)
  assert summary["mode"] == mode and summary["steps"] == 6
  records = read_metrics(str(tmp_path))
  assert [r["step"] for r in records] == list(range(6))
  lags = [r["staleness/max"] for r in records]
  assert max(lags) <= eta, f"{mode}: observed lag {lags} exceeds eta={eta}"
  if mode != "colocated":
    assert max(lags) >= 1, f"{mode}: nothing overlapped (lags {lags})"
  assert all(np.isfinite(r["loss"]) for r in records)
  with open(tmp_path / "summary.json") as f:
    assert json.load(f)["mode"] == mode


def test_colocated_and_disaggregated_with_zero_staleness_give_the_same_parameters(tmp_path):
  """Same seed, same trainer mesh shape (fsdp=4), rollout data=2 x tensor=2 on the same or on other devices."""
  import jax

  from jaxrl_topo.runtime import experiment, loop

  params = {}
  for mode in ("colocated", "disaggregated"):
    cfg = _cfg(mode, steps=3, **{"run.max_staleness": 0})
    exp = experiment.build(cfg, str(tmp_path / mode))
    try:
      loop.train_loop(exp)
      params[mode] = jax.device_get(exp.state.params)
    finally:
      exp.close()
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params["colocated"], params["disaggregated"])
  assert all(jax.tree.leaves(same)), "colocated and disaggregated (eta=0) runs diverged"
  moved = jax.tree.map(lambda a: float(np.abs(a).sum()), params["colocated"])
  assert all(v > 0 for v in jax.tree.leaves(moved))


def _launch(workdir, steps, kill_at=None, **overrides):
  import subprocess
  import sys

  flags = {"run.steps": steps, "run.checkpoint_every": 2, "run.eval_every": 0, "run.tensorboard": False,
           "run.plot": False, "reward.n_workers": 0, "run.sft_steps": 10, "data.batch_size": 4, "rl.group_size": 4,
           "rollout.n_slots": 16, **overrides}
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "train.py"), "--config",
         os.path.join(ROOT, "configs", "grpo_task.py") + ":tiny", f"--workdir={workdir}", "--noprogress",
         *[f"--config.{k}={v}" for k, v in flags.items()]]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  env.pop("JAXRL_KILL_AT", None)
  if kill_at:
    env["JAXRL_KILL_AT"] = kill_at
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["rollout:3", "saving:4"])  # mid-step; mid-save (async write in flight)
def test_resume_after_a_kill_repeats_the_uninterrupted_run(kill_at, tmp_path):

  ref = tmp_path / "ref"
  done = _launch(ref, steps=6)
  assert done.returncode == 0, done.stderr[-3000:]
  run = tmp_path / "killed"
  killed = _launch(run, steps=6, kill_at=kill_at)
  assert killed.returncode == 137, f"the kill point {kill_at} was not reached:\n{killed.stderr[-3000:]}"
  resumed = _launch(run, steps=6)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  with open(run / "summary.json") as f:
    assert json.load(f)["resumed_from"] == 2
  want, got = comparable(read_metrics(str(ref))), comparable(read_metrics(str(run)))
  assert [r["step"] for r in got] == list(range(6))
  assert got == want, "a resumed run must repeat the uninterrupted run's metrics"
