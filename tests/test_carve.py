"""Carving devices into per-role meshes: modes, validation, host-aware placement, model fit, sharding table.

Nothing here compiles; ~2 s on CPU. Meshes use the 8 fake CPU devices of conftest (one host);
multi-host placement is tested on fake device objects through the pure `place` function.
"""

import dataclasses
import itertools
import logging

import jax
import ml_collections
import pytest
from jax.sharding import AxisType, PartitionSpec

from jaxrl_topo.models.model import abstract_model
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.topology.carve import (
  Topology,
  TopologyConfig,
  carve,
  check_model_fits,
  log_sharding_table,
  place,
  sharding_table,
)
from jaxrl_topo.topology.rules import ROLLOUT_RULES, TRAIN_RULES

FSDP4_TP2 = (("fsdp", 4), ("tensor", 2))


def _ids(mesh):
  return [d.id for d in mesh.devices.flat]


def _cfg(**kw):
  return TopologyConfig(**{"mode": "disaggregated", "trainer_axes": (("fsdp", 4),),
                           "rollout_axes": (("data", 2), ("tensor", 2)), **kw})


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  process_index: int


def _hosts(n_hosts, per_host, interleaved=False):
  """Fake devices; interleaved puts even ids on host 0 and odd ids on host 1 (ids not grouped by host)."""
  return [FakeDevice(i, i % n_hosts if interleaved else i // per_host) for i in range(n_hosts * per_host)]


def _place_ids(devices, sizes):
  return [[d.id for d in group] for group in place(devices, sizes)]


# --- the three modes on the 8 fake devices -------------------------------------------------------


def test_colocated_meshes_share_all_devices_with_their_own_axes():
  topo = carve(TopologyConfig(mode="colocated", trainer_axes=FSDP4_TP2, rollout_axes=(("data", 4), ("tensor", 2))))
  assert _ids(topo.trainer) == _ids(topo.rollout) == list(range(8))
  assert dict(topo.trainer.shape) == {"fsdp": 4, "tensor": 2}
  assert dict(topo.rollout.shape) == {"data": 4, "tensor": 2}
  assert topo.trainer.axis_types == (AxisType.Auto, AxisType.Auto)
  assert topo.colocated and topo.same_devices and topo.reward is None
  assert [[d.id for d in row] for row in topo.trainer.devices] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # tensor innermost


def test_colocated_reward_model_gets_its_own_devices():
  cfg = TopologyConfig(mode="colocated", trainer_axes=(("fsdp", 2), ("tensor", 2)),
                       rollout_axes=(("data", 2), ("tensor", 2)), reward_devices=2)
  topo = carve(cfg)
  assert _ids(topo.trainer) == _ids(topo.rollout) == [0, 1, 2, 3]
  assert _ids(topo.reward) == [4, 5] and dict(topo.reward.shape) == {"data": 2}


def test_disaggregated_meshes_are_disjoint():
  topo = carve(_cfg())
  assert _ids(topo.trainer) == [0, 1, 2, 3] and _ids(topo.rollout) == [4, 5, 6, 7]
  assert dict(topo.trainer.shape) == {"fsdp": 4} and dict(topo.rollout.shape) == {"data": 2, "tensor": 2}
  assert not topo.colocated and not topo.same_devices


def test_async_with_reward_model_uses_three_disjoint_sets():
  topo = carve(_cfg(mode="async", rollout_axes=(("tensor", 2),), reward_devices=2))
  assert (_ids(topo.trainer), _ids(topo.rollout), _ids(topo.reward)) == ([0, 1, 2, 3], [4, 5], [6, 7])
  assert topo.mode == "async" and not topo.same_devices


def test_axes_are_stored_in_canonical_order_tensor_innermost():
  cfg = TopologyConfig(mode="colocated", trainer_axes=(("tensor", 2), ("fsdp", 4)),
                       rollout_axes=(("tensor", 2), ("data", 4)))
  assert cfg.trainer_axes == FSDP4_TP2 and cfg.rollout_axes == (("data", 4), ("tensor", 2))
  assert carve(cfg).trainer.axis_names == ("fsdp", "tensor")


# --- roles -> pools -> meshes and rule sets ------------------------------------------------------


def test_roles_map_to_their_pool_meshes_and_rule_sets():
  topo = carve(_cfg(rollout_axes=(("tensor", 2),), reward_devices=2))
  for role in ("actor", "reference", "critic"):
    assert topo.mesh_for(role) is topo.trainer and topo.rules_for(role) is TRAIN_RULES
  assert topo.mesh_for("rollout") is topo.rollout and topo.rules_for("rollout") is ROLLOUT_RULES
  assert topo.mesh_for("reward") is topo.reward and topo.rules_for("reward") is ROLLOUT_RULES


def test_without_reward_devices_there_is_no_reward_role_unless_mapped():
  assert dict(_cfg().roles) == {"actor": "trainer", "reference": "trainer", "critic": "trainer", "rollout": "rollout"}
  with pytest.raises(ValueError, match="role 'reward' has no device pool"):
    carve(_cfg()).mesh_for("reward")
  topo = carve(_cfg(roles=(("reward", "rollout"), ("reference", "rollout"))))  # overrides, merged on defaults
  assert topo.mesh_for("reward") is topo.rollout and topo.mesh_for("reference") is topo.rollout
  assert topo.rules_for("reference") is ROLLOUT_RULES and topo.mesh_for("actor") is topo.trainer


def test_topology_without_reward_mesh_names_the_problem():
  topo = carve(_cfg())
  bare = Topology(mode="disaggregated", trainer=topo.trainer, rollout=topo.rollout)  # default roles include reward
  with pytest.raises(ValueError, match="role 'reward' is on the 'reward' pool but this topology has no reward mesh"):
    bare.mesh_for("reward")


# --- validation: every message names the field ---------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    ({"mode": "colocate"}, r"TopologyConfig.mode='colocate'; did you mean 'colocated'\?"),
    ({"rollout_axes": (("fsdp", 4),)}, r"rollout_axes has axis 'fsdp': .*all-gather every weight"),
    ({"trainer_axes": (("fdsp", 4),)}, r"trainer_axes has unknown axis 'fdsp'; did you mean 'fsdp'\?"),
    ({"rollout_axes": (("pipe", 4),)}, r"rollout_axes has unknown axis 'pipe'; expected one of \['data', 'tensor'\]"),
    ({"trainer_axes": (("fsdp", 0),)}, r"trainer_axes: axis 'fsdp' has size 0; sizes must be positive ints"),
    ({"trainer_axes": (("fsdp", "4"),)}, r"trainer_axes: axis 'fsdp' has size '4'"),
    ({"trainer_axes": (("fsdp", True),)}, r"trainer_axes: axis 'fsdp' has size True"),
    ({"trainer_axes": (("fsdp", 2), ("fsdp", 2))}, r"trainer_axes names an axis twice: \['fsdp', 'fsdp'\]"),
    ({"trainer_axes": ()}, r"trainer_axes is empty"),
    ({"trainer_axes": (("fsdp",),)}, r"trainer_axes=\(\('fsdp',\),\) must be \(axis, size\) pairs"),
    ({"reward_devices": -1}, r"reward_devices=-1 must be an int >= 0"),
    ({"mode": "colocated", "rollout_axes": (("tensor", 2),)},  # 4 trainer devices cannot time-share with 2
     r"colocated mode time-shares one device set, but trainer_axes use 4 devices and rollout_axes 2"),
    ({"roles": (("reward", "reward"),)}, r"roles maps 'reward' to the 'reward' pool but reward_devices=0"),
    ({"roles": (("actr", "trainer"),)}, r"roles: unknown role 'actr'; did you mean 'actor'\?"),
    ({"roles": (("rollout", "rollouts"),)}, r"role 'rollout' has unknown pool 'rollouts'; did you mean 'rollout'\?"),
])
def test_config_errors_name_the_field(kw, match):
  with pytest.raises(ValueError, match=match):
    _cfg(**kw)


