"""HostSync (jaxrl_topo/mux/warm.py) with sync.mode='lora': a finished train phase writes the job's host-side rollout
copy straight from the train devices (adapters merged into the base there, cast to the rollout dtype), and the
rollout weights are bit-identical to what the job's own lora plan (merge on the rollout devices) lands.
8 fake CPU devices: trainer fsdp=4 on 0-3, rollout data=2 x tensor=2 on 4-7; rollout dtype bfloat16, so the order
of cast and merge matters (the plan casts the base, then merges in bfloat16)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_topo.mux import warm
from jaxrl_topo.mux.group import Group
from jaxrl_topo.mux.spec import JobSpec, MuxConfig, on_policy
from jaxrl_topo.runtime import experiment, loop
from jaxrl_topo.runtime.metrics import comparable
from tests.test_mux import _diff, _records, job_cfg


@pytest.fixture(scope="module")
def lora_exp(tmp_path_factory):
  cfg = job_cfg("a", **{"lora.rank": 4, "lora.alpha": 8.0, "sync.mode": "lora", "model.dtype": "bfloat16",
                        "run.sft_steps": 0})
  exp = experiment.build(cfg, str(tmp_path_factory.mktemp("lora")))
  # B starts at zero (merged == base): give the adapters values, laid out as the trainer holds them.
  adapters = exp.state.params["policy"]
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
  noisy = jax.tree.map(lambda x: jax.device_put(x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype),
                                                x.sharding), adapters)
  exp.state = exp.state.replace(params={**exp.state.params, "policy": noisy})
  calls = []
  run = exp.sync.plan.run
  exp.sync.plan.run = lambda *a, **k: (calls.append(1), run(*a, **k))[1]
  yield exp, calls
  exp.close()


def _sync(exp, calls, direct: bool):
  """(host leaves, shardings, stats without time, plan runs) of one sync into a parked rollout copy."""
  old = warm.park(jax.device_put(jax.device_get(exp.engine.params),
                                 jax.tree.map(lambda x: x.sharding, exp.engine.params)))
  del calls[:]
  parked, stats = warm.HostSync(exp.sync, direct=direct)(exp.state, old)
  assert isinstance(parked, warm.Parked)
  host = [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(parked.host)]
  return host, jax.tree.leaves(parked.shardings), {k: v for k, v in stats.items() if not k.startswith("time/")}, \
      len(calls)


def test_lora_direct_host_write_is_bit_identical_to_the_plan_and_skips_the_rollout_devices(lora_exp):
  exp, calls = lora_exp
  got, got_sh, got_stats, got_runs = _sync(exp, calls, direct=True)
  want, want_sh, want_stats, want_runs = _sync(exp, calls, direct=False)
  assert want_runs == 1 and got_runs == 0, "the direct write went through the rollout devices' plan"
  assert got_stats == want_stats and got_stats["sync/bytes"] > 0  # a solo run's lora sync stats (adapters, fp32)
  assert got_sh == want_sh and {d.id for s in got_sh for d in s.device_set} == {4, 5, 6, 7}
  assert {x.dtype for x in got} == {np.dtype(jax.numpy.bfloat16)}
  for g, w in zip(got, want, strict=True):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16))
  # Not vacuous: the adapters moved the merged kernels away from the base.
  base = [np.asarray(jax.device_get(x)).astype(np.float32) for x in jax.tree.leaves(exp.state.frozen)]
  assert any(not np.array_equal(g.astype(np.float32), b.astype(jax.numpy.bfloat16).astype(np.float32))
             for g, b in zip(got, base, strict=True))


@pytest.mark.slow
def test_a_lora_job_in_a_group_equals_its_solo_run_and_never_syncs_through_the_rollout_devices(tmp_path):
  cfg = job_cfg("a", **{"lora.rank": 4, "lora.alpha": 8.0, "sync.mode": "lora", "run.eval_every": 0})
  exp = experiment.build(on_policy(cfg), str(tmp_path / "solo"))
  ms = []
  try:
    loop.train_loop(exp, hooks=loop.LoopHooks(on_step=lambda step, m: ms.append(m)))
  finally:
    exp.close()
  group = Group([JobSpec("a", cfg, str(tmp_path / "a")), JobSpec("b", job_cfg("b"), str(tmp_path / "b"))],
                MuxConfig(migrate_at=0.5), str(tmp_path))
  group.build()
  calls = []
  run = group.jobs["a"].exp.sync.inner.plan.run
  group.jobs["a"].exp.sync.inner.plan.run = lambda *a, **k: (calls.append(1), run(*a, **k))[1]
  out = group.run()
  assert all(r["ok"] for r in out.values()), out
  got, want = comparable(group.jobs["a"].metrics), _records(ms)
  assert got == want, _diff(got, want)
  assert calls == [], "a lora sync went through the rollout devices' plan"
