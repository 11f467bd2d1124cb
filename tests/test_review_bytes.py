"""review/bytes.py: the bytes-per-step model, by hand and against TransferPlan's live accounting.

Hand-worked figures use 1 GB = 1e9 bytes. The tiny preset (82,304 params; D=64, 2 layers, N=4, K=2, H=16, F=128,
V=128 tied) is checked against `num_params`, `init_lora` and TransferPlans built on the 8 fake CPU devices: if a
prediction and a plan disagree, either the model's sharding/aliasing rule or the plan's accounting changed.
"""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from jaxrl_topo.models.config import num_params, to_hf_dict
from jaxrl_topo.models.model import abstract_model, param_shardings
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.review import bytes as rb
from jaxrl_topo.review import step_bytes as sb_lib
from jaxrl_topo.runtime.config import from_config_dict
from jaxrl_topo.topology.carve import TopologyConfig, carve
from jaxrl_topo.topology.rules import ROLLOUT_RULES, TRAIN_RULES
from jaxrl_topo.topology.transfer import TransferPlan, replicated
from jaxrl_topo.train.config import LoraConfig
from jaxrl_topo.train.lora import init_lora

TINY = get_preset("tiny")
QWEN7 = get_preset("qwen2.5-7b")
GB = 1e9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_14e9_policy_by_hand():
  n = 14e9
  assert rb.sync_bytes(n, dtype="bfloat16") == pytest.approx(28 * GB)  # 14e9 x 2 bytes
  assert rb.sync_bytes(n, mode="delta", changed_frac=0.02) == pytest.approx(0.56 * GB)  # 2% of 28 GB
  assert rb.sync_bytes(n, mode="lora", n_adapter_params=0.005 * n) == pytest.approx(0.14 * GB)  # 70e6 x 2 bytes
  assert rb.ring_all_reduce(28 * GB, 8) == pytest.approx(49 * GB)  # 2 x 7/8 x 28 GB per rank
  # FSDP at N=4 with fp32 weights and grads (W = G = 56 GB): 2 x 3/4 x 56 (gathers) + 3/4 x 56 (reduce-scatter).
  w = rb.sync_bytes(n, dtype="float32")
  assert 2 * rb.ring_all_gather(w, 4) + rb.ring_reduce_scatter(w, 4) == pytest.approx(126 * GB)


def test_tiny_counts_match_num_params_and_init_lora():
  assert sum(leaf.size for leaf in rb.param_leaves(TINY)) == num_params(TINY) == 82_304
  assert rb.weight_sync_bytes(TINY, dtype="float32") == 4 * 82_304
  # Rank 4 on all seven projections, r x (in + out) per layer: q 4(64+64)=512, k = v = 4(64+32)=384,
  # o 4(4*16+64)=512, gate = up = down = 4(64+128)=768: 4,096 per layer, 8,192 for two layers.
  assert rb.lora_adapter_params(TINY, 4, LoraConfig().targets) == 8_192
  lcfg = LoraConfig(rank=4)
  adapters = jax.eval_shape(lambda p: init_lora(p, lcfg, jax.random.key(0)), abstract_model(TINY)[1].shapes)
  assert sum(x.size for x in jax.tree.leaves(adapters)) == 8_192
  assert rb.weight_sync_bytes(TINY, mode="lora", lora_rank=4) == 2 * 8_192


def _plan(topo_cfg: TopologyConfig, dst_dtype: str) -> TransferPlan:
  topo = carve(topo_cfg, jax.devices()[: topo_cfg.trainer_size + (0 if topo_cfg.colocated else
                                                                   topo_cfg.rollout_size)])
  abstract = abstract_model(TINY)[1]
  src = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract.shapes,
                     param_shardings(abstract, topo.trainer, TRAIN_RULES))
  return TransferPlan.build(src, param_shardings(abstract, topo.rollout, ROLLOUT_RULES), dst_dtype=dst_dtype)


