"""The calculator tool-use demo (configs/tool_calc.py): held-out accuracy and correct tool-use rate
before and after RL, one JSON line per evaluation on stdout (and appended to --out).

  python benchmarks/tool_calc.py --workdir=/tmp/calc [--steps=60] [--sft_steps=300] [--out=benchmarks/tool_calc.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--sft_steps", type=int, default=600)
  ap.add_argument("--eval_every", type=int, default=20)
  ap.add_argument("--mode", default="colocated")
  ap.add_argument("--out", default="")
  args = ap.parse_args()

  import jax

  from jaxrl_topo.runtime import experiment, loop
  from jaxrl_topo.runtime.config import config_from_file, from_config_dict

  c = config_from_file(os.path.join(ROOT, "configs", "tool_calc.py"), str(args.sft_steps))
  c.run.steps, c.run.tensorboard, c.run.plot = args.steps, False, False
  c.topology.mode = args.mode
  cfg = from_config_dict(c)
  t0 = time.perf_counter()
  exp = experiment.build(cfg, args.workdir)
  rows = []

  def emit(row: dict) -> None:
    row = {"bench": "tool_calc", "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "wall_s": round(time.perf_counter() - t0, 1), **row}
    rows.append(row)
    print(json.dumps(row), flush=True)

  try:
    emit({"step": 0, **loop.evaluate_metrics(exp, tag=0)})
    train = {}

    def on_step(step: int, m: dict) -> None:
      train[step] = {k: m[k] for k in ("reward_mean", "env/tool_correct", "env/correct", "env/turns_mean") if k in m}
      if "eval/accuracy" in m:
        emit({"step": step + 1, **{k: v for k, v in m.items() if k.startswith("eval/")}, "train": train[step]})

    hooks = loop.LoopHooks(on_step=on_step, should_eval=lambda s: s % args.eval_every == 0)
    loop.train_loop(exp, hooks=hooks)
  finally:
    exp.close()
  if args.out:
    with open(args.out, "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
  sys.exit(main())
