"""Weight sync (topology/transfer.py): exact values, layouts, byte counts, delta/LoRA modes, versions, memory.

Trainer: the tiny preset (82,304 params, fp32) on `fsdp=4` over devices 0-3 (TRAIN_RULES). Rollout:
`data=2 x tensor=2` (ROLLOUT_RULES, bf16), on devices 4-7 (disaggregated) or 0-3 (colocated).
"""

from __future__ import annotations

import dataclasses
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_topo.models.config import num_params
from jaxrl_topo.models.model import abstract_model, cast_params, param_shardings
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.topology.rules import ROLLOUT_RULES, TRAIN_RULES, make_mesh
from jaxrl_topo.topology.transfer import (
  TransferPlan,
  VersionedWeights,
  WeightSyncError,
  merge_on_destination,
  replicated,
  sync,
)
from jaxrl_topo.train.config import LoraConfig
from jaxrl_topo.train.lora import init_lora, merge_lora

CFG = get_preset("tiny")
KIB = 2**10


def trainer_params(mesh, seed=0):
  """Random fp32 params in the trainer layout (values are arbitrary: only their bits are compared)."""
  abstract = abstract_model(CFG)[1]
  rng = np.random.default_rng(seed)
  host = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), abstract.shapes)
  return jax.device_put(host, param_shardings(abstract, mesh, TRAIN_RULES))


@functools.cache
def trainer():
  """(mesh, params) of the trainer on fsdp=4; never freed by any test (plans only free destinations)."""
  mesh = make_mesh({"fsdp": 4}, jax.devices()[:4])
  return mesh, trainer_params(mesh)


def rollout_shardings(devices, axes=None):
  mesh = make_mesh(axes or {"data": 2, "tensor": 2}, devices)
  return param_shardings(abstract_model(CFG)[1], mesh, ROLLOUT_RULES)


def paths(tree) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def assert_synced(dst, src, shardings):
  """Every leaf equals the source cast to bf16 bit for bit, in exactly the destination layout."""
  for name, d, s, sh in zip(paths(src), jax.tree.leaves(dst), jax.tree.leaves(src), jax.tree.leaves(shardings),
                            strict=True):
    want = np.asarray(s).astype(jnp.bfloat16)
    assert d.dtype == jnp.bfloat16, name
    np.testing.assert_array_equal(np.asarray(d).view(np.uint16), want.view(np.uint16), err_msg=name)
    assert d.sharding.is_equivalent_to(sh, d.ndim), f"{name}: {d.sharding} is not {sh}"


@pytest.mark.parametrize("placement,route,routes", [
    ("disaggregated", "auto", {"destination", "source"}),  # source: the q/k norms, replicated on both sides
    ("disaggregated", "source", {"source"}),
    ("disaggregated", "destination", {"destination"}),
    ("disaggregated", "device_put", {"device_put"}),
    ("colocated", "auto", {"local"})])
def test_full_sync_is_exact_in_the_destination_layout(placement, route, routes):
  _, params = trainer()
  devices = jax.devices()[4:] if placement == "disaggregated" else jax.devices()[:4]
  dst_sh = rollout_shardings(devices)
  plan = TransferPlan.build(params, dst_sh, route=route)
  assert {leaf.route for leaf in plan.leaves} == routes
  dst, stats = plan.run(params)
  assert_synced(dst, params, dst_sh)
  assert stats["bytes_sent"] == plan.bytes_total and stats["buckets_sent"] == stats["buckets_total"] == 1
  dst2, _ = plan.run(params, dst)  # the second sync frees the first destination copy
  assert all(x.is_deleted() for x in jax.tree.leaves(dst))
  assert_synced(dst2, params, dst_sh)