@pytest.mark.parametrize("kw, match", [
    ({"trainer_axes": (("fsdp", 8),), "rollout_axes": (("data", 4),)},
     r"disaggregated topology needs 12 devices: trainer 8 \+ rollout 4; only 8 exist"),
    ({"mode": "colocated", "trainer_axes": (("fsdp", 8),), "rollout_axes": (("data", 8),), "reward_devices": 2},
     r"colocated topology needs 10 devices: trainer and rollout 8 \(shared\) \+ reward 2; only 8 exist"),
    ({"mode": "async", "reward_devices": 1}, r"async topology needs 9 devices: trainer 4 \+ rollout 4 \+ reward 1"),
])
def test_carve_rejects_too_few_devices(kw, match):
  with pytest.raises(ValueError, match=match):
    carve(_cfg(**kw))


def test_carve_rejects_repeated_devices():
  devices = jax.devices()
  with pytest.raises(ValueError, match=r"repeated ids \[0\]"):
    carve(_cfg(), devices=[devices[0]] + devices[:7])


# --- from_dict: the ConfigDict boundary ----------------------------------------------------------


def test_from_dict_accepts_plain_and_config_dicts():
  d = {"mode": "async", "trainer": {"tensor": 2, "fsdp": 2}, "rollout": {"data": 2}, "reward_devices": 2,
       "roles": {"reference": "rollout"}}
  for source in (d, ml_collections.ConfigDict(d)):
    cfg = TopologyConfig.from_dict(source)
    assert cfg.trainer_axes == (("fsdp", 2), ("tensor", 2)) and cfg.rollout_axes == (("data", 2),)
    assert cfg.reward_devices == 2 and dict(cfg.roles)["reference"] == "rollout"
    assert dict(cfg.roles)["reward"] == "reward"


