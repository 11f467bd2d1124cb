"""Weight-sync time per mode and bucket size, next to a plain `jax.device_put` of the same bytes.

  python benchmarks/weight_sync.py                         # ~5M-param synthetic model, 8 fake CPU devices, < 1 min
  python benchmarks/weight_sync.py --n_params=1.5e9        # synthetic model of about that size
  python benchmarks/weight_sync.py --preset=qwen2.5-1.5b --buckets_mib=64,256 --placements=disaggregated

Trainer: fp32 params, TRAIN_RULES on `fsdp` over the first half of the devices. Rollout: bf16, ROLLOUT_RULES
on `data x tensor` over the second half (disaggregated) or over the trainer's devices (colocated). One
JSON line per (placement, mode, bucket size):
  sync_s    median seconds of `plan.run` (lora: the adapter transfer; merge_s is the merge on the rollout side)
  gb_per_s  bytes_sent / sync_s;  changed_frac = bytes_sent / bytes_total (delta: ~2% of params changed)
  plain_s   median seconds of `jax.device_put(x, rollout_shardings)` where x is the same tree already cast
            (same dtype), on the trainer's devices in the trainer's layout: the baseline; ratio = sync_s / plain_s
The plain baseline gets a freshly cast tree every repeat: a layout change across device sets goes through
`Array._value` (a host numpy copy, cached on the array), so re-putting one array would time a warm cache.
Synthetic models (`--n_params`): qwen3-shaped, 8 layers, 8 heads of D/8, 2 KV heads, d_ff 3D, vocab 8192, tied.
"""

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp

from jaxrl_topo.models.config import ModelConfig, num_params
from jaxrl_topo.models.model import abstract_model, param_shardings
from jaxrl_topo.models.presets import PRESETS, get_preset
from jaxrl_topo.topology.rules import ROLLOUT_RULES, TRAIN_RULES, make_mesh
from jaxrl_topo.topology.transfer import TransferPlan, merge_on_destination, replicated
from jaxrl_topo.train.config import LoraConfig
from jaxrl_topo.train.lora import init_lora

MIB = 2**20
DELTA_FRAC = 0.02


def synthetic_config(n_params: float) -> ModelConfig:
  """92 D^2 + 8192 D ~= n_params (8 layers of 11.5 D^2, tied 8192 x D embedding); D a multiple of 64."""
  d = (-8192 + math.sqrt(8192**2 + 4 * 92 * n_params)) / (2 * 92)
  d = max(64, int(round(d / 64)) * 64)
  return ModelConfig(family="qwen3", vocab_size=8192, d_model=d, n_layers=8, n_heads=8, n_kv_heads=2,
                     head_dim=d // 8, d_ff=3 * d, qk_norm=True, tie_embeddings=True, dtype="bfloat16")


def random_params(shapes, shardings, seed=0):
  """N(0, 1) fp32 leaves created on device, already in `shardings` (values are irrelevant to a copy)."""
  leaves, treedef = jax.tree.flatten(shapes)
  make = jax.jit(lambda key: [jax.random.normal(jax.random.fold_in(key, i), s.shape, jnp.float32)
                              for i, s in enumerate(leaves)], out_shardings=jax.tree.leaves(shardings))
  return jax.tree.unflatten(treedef, make(jax.random.key(seed)))


def timed(fn, repeats: int, prepare=lambda: None) -> float:
  """Median seconds of fn(prepare()) over `repeats`, after one warm-up; prepare() is not timed."""
  times = []
  for i in range(repeats + 1):
    arg = prepare()
    t0 = time.perf_counter()
    jax.block_until_ready(fn(arg))
    if i:
      times.append(time.perf_counter() - t0)
  return statistics.median(times)


def plain_seconds(tree, dst_shardings, repeats: int, dtype) -> float:
  """The baseline: device_put of the same tree already cast, freshly cast before every put (not timed)."""
  cast = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(dtype) if dtype else x, t),
                 out_shardings=jax.tree.map(lambda x: x.sharding, tree))
  return timed(lambda x: jax.device_put(x, dst_shardings), repeats, prepare=lambda: jax.block_until_ready(cast(tree)))