@pytest.mark.parametrize("src_devices,dst_devices", [(8, 4), (2, 4)])
def test_unequal_device_counts_copy_whole_shards(src_devices, dst_devices):
  """8 -> 4 devices: the destination layout is built on the source with 2 copies per shard; 2 -> 4: the reverse."""
  devices = jax.devices()
  mesh = make_mesh({"fsdp": src_devices}, devices[:src_devices])
  params = trainer_params(mesh, seed=1)
  dst_sh = rollout_shardings(devices[8 - dst_devices:], {"data": dst_devices // 2, "tensor": 2})
  plan = TransferPlan.build(params, dst_sh)
  kernel = plan.leaves[paths(params).index("['layers'][0]['mlp']['up_proj']['kernel']")]
  assert kernel.route == ("source" if src_devices > dst_devices else "destination")
  assert_synced(plan.run(params)[0], params, dst_sh)


def test_colocated_identical_layout_is_zero_copy():
  """bf16 trainer params on the same shardings (one spelled differently): the destination IS the source."""
  mesh, params = trainer()
  src = jax.jit(functools.partial(cast_params, dtype=jnp.bfloat16), out_shardings=jax.tree.map(
      lambda x: x.sharding, params))(params)
  dst_sh = jax.tree.map(lambda x: x.sharding, src)
  dst_sh["embed_tokens"] = NamedSharding(mesh, P(None, "fsdp", *()))  # same layout as P(None, 'fsdp')
  plan = TransferPlan.build(src, dst_sh)
  assert {leaf.route for leaf in plan.leaves} == {"alias"} and plan.bytes_total == 0 and not plan.buckets
  dst, stats = plan.run(src)
  assert all(d is s for d, s in zip(jax.tree.leaves(dst), jax.tree.leaves(src), strict=True))
  emb_d, emb_s = dst["embed_tokens"].addressable_shards, src["embed_tokens"].addressable_shards
  assert [x.data.unsafe_buffer_pointer() for x in emb_d] == [x.data.unsafe_buffer_pointer() for x in emb_s]
  assert stats["bytes_sent"] == 0
  plan.run(src, dst)  # a second sync must not free aliased arrays: they are the trainer's
  assert not any(x.is_deleted() for x in jax.tree.leaves(src))


def test_byte_accounting_matches_hand_count():
  """Tiny, bf16, rollout data=2 x tensor=2 (tensor splits vocab/heads/kv_heads/mlp; norms replicated).

  Elements each device holds: embed 128x64/2 = 4096; per layer q 64*4*16/2 = 2048, k = v = 64*2*16/2
  = 1024, o 2048, gate = up = down = 64*128/2 = 4096, norms 64 + 64 + 16 + 16 = 160 (replicated):
  18,592; two layers + embed + final norm 64 = 41,344 elements = 82,688 bytes on each of 4 devices.
  Total (each element once): 82,304 params x 2 bytes = 164,608.
  """
  _, params = trainer()
  dst_sh = rollout_shardings(jax.devices()[4:])
  plan = TransferPlan.build(params, dst_sh)
  assert plan.bytes_total == num_params(CFG) * 2 == 164_608
  assert plan.bytes_per_device == {4: 82_688, 5: 82_688, 6: 82_688, 7: 82_688}
  # "destination" ships the trainer layout (each element once) except q/k norms, replicated on the
  # trainer and tied between routes (16 x 2 bytes to each of 4 devices: 3 extra copies x 4 norms).
  assert plan.bytes_shipped == 164_608 + 4 * 3 * 32
  for name, want in [("embed_tokens", 8192), ("norm", 128)]:
    one = TransferPlan.build({name: params[name]}, {name: dst_sh[name]})
    assert one.bytes_per_device == dict.fromkeys(range(4, 8), want), name
  q = params["layers"][0]["self_attn"]["q_proj"]["kernel"]
  one = TransferPlan.build([q], [dst_sh["layers"][0]["self_attn"]["q_proj"]["kernel"]])
  assert one.bytes_per_device == dict.fromkeys(range(4, 8), 4096) and one.bytes_total == 8192
  assert "bytes_total=164,608" in plan.describe() and "max_per_device=82,688" in plan.describe()


def _leaf_bucket(plan, params, name):
  i = paths(params).index(name)
  return next(b for b, bucket in enumerate(plan.buckets) if i in bucket.leaves)


def _with_up_proj(params, kernel):
  """The params with layer 1's up_proj kernel replaced (new containers, other arrays shared)."""
  out = jax.tree.map(lambda x: x, params)
  out["layers"][1]["mlp"]["up_proj"]["kernel"] = kernel
  return out


def test_delta_sends_only_changed_buckets():
  _, params = trainer()
  w = params["layers"][1]["mlp"]["up_proj"]["kernel"]
  params = _with_up_proj(params, w.astype(jnp.bfloat16).astype(jnp.float32))  # exactly representable in bf16
  dst_sh = rollout_shardings(jax.devices()[4:])
  plan = TransferPlan.build(params, dst_sh, mode="delta", bucket_bytes=48 * KIB)
  assert len(plan.buckets) == 4
  dst, stats = plan.run(params)
  assert stats["buckets_sent"] == 4 and stats["changed_frac"] == 1.0  # first sync: everything
  same, stats = plan.run(params, dst)
  assert stats["buckets_sent"] == 0 and stats["changed_frac"] == 0.0
  assert all(a is b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(dst), strict=True))

  # One fp32 ulp towards zero is far below half a bf16 ulp: every bf16 value, hence every bucket, is unchanged.
  nudged = _with_up_proj(params, jnp.nextafter(params["layers"][1]["mlp"]["up_proj"]["kernel"], 0.0))
  _, stats = plan.run(nudged, same)
  assert stats["buckets_sent"] == 0, "fp32 changes that round to the same bf16 values must not be sent"

  changed = _with_up_proj(params, w + 0.5)
  b = _leaf_bucket(plan, params, "['layers'][1]['mlp']['up_proj']['kernel']")
  new, stats = plan.run(changed, same)
  assert stats["buckets_sent"] == 1 and stats["bytes_sent"] == plan.buckets[b].nbytes
  assert stats["changed_frac"] == plan.buckets[b].nbytes / plan.bytes_total
  assert_synced(new, changed, dst_sh)
  moved = set(plan.buckets[b].leaves)
  for i, (x, y) in enumerate(zip(jax.tree.leaves(new), jax.tree.leaves(same), strict=True)):
    assert (x is y) == (i not in moved)


def test_plan_never_retraces():
  """Everything is compiled at build time; runs (full or delta, changed or not) add no trace."""
  _, params = trainer()
  plan = TransferPlan.build(params, rollout_shardings(jax.devices()[4:]), mode="delta", bucket_bytes=48 * KIB)
  n_post = sum(bucket.post is not None for bucket in plan.buckets)
  assert plan.n_traces == 2 * len(plan.buckets) + n_post  # cast + compare per bucket, + reshard on dst
  traces = plan.n_traces
  dst, _ = plan.run(params)
  dst, _ = plan.run(params, dst)
  dst, _ = plan.run(jax.tree.map(lambda x: x + 1, params), dst)
  assert plan.n_traces == traces


def test_identical_buckets_share_executables():
  """One leaf per bucket: buckets with the same shapes and layouts share compiled functions.

  Distinct signatures among the 24 leaves: embed_tokens = down_proj ([128, 64], fsdp on dim 1 -> tensor on
  dim 0), gate = up, k = v, q, o, the 64-wide norms (4 in layers + final), the 16-wide q/k norms: 7.
  """
  _, params = trainer()
  plan = TransferPlan.build(params, rollout_shardings(jax.devices()[4:]), bucket_bytes=1)
  assert len(plan.buckets) == 24
  by_name = dict(zip(paths(params), plan.buckets, strict=True))
  q0, q1 = (by_name[f"['layers'][{i}]['self_attn']['q_proj']['kernel']"] for i in (0, 1))
  assert q0.cast is q1.cast and q0.post is q1.post and q0.leaves != q1.leaves
  distinct = {id(b.cast): b for b in plan.buckets}.values()
  assert len(distinct) == 7 and plan.n_traces == sum(1 + (b.post is not None) for b in distinct)
  assert_synced(plan.run(params)[0], params, rollout_shardings(jax.devices()[4:]))


def _device_bytes() -> int:
  """Bytes held on devices by live arrays, each buffer once (shard views share their parent's buffers)."""
  buffers = {(s.device.id, s.data.unsafe_buffer_pointer()): s.data.nbytes
             for x in jax.live_arrays() for s in x.addressable_shards}
  return sum(buffers.values())


def test_peak_memory_stays_near_one_bucket():
  """Extra device memory over (source + old destination), measured at each bucket's peak."""
  _, params = trainer()
  dst_sh = rollout_shardings(jax.devices()[4:])
  bucket = 16 * KIB
  plan = TransferPlan.build(params, dst_sh, bucket_bytes=bucket)
  full_copy = sum(plan.bytes_per_device.values())  # 330,752: bf16, replicated over data=2

  def extra_during(dst):
    gc.collect()
    base, extra = _device_bytes(), []
    new, _ = plan.run(params, dst, on_bucket=lambda b: extra.append(_device_bytes() - base))
    return new, extra

  dst, _ = plan.run(params)
  dst, extra = extra_during(dst)
  assert len(extra) == len(plan.buckets) == 12
  assert max(extra) <= 2 * bucket < full_copy / 8, extra  # measured: 16,384 = one bucket, its source-side cast
  kept = dst  # without freeing first, the new copy grows next to the old one
  _, extra = extra_during(None)
  assert extra[-1] >= full_copy, extra
  del kept


def test_lora_mode_sends_adapters_and_merges_on_destination():
  mesh, params = trainer()
  lcfg = LoraConfig(rank=4, alpha=8.0)
  adapters = init_lora(params, lcfg, jax.random.key(2))
  adapters = {k: {"a": v["a"], "b": jax.random.normal(jax.random.key(3), v["b"].shape) * 0.1}
              for k, v in adapters.items()}
  adapters = jax.device_put(adapters, replicated(adapters, mesh))
  rollout_mesh = make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:])
  dst_sh = rollout_shardings(jax.devices()[4:])
  base, _ = TransferPlan.build(params, dst_sh).run(params)
  plan = TransferPlan.build(adapters, replicated(adapters, rollout_mesh), mode="lora")
  n_adapter = sum(x.size for x in jax.tree.leaves(adapters))
  assert plan.bytes_total == 4 * n_adapter  # fp32 kept
  adapters_dst, stats = plan.run(adapters)
  assert stats["bytes_sent"] == plan.bytes_total and jax.tree.leaves(adapters_dst)[0].dtype == jnp.float32

  merged = merge_on_destination(base, adapters_dst, lcfg)
  host = jax.tree.map(lambda x: np.asarray(x).astype(np.float32), base)
  want = merge_lora(host, jax.tree.map(np.asarray, adapters), lcfg)
  for name, m, w, b, sh in zip(paths(base), jax.tree.leaves(merged), jax.tree.leaves(want), jax.tree.leaves(base),
                               jax.tree.leaves(dst_sh), strict=True):
    assert m.dtype == jnp.bfloat16 and m.sharding.is_equivalent_to(sh, m.ndim), name
    np.testing.assert_allclose(np.asarray(m, np.float32), np.asarray(w, np.float32), rtol=2**-7, atol=1e-6,
                               err_msg=name)
    assert not b.is_deleted(), "the base copy stays for the next merge"
  q = "layers.0.self_attn.q_proj"
  assert not np.array_equal(np.asarray(merged["layers"][0]["self_attn"]["q_proj"]["kernel"]),
                            np.asarray(base["layers"][0]["self_attn"]["q_proj"]["kernel"])), q
  with pytest.raises(ValueError, match="LoRA adapter dict"):
    TransferPlan.build(params, dst_sh, mode="lora")