@pytest.mark.parametrize("d, match", [
    ({"mode": "async", "trainr": {"fsdp": 4}, "rollout": {"data": 4}},
     r"unknown key 'trainr'; did you mean 'trainer'\?"),
    ({"mode": "async", "trainer": {"fsdp": 4}, "rollout": {"data": 4}, "reward_device": 1},
     r"unknown key 'reward_device'; did you mean 'reward_devices'\?"),
    ({"mode": "async", "rollout": {"data": 4}}, r"missing required keys \['trainer'\]"),
    ({"mode": "async", "trainer": 4, "rollout": {"data": 4}}, r"trainer must be a dict, got int"),
    ({"mode": "async", "trainer": {"fsdp": 4}, "rollout": {"dat": 4}}, r"unknown axis 'dat'; did you mean 'data'\?"),
    ({"mode": "async", "trainer": {"fsdp": 4}, "rollout": {"data": 4}, "roles": {"critc": "trainer"}},
     r"unknown role 'critc'; did you mean 'critic'\?"),
])
def test_from_dict_typos_suggest_the_key(d, match):
  with pytest.raises(ValueError, match=match):
    TopologyConfig.from_dict(d)


# --- host-aware placement (fake multi-host layouts) ----------------------------------------------


def test_placement_keeps_a_one_host_side_on_one_host():
  # 2 hosts x 4. Naive first-n: trainer [0,1], rollout [2,3,4,5] straddles both hosts.
  assert _place_ids(_hosts(2, 4), [2, 4, 2]) == [[0, 1], [4, 5, 6, 7], [2, 3]]
  # 4 hosts x 2. Naive: rollout [1,2,3,4] over three hosts; placed: two whole hosts.
  assert _place_ids(_hosts(4, 2), [1, 4, 1]) == [[0], [2, 3, 4, 5], [1]]
  # 4 hosts x 4, trainer of 8 = two whole hosts, then 2 + 4 + 2 without a straddle.
  assert _place_ids(_hosts(4, 4), [2, 8, 4]) == [[0, 1], [4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]


def test_placement_groups_by_process_index_not_by_id():
  # ids interleave across 2 hosts (host 0 = even ids); naive first-4 = [0,1,2,3] would span both.
  assert _place_ids(_hosts(2, 4, interleaved=True), [4, 4]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
  shuffled = list(reversed(_hosts(2, 4)))  # input order does not matter: sorted by (process_index, id)
  assert _place_ids(shuffled, [4, 4]) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_placement_spills_only_when_no_host_can_hold_a_side():
  # 2 hosts x 4, sides 3 + 3 + 2: the last side cannot fit one host (1 free on each), so it spills.
  assert _place_ids(_hosts(2, 4), [3, 3, 2]) == [[0, 1, 2], [4, 5, 6], [3, 7]]
  assert _place_ids(_hosts(2, 4), [6, 2]) == [[0, 1, 2, 3, 4, 5], [6, 7]]  # one whole host + 2 best-fit
  with pytest.raises(ValueError, match=r"placement needs 9 devices \(\[4, 5\]\); only 8 exist"):
    place(_hosts(2, 4), [4, 5])


def _straddle(groups, per_host):
  """Hosts used beyond the minimum, summed over sides: 0 means no side crosses a host it need not."""
  return sum(len({d.process_index for d in g}) - -(-len(g) // per_host) for g in groups)


@pytest.mark.parametrize("n_hosts, per_host", [(2, 4), (4, 2), (3, 4), (3, 3)])
def test_placement_straddles_no_more_than_the_best_split(n_hosts, per_host):
  """Exhaustive: every split of every host's devices among three sides, vs what `place` picks."""
  shares = [c for c in itertools.product(range(per_host + 1), repeat=3) if sum(c) <= per_host]
  best: dict[tuple[int, ...], int] = {}
  for split in itertools.product(shares, repeat=n_hosts):  # split[h][k]: host h's devices given to side k
    sizes = tuple(sum(host[k] for host in split) for k in range(3))
    cost = sum(sum(1 for host in split if host[k]) - -(-sizes[k] // per_host) for k in range(3))
    best[sizes] = min(best.get(sizes, cost), cost)
  for sizes, cost in best.items():
    assert _straddle(place(_hosts(n_hosts, per_host), sizes), per_host) == cost, sizes


# --- the model must shard on every role's mesh ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_abstract():
  return abstract_model(get_preset("tiny"))[1]  # N=4 heads, K=2 kv heads, H=16, D=64, F=128, V=128, fp32


def test_check_model_fits_names_role_tensor_and_axes(tiny_abstract):
  topo = carve(_cfg(mode="colocated", trainer_axes=(("fsdp", 8),), rollout_axes=(("tensor", 8),)))
  with pytest.raises(ValueError, match=r"role 'rollout' \(rollout mesh \{'tensor': 8\}\): .*self_attn.*kernel.*"
                                       r"\(heads=4\) does not divide over mesh axes tensor \(8 ways\)"):
    check_model_fits(topo, tiny_abstract)  # tiny's 4 query heads cannot split 8 ways
  check_model_fits(topo, tiny_abstract, roles=("actor",))  # the trainer side (fsdp=8) is fine


def test_kv_heads_fewer_than_the_tensor_axis_are_replicated_not_refused(tiny_abstract):
  """tiny's 2 KV heads at tensor=4 (as Qwen2.5-0.5B's at tensor=4): the KV projections are replicated over
  `tensor` (before: refused, so the loop could not reach the engine's KV-head replication); query heads split."""
  out = check_model_fits(carve(_cfg(rollout_axes=(("tensor", 4),))), tiny_abstract)
  attn = out["rollout"]["layers"][0]["self_attn"]
  for proj in ("k_proj", "v_proj"):
    assert attn[proj]["kernel"].spec == PartitionSpec(None, None, None)
  assert attn["q_proj"]["kernel"].spec == PartitionSpec(None, "tensor", None)


def test_check_model_fits_returns_shardings_per_role(tiny_abstract):
  topo = carve(_cfg())
  out = check_model_fits(topo, tiny_abstract)
  assert set(out) == {"actor", "rollout"}
  q_actor = out["actor"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
  q_rollout = out["rollout"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
  assert q_actor.mesh is topo.trainer and q_actor.spec == PartitionSpec("fsdp", None, None)
  assert q_rollout.mesh is topo.rollout and q_rollout.spec == PartitionSpec(None, "tensor", None)


def _rows(table):
  return {line.split()[0]: line.split()[1:] for line in table.splitlines()}


def test_sharding_table_for_tiny(tiny_abstract, caplog):
  """Bytes per device, fp32 (4 bytes), worked by hand.

  actor, fsdp=4 x tensor=2 (embed/4; heads, kv_heads, mlp, vocab /2; head_dim whole):
    embed_tokens 128x64 -> 64x16 = 1024; final norm 64 -> 16
    per layer: 3 MLP kernels 64x128 -> 16x64 = 3 * 1024; q_proj and o_proj 64*4*16 -> 512 each;
      k_proj and v_proj 64*2*16 -> 256 each; 2 layer norms 16 each; q/k norms 16 each -> 4672
    total (1024 + 2 * 4672 + 16) * 4 = 10384 * 4 = 41,536 bytes
  rollout, data=4 x tensor=2 (embed whole, so only tensor divides):
    embed_tokens 128x64 -> 64x64 = 4096; final norm 64
    per layer: 3 * 64*64 = 12288; q/o 2048 each; k/v 1024 each; layer norms 64 each; q/k norms 16 each -> 18592
    total (4096 + 2 * 18592 + 64) * 4 = 41344 * 4 = 165,376 bytes
  """
  topo = carve(TopologyConfig(mode="colocated", trainer_axes=FSDP4_TP2, rollout_axes=(("data", 4), ("tensor", 2))))
  table = sharding_table(tiny_abstract, topo, ("actor", "rollout"))
  rows = _rows(table)
  assert rows["param"] == ["shape", "actor", "spec", "actor", "shard", "rollout", "spec", "rollout", "shard"]
  assert rows["layers.0.self_attn.q_proj.kernel"] == [
      "64x4x16", "P(fsdp,tensor,None)", "16x2x16", "P(None,tensor,None)", "64x2x16"]
  assert rows["embed_tokens"] == ["128x64", "P(tensor,fsdp)", "64x16", "P(tensor,None)", "64x64"]
  assert rows["layers.1.self_attn.k_norm.weight"] == ["16", "P(None)", "16", "P(None)", "16"]
  assert len([r for r in rows if r.startswith(("layers.", "embed_tokens", "norm."))]) == 24
  lines = table.splitlines()
  assert lines[-2] == ("actor: 41,536 bytes per device (0.04 MiB, params float32) on the trainer mesh "
                       "{'fsdp': 4, 'tensor': 2}")
  assert lines[-1] == ("rollout: 165,376 bytes per device (0.16 MiB, params float32) on the rollout mesh "
                       "{'data': 4, 'tensor': 2}")
  with caplog.at_level(logging.INFO):
    assert log_sharding_table(tiny_abstract, topo) == table
  assert "colocated topology, parameter shardings" in caplog.text and "41,536 bytes" in caplog.text
