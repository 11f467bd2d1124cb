"""Padding waste of the loop's train batches on the long-tail workload: padded rows vs packed rows.

  python benchmarks/packing.py                 # a second or two, numpy only

Completion lengths as in benchmarks/decode.py's long-tail workload (lognormal, median 64 tokens, log-sd
1, clipped to [1, 8 x median]) after a 32-token prompt. Each step's sequences are laid out the way
runtime/loop.py's make_batch does: padded (one per row of prompt + max_new_tokens tokens) or, after
spreading whole groups evenly over the microbatches (train/batch.py balance_groups), packed
first-fit-decreasing into rows of at most `train.max_tokens_per_row` tokens (train/batch.py plan_rows: the
row count a multiple of the data-parallel width, the row length then shrunk in steps of 64). One JSON
line per (layout, budget) with the mean padding fraction over `--steps` batches and the distinct
(rows per microbatch, row length) shapes: each compiles the train step once.
Target (issue 14): <= 10% padding when packed.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from lengths import sample_lengths  # this script's folder is on sys.path

from jaxrl_topo.train.batch import balance_groups, plan_rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqs", type=int, default=512, help="sequences per step (prompts x group size)")
  parser.add_argument("--n_micro", type=int, default=4)
  parser.add_argument("--group_size", type=int, default=8, help="completions per prompt (groups move whole)")
  parser.add_argument("--dp", type=int, default=8, help="data-parallel width (row counts are multiples of it)")
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--median_len", type=int, default=64)
  parser.add_argument("--sigma", type=float, default=1.0)
  parser.add_argument("--budgets", default="1024,2048,4096", help="train.max_tokens_per_row values")
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  max_len = args.prompt_len + 8 * args.median_len
  try:
    budgets = [int(b) for b in args.budgets.split(",")]
  except ValueError:
    parser.error(f"--budgets={args.budgets}: comma-separated integers, e.g. 1024,2048")
  short = [str(b) for b in budgets if b < max_len]
  if short:  # a row must hold the longest sequence (packing never splits one)
    parser.error(f"--budgets {','.join(short)}: below the longest sequence "
                 f"(--prompt_len + 8 x --median_len = {max_len})")
  batches = [args.prompt_len + sample_lengths(args.seqs, args.median_len, args.sigma, rng) for _ in range(args.steps)]
  layouts = [("padded", max_len)] + [("packed", b) for b in budgets]
  for layout, budget in layouts:
    fracs, shapes = [], set()
    for lengths in batches:
      if layout == "padded":
        rows, row_len = args.seqs // args.n_micro, budget
      else:
        G = args.group_size
        groups = lengths.reshape(-1, G)
        lengths = groups[balance_groups(groups.sum(1).tolist(), args.n_micro)].reshape(-1)
        rows, row_len = plan_rows(lengths.tolist(), args.n_micro, budget, multiple=args.dp)
      shapes.add((rows, row_len))
      fracs.append(1 - lengths.sum() / (args.n_micro * rows * row_len))
    print(json.dumps({"bench": "packing", "layout": layout, "row_tokens": budget, "seqs": args.seqs,
                      "n_micro": args.n_micro, "dp": args.dp, "pad_frac_mean": round(float(np.mean(fracs)), 4),
                      "pad_frac_max": round(float(np.max(fracs)), 4), "shapes": sorted(shapes),
                      "mean_seq_tokens": round(float(np.mean([b.mean() for b in batches])), 1)}), flush=True)


if __name__ == "__main__":
  main()