@pytest.mark.parametrize("mode,trainer,rollout,dtype,total,per_device,aliased", [
    # fsdp=4 -> data=2 x tensor=2, bf16: tensor halves everything but the 160 norm elements per layer (+64 final):
    # 41,344 elements = 82,688 bytes per rollout device; total 82,304 x 2 = 164,608 (tests/test_transfer.py).
    ("disaggregated", (("fsdp", 4),), (("data", 2), ("tensor", 2)), "bfloat16", 164_608, 82_688, 0),
    # data=4: whole weights on every rollout device.
    ("disaggregated", (("fsdp", 2), ("tensor", 2)), (("data", 4),), "bfloat16", 164_608, 164_608, 0),
    # Colocated fp32, same devices: only the q/k norms (2 layers x 2 x 16 = 64, replicated both sides) alias;
    # the rest moves: 82,240 elements in all, 41,344 - 64 = 41,280 on each rollout device, 4 bytes each.
    ("colocated", (("fsdp", 2), ("tensor", 2)), (("data", 2), ("tensor", 2)), "float32", 4 * 82_240, 4 * 41_280, 64),
    # Colocated fp32 with identical splits: every leaf is the trainer's own array, nothing moves.
    ("colocated", (("data", 2), ("tensor", 2)), (("data", 2), ("tensor", 2)), "float32", 0, 0, 82_304),
    # A dtype change never aliases.
    ("colocated", (("data", 2), ("tensor", 2)), (("data", 2), ("tensor", 2)), "bfloat16", 164_608, 82_688, 0),
    # tensor=4 over the tiny model's 2 KV heads replicates k_proj and v_proj on the trainer (REPLICATE_IF_UNEVEN),
    # as data=4 does on the rollout side, so they alias, with the norms the trainer does not split either:
    # 2 layers x 2 x 64x2x16 = 8,192 + q/k norms 64 + layer norms 2 x 2 x 64 + final 64 = 8,576; 73,728 move.
    ("colocated", (("tensor", 4),), (("data", 4),), "float32", 4 * 73_728, 4 * 73_728, 8_576),
])
def test_tiny_sync_matches_transfer_plan(mode, trainer, rollout, dtype, total, per_device, aliased):
  topo_cfg = TopologyConfig(mode=mode, trainer_axes=trainer, rollout_axes=rollout)
  got = rb.sync_plan_bytes(TINY, topo_cfg, dst_dtype=dtype)
  assert got == {"total": total, "per_rollout_device": per_device, "aliased_params": aliased}, "hand count"
  plan = _plan(topo_cfg, dtype)
  assert plan.bytes_total == got["total"]
  assert set(plan.bytes_per_device.values()) <= {got["per_rollout_device"]}
  assert len(plan.bytes_per_device) == (topo_cfg.rollout_size if total else 0)
  assert sum(leaf.src.size for leaf in plan.leaves if leaf.route == "alias") == aliased


def test_sync_prediction_refuses_a_mesh_the_plan_refuses():
  # 4 query heads do not split 8 ways: TransferPlan raises, so must the prediction (it returned zeros here when
  # every leaf's layouts matched, and never looked at the trainer's).
  eight = (("tensor", 8),)
  with pytest.raises(ValueError, match="does not divide"):
    rb.sync_plan_bytes(TINY, TopologyConfig(mode="colocated", trainer_axes=eight, rollout_axes=eight))
  with pytest.raises(ValueError, match="does not divide"):
    rb.sync_plan_bytes(TINY, TopologyConfig(mode="disaggregated", trainer_axes=eight, rollout_axes=(("data", 8),)))