def perturb_some(params, frac: float):
  """A jitted "training step" adding 1 to consecutive whole leaves from the middle of the tree, ~`frac` of params."""
  leaves, treedef = jax.tree.flatten(params)
  total, picked, n = sum(x.size for x in leaves), set(), 0
  for i in range(len(leaves) // 2, len(leaves)):
    if n >= frac * total:
      break
    picked.add(i)
    n += leaves[i].size
  step = jax.jit(lambda xs: [x + 1 if i in picked else x for i, x in enumerate(xs)],
                 out_shardings=[x.sharding for x in leaves], donate_argnums=0)
  return lambda p: jax.tree.unflatten(treedef, step(jax.tree.leaves(p))), n / total


def run_placement(cfg, placement: str, args, common: dict):
  """JSON records for one placement: full and delta per bucket size, then LoRA."""
  devices = jax.devices()
  half = max(1, len(devices) // 2)
  trainer_devs = devices[:half]
  rollout_devs = devices[half:2 * half] if placement == "disaggregated" else trainer_devs
  tensor = min(args.tensor, len(rollout_devs))
  train_mesh = make_mesh({"fsdp": len(trainer_devs)}, trainer_devs)
  roll_mesh = make_mesh({"data": len(rollout_devs) // tensor, "tensor": tensor}, rollout_devs)
  abstract = abstract_model(cfg)[1]
  params = random_params(abstract.shapes, param_shardings(abstract, train_mesh, TRAIN_RULES))
  dst_sh = param_shardings(abstract, roll_mesh, ROLLOUT_RULES)
  base = {**common, "placement": placement, "trainer": f"fsdp={len(trainer_devs)}",
          "rollout": f"data={len(rollout_devs) // tensor},tensor={tensor}"}
  plain_s = plain_seconds(params, dst_sh, args.repeats, jnp.bfloat16)
  for mode in [m for m in ("full", "delta") if m in args.modes]:
    for mib in args.buckets_mib:
      t0 = time.perf_counter()
      plan = TransferPlan.build(params, dst_sh, bucket_bytes=int(mib * MIB), mode=mode, route=args.route)
      build_s = time.perf_counter() - t0
      state = {"dst": plan.run(params)[0], "src": params}  # first sync (delta: sends everything)
      step, frac = perturb_some(params, DELTA_FRAC) if mode == "delta" else (None, 0.0)
      stats = []

      def one(src, plan=plan, state=state, stats=stats):
        state["dst"], s = plan.run(src, state["dst"])
        stats.append(s)
        return state["dst"]

      def prepare(step=step, state=state):
        if step is not None:
          state["src"] = jax.block_until_ready(step(state["src"]))
        return state["src"]

      sync_s = timed(one, args.repeats, prepare)
      s = stats[-1]
      print(json.dumps({**base, "mode": mode, "bucket_mib": mib, "buckets": len(plan.buckets),
                        "routes": sorted({leaf.route for leaf in plan.leaves}), "bytes_total": plan.bytes_total,
                        "bytes_sent": s["bytes_sent"], "changed_frac": s["changed_frac"], "params_changed": frac,
                        "sync_s": sync_s, "gb_per_s": s["bytes_sent"] / sync_s / 1e9, "plain_s": plain_s,
                        "plain_gb_per_s": plan.bytes_total / plain_s / 1e9, "ratio": sync_s / plain_s,
                        "build_s": build_s}), flush=True)
      params = state["src"] if mode == "delta" else params
      del state
  if "lora" in args.modes:
    print(json.dumps(lora_record(params, dst_sh, train_mesh, roll_mesh, args, base)), flush=True)


def lora_record(params, dst_sh, train_mesh, roll_mesh, args, base) -> dict:
  """LoRA: send the adapters (fp32), then merge them into the rollout's bf16 base copy."""
  lcfg = LoraConfig(rank=args.lora_rank)
  adapters = init_lora(params, lcfg, jax.random.key(1))
  adapters = jax.device_put(adapters, replicated(adapters, train_mesh))
  dst_ad = replicated(adapters, roll_mesh)
  base_dst = TransferPlan.build(params, dst_sh).run(params)[0]
  plan = TransferPlan.build(adapters, dst_ad, mode="lora")
  holder = {"dst": None}

  def send(src):
    holder["dst"], _ = plan.run(src, holder["dst"])
    return holder["dst"]

  sync_s = timed(send, args.repeats, prepare=lambda: adapters)
  merge_s = timed(lambda ad: merge_on_destination(base_dst, ad, lcfg), args.repeats, prepare=lambda: holder["dst"])
  plain_s = plain_seconds(adapters, dst_ad, args.repeats, None)
  stats = plan.run(adapters, holder["dst"])[1]  # colocated adapters alias: nothing is sent
  return {**base, "mode": "lora", "lora_rank": args.lora_rank, "bucket_mib": None, "buckets": len(plan.buckets),
          "routes": sorted({leaf.route for leaf in plan.leaves}), "bytes_total": plan.bytes_total,
          "bytes_sent": stats["bytes_sent"], "changed_frac": stats["changed_frac"], "sync_s": sync_s,
          "gb_per_s": stats["bytes_sent"] / sync_s / 1e9, "merge_s": merge_s, "plain_s": plain_s,
          # the baseline puts every adapter byte, aliased or not
          "plain_gb_per_s": sum(x.nbytes for x in jax.tree.leaves(adapters)) / plain_s / 1e9,
          "ratio": sync_s / plain_s}


def main():
  jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only the CPU backend reads it
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default=None, choices=sorted(PRESETS), help="a real model shape (else synthetic)")
  parser.add_argument("--n_params", type=float, default=5e6, help="synthetic model size when no --preset")
  parser.add_argument("--buckets_mib", default="1,4,16,64", help="comma-separated bucket sizes in MiB")
  parser.add_argument("--modes", default="full,delta,lora", help="comma-separated subset of full,delta,lora")
  parser.add_argument("--placements", default="disaggregated,colocated", help="disaggregated and/or colocated")
  parser.add_argument("--route", default="auto", choices=["auto", "source", "destination", "device_put"])
  parser.add_argument("--tensor", type=int, default=2, help="rollout tensor-parallel width")
  parser.add_argument("--lora_rank", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3, help="timed syncs per configuration (median)")
  args = parser.parse_args()
  args.buckets_mib = [float(x) for x in args.buckets_mib.split(",")]
  args.modes = args.modes.split(",")
  cfg = get_preset(args.preset) if args.preset else synthetic_config(args.n_params)
  common = {"bench": "weight_sync", "device": jax.devices()[0].device_kind, "n_devices": jax.device_count(),
            "jax": jax.__version__, "model": args.preset or "synthetic", "params": num_params(cfg),
            "d_model": cfg.d_model, "route": args.route}
  for placement in args.placements.split(","):
    if placement == "disaggregated" and jax.device_count() < 2:
      print(json.dumps({**common, "placement": placement, "skipped": "needs >= 2 devices"}), flush=True)
      continue
    run_placement(cfg, placement, args, common)


if __name__ == "__main__":
  main()
