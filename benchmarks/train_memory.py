"""Compiled memory of the loop's train step, ahead of time: nothing is allocated.

  python benchmarks/train_memory.py                                   # Qwen2.5-0.5B and 1.5B, 16 x 2,048
  python benchmarks/train_memory.py --presets=qwen2.5-0.5b --seq_lens=512,2048 --variants=flash

For each preset, sequence length and variant, the GRPO train step the RL loop builds (the trainer's
graphdef with activation sharding constraints, remat as configured, all devices on one `fsdp` axis)
is lowered on abstract arrays (`jax.ShapeDtypeStruct` with shardings: weights, Adam moments and the
batch never exist) and compiled; `memory_analysis()` gives the per-device temp (scratch) and argument
bytes. One JSON line per case. Variants:
  reference   dense masked attention (the quadratic [B, K, G, T, T] fp32 logits), padded rows
  flash       blockwise attention (models/attention.py), padded rows
  flash+pack  the same tokens packed into rows of 2 x seq_len (half as many rows, same token count)
  +remat      each of the above with train.remat="block"
Target (issue 14): flash temp bytes at 2,048 tokens at most 2x those at 512 (linear, not quadratic).
CPU caveat: XLA's CPU pipeline drops the optimisation barriers remat relies on, so remat shows its
effect on GPU only (benchmarks/RESULTS.md, "Train step: CPU").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp

from jaxrl_topo.models.model import abstract_model, param_shardings
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.topology.rules import TRAIN_RULES, ActivationSharding, make_mesh
from jaxrl_topo.train.batch import TrainBatch
from jaxrl_topo.train.config import LossConfig, TrainConfig
from jaxrl_topo.train.optim import make_optimizer
from jaxrl_topo.train.policy import model_fns
from jaxrl_topo.train.state import abstract_train_state
from jaxrl_topo.train.step import batch_sharding_for, make_train_step

GROUP = 4
VARIANTS = ("reference", "flash", "flash+pack", "reference+remat", "flash+remat", "flash+pack+remat")


def abstract_state(cfg, mesh, train_cfg, tx):
  """The TrainState as ShapeDtypeStructs carrying the shardings create_train_state would give it."""
  _, abstract = abstract_model(cfg)
  shardings = param_shardings(abstract, mesh, TRAIN_RULES)
  policy = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract.shapes, shardings)
  return abstract_train_state(policy, train_cfg, tx, d_model=cfg.d_model)


def abstract_batch(mesh, n_seq: int, seq_len: int, n_micro: int, pack: bool) -> TrainBatch:
  """Full-length sequences (prompt seq_len/4): one per row, or two per row of 2 x seq_len when packed."""
  resp = seq_len - seq_len // 4
  B = n_seq // n_micro
  R, S = (B // 2, 2 * seq_len) if pack else (B, seq_len)
  sharding = batch_sharding_for(mesh, TRAIN_RULES)
  f = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  i32, f32 = jnp.int32, jnp.float32
  return TrainBatch(tokens_MRS=f((n_micro, R, S), i32), positions_MRS=f((n_micro, R, S), i32),
                    segment_ids_MRS=f((n_micro, R, S), i32), gather_MBT=f((n_micro, B, resp), i32),
                    targets_MBT=f((n_micro, B, resp), i32), mask_MBT=f((n_micro, B, resp), f32),
                    rewards_MB=f((n_micro, B), f32), sampler_logp_MBT=f((n_micro, B, resp), f32))


def measure(preset: str, seq_len: int, variant: str, args) -> dict:
  attention = "reference" if variant.startswith("reference") else "flash"
  remat = "block" if variant.endswith("+remat") else "none"
  cfg = dataclasses.replace(get_preset(preset), dtype=args.dtype, attention=attention, attn_block=args.block)
  mesh = make_mesh({"fsdp": jax.device_count()})
  train_cfg = TrainConfig(loss=LossConfig(group_size=GROUP, advantage="grpo"))
  tx = make_optimizer(train_cfg.optim)
  state = abstract_state(cfg, mesh, train_cfg, tx)
  graphdef, _ = abstract_model(cfg, ActivationSharding(mesh, TRAIN_RULES), remat=remat)
  step = make_train_step(model_fns(graphdef), train_cfg, tx, state, mesh=mesh, rules=TRAIN_RULES)
  batch = abstract_batch(mesh, args.batch, seq_len, args.n_micro, "pack" in variant)
  t0 = time.perf_counter()
  memory = step.lower(state, batch).compile().memory_analysis()
  return {"bench": "train_memory", "preset": preset, "seq_len": seq_len, "variant": variant, "batch": args.batch,
          "n_micro": args.n_micro, "dtype": args.dtype, "attn_block": args.block,
          "temp_bytes": memory.temp_size_in_bytes, "argument_bytes": memory.argument_size_in_bytes,
          "compile_s": round(time.perf_counter() - t0, 1), "device": jax.devices()[0].device_kind,
          "n_devices": jax.device_count(), "jax": jax.__version__}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-1.5b")
  parser.add_argument("--seq_lens", default="512,2048")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--batch", type=int, default=16, help="sequences per step")
  parser.add_argument("--n_micro", type=int, default=1, help="rows per microbatch must divide over the devices")
  parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
  parser.add_argument("--block", type=int, default=512, help="flash tile size")
  args = parser.parse_args()
  for v in args.variants.split(","):
    if v not in VARIANTS:
      parser.error(f"unknown variant {v!r}; expected some of {VARIANTS}")
  rows = []
  for preset in args.presets.split(","):
    for variant in args.variants.split(","):
      for seq_len in (int(s) for s in args.seq_lens.split(",")):
        rows.append(measure(preset, seq_len, variant, args))
        print(json.dumps(rows[-1]), flush=True)
      if len(args.seq_lens.split(",")) == 2:  # the growth from the shorter length to the longer, in either order
        short, long = sorted(rows[-2:], key=lambda r: r["seq_len"])
        print(json.dumps({"bench": "train_memory_growth", "preset": preset, "variant": variant,
                          "temp_ratio_long_over_short": long["temp_bytes"] / short["temp_bytes"]}), flush=True)


if __name__ == "__main__":
  main()