def test_tiny_lora_sync_matches_transfer_plan():
  topo = carve(TopologyConfig(mode="disaggregated", trainer_axes=(("fsdp", 4),), rollout_axes=(("data", 4),)))
  lcfg = LoraConfig(rank=4, targets=("q_proj", "down_proj"))
  adapters = jax.eval_shape(lambda p: init_lora(p, lcfg, jax.random.key(0)), abstract_model(TINY)[1].shapes)
  src = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), adapters,
                     replicated(adapters, topo.trainer))
  plan = TransferPlan.build(src, replicated(adapters, topo.rollout), mode="lora")
  # q 4(64+64) + down 4(128+64) = 1,280 per layer, 2,560 params, kept fp32: 10,240 bytes.
  assert plan.bytes_total == rb.weight_sync_bytes(TINY, dtype="float32", mode="lora", lora_rank=4,
                                                  lora_targets=lcfg.targets) == 10_240


@pytest.mark.parametrize("mode, want", [("colocated", 0), ("disaggregated", 4 * 8_192)])
def test_lora_sync_per_step_matches_the_plan_a_run_builds(mode, want):
  """A sync.mode=lora run sends its adapters as runtime/sync.py's WeightSync plans them: fp32, replicated on the
  trainer (train/state.py) -> replicated on the rollout mesh. Colocated, both meshes span one device list, so every
  adapter is aliased and a sync moves 0 bytes (a run logs sync/bytes=0). Before: the record predicted 32,768 bytes
  (3.28e-05 GB) a step for the colocated run; the disaggregated prediction (32,768) already matched."""
  topo_cfg = TopologyConfig(mode=mode, trainer_axes=(("fsdp", 4),), rollout_axes=(("data", 2), ("tensor", 2)))
  topo, lcfg = carve(topo_cfg), LoraConfig(rank=4)
  adapters = jax.eval_shape(lambda p: init_lora(p, lcfg, jax.random.key(0)), abstract_model(TINY)[1].shapes)
  src = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), adapters,
                     replicated(adapters, topo.trainer))
  plan = TransferPlan.build(src, replicated(adapters, topo.rollout), mode="lora")
  assert plan.bytes_total == rb.lora_sync_plan_bytes(TINY, topo_cfg, 4) == want
  c = _config("grpo_task")
  c["topology"] = dict(mode=mode, trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2})
  c["lora"]["rank"], c["sync"] = 4, {"mode": "lora"}
  sb = sb_lib.step_bytes(from_config_dict(c))
  assert sb.totals()["sync"] == sb.sync_per_step == want
  assert sb.sync_lora == 4 * 8_192  # the adapters' own size (the memory fit's trained state) is unchanged