def test_versions_increase_and_a_failed_sync_invalidates():
  _, params = trainer()
  plan = TransferPlan.build(params, rollout_shardings(jax.devices()[4:]), bucket_bytes=48 * KIB)
  v0 = sync(plan, params, VersionedWeights(params=None, gen_id=-1), new_gen_id=0)
  v1 = sync(plan, params, v0, new_gen_id=1)
  assert (v1.gen_id, v0.params) == (1, None) and v1.stats["buckets_sent"] == 4
  for bad in (1, 0):
    with pytest.raises(ValueError, match="gen_id must increase"):
      sync(plan, params, v1, new_gen_id=bad)
  with pytest.raises(ValueError, match="does not match the plan"):
    sync(plan, {"embed_tokens": params["embed_tokens"]}, v1, new_gen_id=2)
  assert v1.params is not None, "bad input is refused before anything is freed"

  def boom(xs):
    raise RuntimeError("link down")

  good = plan.buckets[2]
  plan.buckets[2] = dataclasses.replace(good, cast=boom)
  with pytest.raises(WeightSyncError, match="gen_id 2 failed") as err:
    sync(plan, params, v1, new_gen_id=2)
  assert isinstance(err.value.__cause__, RuntimeError) and v1.params is None
  plan.buckets[2] = good
  v3 = sync(plan, params, v1, new_gen_id=3)  # recovers with a full send
  assert_synced(v3.params, params, rollout_shardings(jax.devices()[4:]))


def test_bad_plans_are_refused():
  _, params = trainer()
  dst_sh = rollout_shardings(jax.devices()[4:])
  with pytest.raises(ValueError, match="do not match the source tree"):
    TransferPlan.build(params, {"embed_tokens": dst_sh["embed_tokens"]})
  with pytest.raises(ValueError, match="mode="):
    TransferPlan.build(params, dst_sh, mode="partial")
  eight = rollout_shardings(jax.devices(), {"data": 4, "tensor": 2})
  with pytest.raises(ValueError, match="route='source' cannot move 4 source shards to 8 devices"):
    TransferPlan.build(params, eight, route="source")
  plan = TransferPlan.build(params, dst_sh)
  wrong = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(s.mesh, P()), dst_sh))
  with pytest.raises(ValueError, match="differs from the plan"):
    plan.run(wrong)
