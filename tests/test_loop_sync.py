"""The weight-sync modes in the RL loop (runtime/sync.py): full | delta | lora, buckets, freeing the old weights.

Disaggregated `tiny` runs on the fake 8-device CPU (trainer fsdp=4 on devices 0-3, rollout data=2 x tensor=2
on 4-7), a few steps each, no warm-up.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from run_fixtures import TOPO, load_config

from jaxrl_topo.runtime import experiment, loop
from jaxrl_topo.runtime.config import from_config_dict
from jaxrl_topo.runtime.sections import SyncSpec

KIB = 2**10


def _cfg(steps: int = 2, mode: str = "disaggregated", **kw):
  c = load_config("grpo_task", "tiny", **{"run.steps": steps, "run.eval_every": 0, "run.tensorboard": False,
                                          "run.plot": False, "reward.n_workers": 0, "run.sft_steps": 0,
                                          "data.batch_size": 2, "rl.group_size": 4, "rollout.n_slots": 8,
                                          "run.checkpoint_every": 0, **kw})
  c.topology = TOPO[mode]
  return from_config_dict(c)


def _train(cfg, workdir, setup=lambda exp: None):
  """(metrics per step, the experiment's rollout and trainer weights after the run)."""
  exp = experiment.build(cfg, str(workdir))
  records = []
  try:
    setup(exp)
    loop.train_loop(exp, hooks=loop.LoopHooks(on_step=lambda step, m: records.append(m)))
    trainer = jax.device_get(exp.sync.policy(exp.state))
    return records, jax.device_get(exp.engine.params), trainer
  finally:
    exp.close()


def test_delta_sync_sends_only_changed_buckets_and_lands_the_same_weights(tmp_path):
  """optim.warmup_steps=1: step 0 trains at lr 0, so its sync finds nothing changed; from step 1 on the
  weights move (weight decay moves them even where a batch's advantages are all zero). The full run reshards on
  the rollout side (sync.route=destination; auto picks the source side for some leaves here): the same weights."""
  kw = {"optim.warmup_steps": 1, "optim.weight_decay": 0.1, "sync.bucket_mib": 64 / 1024}
  routes = {}
  full, full_w, _ = _train(_cfg(3, **kw, **{"sync.route": "destination"}), tmp_path / "full",
                           setup=lambda exp: routes.update(full={leaf.route for leaf in exp.sync.plan.leaves}))
  delta, delta_w, trainer = _train(_cfg(3, **{**kw, "sync.mode": "delta"}), tmp_path / "delta",
                                   setup=lambda exp: routes.update(delta={leaf.route for leaf in exp.sync.plan.leaves}))
  assert routes["full"] == {"destination"} and "source" in routes["delta"], routes
  assert [r["sync/changed_frac"] for r in full] == [1.0, 1.0, 1.0]
  assert delta[0]["sync/changed_frac"] == 0.0 and delta[0]["sync/bytes"] == 0.0
  assert 0.0 < delta[1]["sync/changed_frac"] <= 1.0 and delta[1]["sync/bytes"] > 0
  assert delta[1]["sync/bytes"] == delta[1]["sync/changed_frac"] * full[1]["sync/bytes"]
  for a, b in zip(full, delta, strict=True):  # the same weights landed: the same tokens, rewards, losses
    assert (a["reward_mean"], a["perf/tokens"], a["loss"]) == (b["reward_mean"], b["perf/tokens"], b["loss"])
  for got, want, t in zip(jax.tree.leaves(delta_w), jax.tree.leaves(full_w), jax.tree.leaves(trainer), strict=True):
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, t.astype(got.dtype))