def test_qwen25_7b_sanity():
  n = num_params(QWEN7)  # 7,615,616,512
  assert rb.weight_sync_bytes(QWEN7) == 2 * n == 15_231_233_024
  assert rb.weight_sync_bytes(QWEN7, mode="delta", changed_frac=0.02) == round(0.02 * 2 * n)
  # tensor=4 splits everything but the RMSNorm weights: 28 layers x 2 + final = 57 vectors of D=3584.
  norms = 57 * 3584
  assert rb.per_device_shard_bytes(QWEN7, {"tensor": 4}, ROLLOUT_RULES, "bfloat16") == 2 * ((n - norms) // 4 + norms)
  # FSDP=8 shards every weight with an embed dim; the q/k/v biases [heads, head_dim] stay whole:
  # 28 x (28 x 128 + 2 x 4 x 128) = 129,024 elements on every device.
  bias = 28 * (28 * 128 + 2 * 4 * 128)
  assert rb.per_device_shard_bytes(QWEN7, {"fsdp": 8}, TRAIN_RULES, "float32") == 4 * ((n - bias) // 8 + bias)
  # Pure data parallelism at 8 with bf16 grads: 2 x 7/8 x 2n per rank.
  got = rb.gradient_collective_bytes(QWEN7, {"data": 8}, "bfloat16")
  assert got["total"] == got["all_reduce"] == round(2 * 7 / 8 * 2 * n) and got["all_gather_fwd"] == 0


def test_rollout_payload_by_hand():
  # 2 prompts x 4 samples = N 8 sequences, P 10 + C 6 = S 16 tokens per row.
  got = rb.rollout_payload_bytes(2, 4, 10, 6)
  assert got == {
      "token_ids": 8 * 16 * 4,  # 512
      "sampler_logp": 8 * 6 * 4,  # 192
      "loss_mask": 8 * 6 * 4,  # 192
      "onpolicy_mask": 8 * 6 * 4,  # 192
      "rewards": 8 * 4,  # 32
      "row_layout": (2 * 8 * 16 + 2 * 8 * 6) * 4,  # positions + segment ids, targets + gather index: 1,408
      "total": 2_528,
  }


def test_fsdp_collectives_by_hand_n4():
  # Tiny at fsdp=4, fp32: every weight but the q/k norms (64 elements) shards its embed dim.
  # Gathered per rank: W = 82,240 elements, shard W/4 = 20,560; each gather receives 61,680 x 4 = 246,720 bytes.
  got = rb.gradient_collective_bytes(TINY, {"fsdp": 4})
  assert got == {"all_gather_fwd": 246_720, "all_gather_bwd": 246_720, "reduce_scatter": 246_720,
                 "all_reduce": 384,  # the norms' 256 grad bytes all-reduced over 4: 2 x 3/4 x 256
                 "total": 740_544}
  # data=2 x fsdp=4: the 82,240-byte grad shard all-reduces over data (2 x 1/2 x 82,240) and the norms over 8
  # batch ranks (2 x 7/8 x 256 = 448); two microbatches pay everything twice.
  got = rb.gradient_collective_bytes(TINY, {"data": 2, "fsdp": 4}, n_micro=2)
  assert got["all_gather_fwd"] == 2 * 246_720 and got["all_reduce"] == 2 * (82_240 + 448)
  plain = rb.gradient_collective_bytes(TINY, {"fsdp": 4}, scheme="allreduce")  # DDP: 2 x 3/4 x 329,216
  assert plain["total"] == plain["all_reduce"] == 493_824
  lora = rb.gradient_collective_bytes(TINY, {"fsdp": 4}, lora_rank=4)  # base still gathered; 8,192 x 4 all-reduced
  assert lora["all_gather_bwd"] == 246_720 and lora["reduce_scatter"] == 0 and lora["all_reduce"] == 49_152


def test_reference_and_critic_traffic():
  axes = {"fsdp": 4}
  assert rb.reference_collective_bytes(TINY, axes, kl_coef=0.0) == 0
  assert rb.reference_collective_bytes(TINY, axes, kl_coef=0.05) == 246_720  # one more forward gather
  assert rb.reference_collective_bytes(TINY, axes, kl_coef=0.05, scheme="allreduce") == 0
  assert rb.critic_collective_bytes(TINY, axes, "none") == {"total": 0}
  shared = rb.critic_collective_bytes(TINY, axes, "shared")  # old-values forward + [64] fp32 head: 2 x 3/4 x 256
  assert shared == {"backbone": 0, "old_values_forward": 246_720, "value_head": 384, "total": 247_104}
  separate = rb.critic_collective_bytes(TINY, axes, "separate")  # a second backbone doubles the policy's traffic
  assert separate["backbone"] == rb.gradient_collective_bytes(TINY, axes)["total"] == 740_544
  # Two epochs: the gradients flow twice, the old values are still read once.
  two = rb.critic_collective_bytes(TINY, axes, "separate", epochs=2)
  assert (two["backbone"], two["old_values_forward"], two["value_head"]) == (2 * 740_544, 246_720, 2 * 384)


def _config(name: str, arg: str = "tiny") -> dict:
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg).to_dict()


def test_step_bytes_from_shipped_configs():
  # grpo_task:tiny is colocated on one device in fp32: the sync is zero-copy.
  sb = sb_lib.step_bytes(from_config_dict(_config("grpo_task")))
  assert sb.sync_full == 0 and sb.sync_aliased_params == 82_304 and sb.sync_lora is None
  assert sb.payload == rb.rollout_payload_bytes(16, 16, 16, 6)  # batch 16 x group 16, prompts <= 16, 6 new tokens
  assert sb.critic_collectives["total"] == 0 and sb.reference_collectives == 0
  c = _config("grpo_task")
  c["topology"] = dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2})
  c["model"]["dtype"] = "bfloat16"
  c["rl"]["kl_coef"] = 0.05
  c["lora"]["rank"] = 4
  sb = sb_lib.step_bytes(from_config_dict(c), changed_frac=0.5, steps_per_hour=3600)
  assert (sb.sync_full, sb.sync_full_per_rollout_device, sb.sync_delta) == (164_608, 82_688, 82_304)
  assert sb.sync_lora == 4 * 8_192 and sb.trainer_param_bytes_per_device == 4 * (82_240 // 4 + 64)
  assert sb.reference_collectives == 246_720 and sb.policy_collectives["reduce_scatter"] == 0
  d = json.loads(json.dumps(sb.to_dict()))
  assert d["per_hour"]["sync"] == 3600 * 164_608
  # The step's sync figure follows sync.mode: LoRA runs send the adapters, delta runs the changed share.
  for mode, want in (("lora", 4 * 8_192), ("delta", 82_304)):
    c["sync"] = {"mode": mode}
    assert sb_lib.step_bytes(from_config_dict(c), changed_frac=0.5).totals()["sync"] == want
  del c["sync"]
  assert d["totals"]["collectives_per_rank"] == sb.policy_collectives["total"] + 246_720
  ppo = sb_lib.step_bytes(from_config_dict(_config("ppo_critic")))
  assert set(ppo.critic_collectives) == {"backbone", "old_values_forward", "value_head", "total"}
  # Several updates a step (rl.epochs x rl.minibatches): each epoch runs every microbatch's forward and
  # backward, and the old policy's log-probs are one more forward (the KL reference's 246,720 bytes' size).
  c["rl"].update(epochs=2, minibatches=1)
  two = sb_lib.step_bytes(from_config_dict(c))
  assert two.reference_collectives == 2 * 246_720
  c["rl"]["epochs"], c["run"]["n_micro"] = 1, 2  # the same microbatch passes: 2 microbatches, one epoch
  assert two.policy_collectives == sb_lib.step_bytes(from_config_dict(c)).policy_collectives
  assert two.policy_collectives["total"] > sb.policy_collectives["total"]


def test_step_bytes_reads_an_hf_dir(tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    json.dump(to_hf_dict(TINY), f)
  c = _config("grpo_task")
  c["model"]["hf_dir"] = str(tmp_path)
  sb = sb_lib.step_bytes(from_config_dict(c))
  assert sb.model == str(tmp_path) and sb.n_params == 82_304 and sb.sync_dtype == "float32"


def test_bad_input_is_named():
  with pytest.raises(ValueError, match="changed_frac"):
    rb.weight_sync_bytes(TINY, mode="delta")
  with pytest.raises(ValueError, match="sync mode"):
    rb.weight_sync_bytes(TINY, mode="zip")
  with pytest.raises(ValueError, match=r"[oq]_proj.kernel: dim \d \(heads=4\)"):
    rb.per_device_shard_bytes(TINY, {"tensor": 8}, ROLLOUT_RULES, "bfloat16")
  with pytest.raises(ValueError, match="unknown dtype"):
    rb.weight_sync_bytes(TINY, dtype="bfloat17")
  with pytest.raises(ValueError, match="match no kernel"):
    rb.weight_sync_bytes(TINY, mode="lora", lora_rank=4, lora_targets=("qproj",))
  with pytest.raises(ValueError, match="scheme"):
    rb.gradient_collective_bytes(TINY, {"fsdp": 4}, scheme="zero3")
  with pytest.raises(ValueError, match="steps_per_hour"):
    sb_lib.per_hour(1.0, 0)
  assert np.isfinite(sb_lib.per_hour(1.0, 2.5))