def test_lora_sync_ships_adapters_only_and_merges_on_the_rollout_side(tmp_path):
  kw = {"lora.rank": 4, "lora.alpha": 8.0}
  records, rollout_w, trainer = _train(_cfg(2, **kw, **{"sync.mode": "lora"}), tmp_path / "lora")
  full, _, _ = _train(_cfg(1, **kw), tmp_path / "full")  # the same LoRA run shipping merged weights
  exp = experiment.build(_cfg(1, **kw, **{"sync.mode": "lora"}), str(tmp_path / "sizes"))
  try:
    n_adapter = sum(x.size for x in jax.tree.leaves(exp.state.params["policy"]))
  finally:
    exp.close()
  assert [r["sync/bytes"] for r in records] == [4.0 * n_adapter] * 2  # fp32 adapters, nothing else
  from jaxrl_topo.review.step_bytes import step_bytes

  assert records[0]["sync/bytes"] == step_bytes(_cfg(2, **kw, **{"sync.mode": "lora"})).sync_per_step  # the review's
  assert records[0]["sync/bytes"] < full[0]["sync/bytes"] / 10
  for got, want in zip(jax.tree.leaves(rollout_w), jax.tree.leaves(trainer), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # merged on the rollout devices
  assert records[0]["reward_mean"] == full[0]["reward_mean"]  # batch 0 is sampled from the same base weights


def _rollout_bytes(devices: set[int]) -> int:
  """Bytes of live arrays on `devices`, each buffer once."""
  buffers = {(s.device.id, s.data.unsafe_buffer_pointer()): s.data.nbytes for x in jax.live_arrays()
             for s in x.addressable_shards if s.device.id in devices}
  return sum(buffers.values())


def test_each_sync_frees_the_old_rollout_weights_bucket_by_bucket(tmp_path):
  """Extra rollout-device memory during the loop's syncs, measured at every bucket's peak: about one
  bucket; the same sync keeping the old weights (as the loop did before) grows by a whole copy."""
  bucket, rollout = 16 * KIB, {4, 5, 6, 7}
  extra: dict[str, list[int]] = {"loop": [], "kept": []}
  # Batch by batch: a continuous stream would decode (and hold a chunk's buffers) during the sync.
  exp = experiment.build(_cfg(2, **{"sync.bucket_mib": bucket / 2**20, "rollout.continuous": False}),
                         str(tmp_path / "run"))
  real = exp.sync
  full_copy = sum(s.data.nbytes for x in jax.tree.leaves(exp.engine.params) for s in x.addressable_shards)

  def measured(state, old, into="loop"):
    base = _rollout_bytes(rollout)
    real.on_bucket = lambda b: extra[into].append(_rollout_bytes(rollout) - base)
    try:
      return real(state, old)
    finally:
      real.on_bucket = None

  try:
    exp.sync = measured
    last = loop.train_loop(exp)
    assert "loss" in last and "_lags" not in last  # the loop's private per-token lags stay with on_step
    kept = measured(exp.state, None, "kept")  # noqa: F841  (held: the old weights stay next to the new copy)
  finally:
    exp.close()
  n_buckets = len(real.plan.buckets)
  assert n_buckets >= 16 and full_copy >= 16 * bucket, (n_buckets, full_copy)
  assert len(extra["loop"]) == 2 * n_buckets  # two syncs, every bucket measured
  assert max(extra["loop"]) <= 2 * bucket, extra["loop"]  # replicated over data=2: a bucket lands twice
  assert max(extra["kept"]) >= 0.9 * full_copy, (extra["kept"], full_copy)


def test_sync_config_is_validated():
  with pytest.raises(ValueError, match="sync.mode='fast'"):
    SyncSpec(mode="fast")
  with pytest.raises(ValueError, match="bucket_mib"):
    SyncSpec(bucket_mib=0)
  with pytest.raises(ValueError, match=r"sync.route='rollout'; expected one of \('auto', 'source'"):
    SyncSpec(route="rollout")
  with pytest.raises(ValueError, match="needs LoRA"):
    _cfg(**{"sync.mode": "lora"})
  c = load_config("grpo_task", "tiny")
  raw = c.to_dict()
  raw["sync"]["bucket_mb"] = 1
  with pytest.raises(ValueError, match="did you mean 'bucket_mib'"):
    from_config_dict(raw)
  assert _cfg(**{"sync.bucket_mib": 2}).sync.bucket_bytes == 2 * 2**20


def test_a_route_that_cannot_move_the_meshes_names_its_config_key():
  """4 trainer shards cannot be resharded on a 2-device rollout (route=destination): the error says sync.route."""
  from types import SimpleNamespace

  from jaxrl_topo.runtime.sync import WeightSync
  src = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
  dst = jax.sharding.Mesh(np.array(jax.devices()[4:6]), ("data",))
  w = jax.device_put(np.zeros((8, 4), np.float32), jax.sharding.NamedSharding(src, jax.sharding.PartitionSpec("fsdp")))
  state = SimpleNamespace(params={"policy": {"w": w}}, frozen=None)
  dst_sharding = {"w": jax.sharding.NamedSharding(dst, jax.sharding.PartitionSpec())}
  cfg = _cfg(**{"sync.route": "destination"})
  with pytest.raises(ValueError, match=r"^sync.route='destination': route='destination' cannot move 4 source shards"):
    WeightSync(cfg, state, dst_sharding, np.float32, dst)
  cfg = _cfg(**{"sync.route": "auto"})
  assert {leaf.route for leaf in WeightSync(cfg, state, dst_sharding, np.float32, dst).plan.leaves} == {"source"}


def test_a_route_that_changes_nothing_is_said(caplog):
  """Both sides on the same devices (colocated): every leaf is resharded in place, whatever sync.route says."""
  from types import SimpleNamespace

  from jaxrl_topo.runtime.sync import WeightSync
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
  w = jax.device_put(np.zeros((8, 4), np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
  state = SimpleNamespace(params={"policy": {"w": w}}, frozen=None)
  dst_sharding = {"w": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())}
  WeightSync(_cfg(**{"sync.route": "source"}), state, dst_sharding, np.float32, mesh)
  assert caplog.text.count("sync.route='source' changes nothing here") == 1 and "routes taken: local" in caplog.text
  caplog.clear()
  WeightSync(_cfg(), state, dst_sharding, np.float32, mesh)
  assert "sync.route" not in caplog.text


def test_delta_sync_while_an_update_waits_to_swap_reuses_the_pending_weights(tmp_path):
  """Found by a helper's review. In a continuous stream the next sync can come before the engine swapped in the
  last one. The plan compares against the weights it sent last (the pending ones) but reused the engine's
  current arrays for unchanged buckets, which the previous delta sync had deleted wherever they changed:
  'BlockHostUntilReady() called on deleted or donated buffer'. Here the cosine schedule reaches lr 0 at the last
  step, so its sync changes nothing after a sync that changed everything."""
  import dataclasses

  cfg = _cfg(3, **{"sync.mode": "delta", "sync.bucket_mib": 16 / 1024, "optim.weight_decay": 0.1,
                   "optim.lr": 1e-3, "optim.schedule": "cosine"})
  cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, total_steps=2))
  pending_at_sync = []

  def setup(exp):
    real = exp.engine.update_weights

    def spy(params, gen_id, policy="keep_kv"):
      pending_at_sync.append(exp.engine._pending is not None)
      return real(params, gen_id, policy)
    exp.engine.update_weights = spy

  records, rollout_w, trainer = _train(cfg, tmp_path, setup)
  assert any(pending_at_sync), "the stream should sync once with an update still pending"
  assert [r["sync/changed_frac"] for r in records][-2:] == [1.0, 0.0]
  for got, t in zip(jax.tree.leaves(rollout_w), jax.tree.leaves(trainer), strict=True):
    np.testing.assert_array_equal(got, t.astype(got.dtype))


def test_lora_sync_keeps_its_own_base_when_the_transfer_is_zero_copy(tmp_path):
  """Found by a helper's review. On the one-device colocated fp32 layout the frozen base's transfer is an alias:
  the rollout's base *was* the trainer's array, which the first train step donated, and the next sync failed
  with 'Buffer has been deleted or donated'. Two steps now run and the merged weights equal the trainer's."""
  c = load_config("grpo_task", "tiny", **{"run.steps": 2, "run.eval_every": 0, "run.tensorboard": False,
                                          "run.plot": False, "reward.n_workers": 0, "run.sft_steps": 0,
                                          "data.batch_size": 2, "rl.group_size": 4, "rollout.n_slots": 8,
                                          "run.checkpoint_every": 0, "lora.rank": 4, "lora.alpha": 8.0,
                                          "sync.mode": "lora", "optim.weight_decay": 0.1})
  cfg = from_config_dict(c)
  exp = experiment.build(cfg, str(tmp_path))
  try:
    assert {leaf.route for leaf in exp.sync.plan.leaves} == {"alias"}  # the layout the bug needs
  finally:
    exp.close()
  records, rollout_w, trainer = _train(cfg, tmp_path / "run")
  assert len(records) == 2
  for got, want in zip(jax.tree.leaves(rollout_w), jax.tree.leaves(trainer), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
