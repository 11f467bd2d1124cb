"""Steps/hour of the RL loop in each mode on a long-tail workload, measured and predicted (issue 13).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
      python benchmarks/modes.py --steps=8 --out=/tmp/modes     # JSON lines on stdout, timelines in --out

Workload: the `tiny` model (random init, no warm-up), 8 prompts x 4 samples per step; each group's completion
length is drawn lognormal (median --median tokens, sigma 1) and capped at 8x the median (and at the model's
position limit), the same lengths in every mode (one seeded draw per step). The rollout never stops early: no
stop string, no EOS (the engine's eos_ids are emptied), and the engine is given each group's length as its
max_new_tokens. Devices: colocated uses all 8 (trainer fsdp=8, rollout data=4 x tensor=2); disaggregated and async
split them 4 + 4 (trainer fsdp=4, rollout data=2 x tensor=2; async eta=2, readiness-based landing);
`--rollout_tensor=T` sets the rollout mesh's tensor axis (data = devices / T) in every mode.

Per mode: measured steps/hour from wall time after the first --skip steps (default 1: the one that compiles;
later steps still meet new batch shapes), tokens/s, the rollout tokens generated while train steps ran
(perf/overlap_tokens), and the review simulator calibrated on the same run's spans (review/calibrate.py
calibrate, sigma and cap as drawn) predicting that mode's steps/hour. Disaggregated and async run one
continuous rollout stream, which is the simulator's async mode at the run's eta (no drain between batches), so
they are fitted as a stream (`stream=True`) and predicted as that ("simulated_as"). A timeline PNG of the
measured spans per mode (review/plots.py); each mode's spans and metrics as JSONL beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxrl_topo.review import calibrate, plots, simulator  # noqa: E402
from jaxrl_topo.runtime import experiment, loop, rollout_side  # noqa: E402
from jaxrl_topo.runtime.config import config_from_file, from_config_dict  # noqa: E402


def topology(mode: str, tensor: int = 2) -> dict:
  """Colocated: all 8 devices for both; disaggregated / async: 4 + 4. The rollout mesh is data x `tensor`."""
  n = 8 if mode == "colocated" else 4
  return dict(mode=mode, trainer={"fsdp": n}, rollout={"data": n // tensor, "tensor": tensor})


ETA = {"colocated": 0, "disaggregated": 1, "async": 2}
PROMPTS, GROUP, SIGMA = 8, 4, 1.0


def _config(mode: str, steps: int, max_new: int, eta: int, tensor: int = 2):
  c = config_from_file(os.path.join(ROOT, "configs", "grpo_task.py"), "tiny")
  c.run.update(dict(steps=steps, eval_every=0, sft_steps=0, sft_target_accuracy=0.0, tensorboard=False, plot=False,
                    max_staleness=eta, checkpoint_every=0))
  c.data.batch_size, c.rl.group_size = PROMPTS, GROUP
  c.rollout.update(dict(max_new_tokens=max_new, stop=(), n_slots=PROMPTS * GROUP))
  c.reward.n_workers = 0
  c.topology = topology(mode, tensor)
  return from_config_dict(c)


def _lengths(steps: int, median: int, cap: int, seed: int = 0) -> np.ndarray:
  """[steps, PROMPTS] completion lengths, one per group."""
  z = np.random.default_rng(seed).standard_normal((steps, PROMPTS))
  return np.clip(np.round(median * np.exp(SIGMA * z)), 1, cap).astype(int)


def run_mode(run: str, steps: int, median: int, out: str, skip: int = 1, tensor: int = 2) -> dict:
  """`run`: a mode, or `async:ETA` for another bound than ETA's."""
  mode, _, eta = run.partition(":")
  eta, name = int(eta) if eta else ETA[mode], run.replace(":", "_eta")
  cap = min(8 * median, 512 - 16)  # 8x the median, within tiny's 512 positions (16 prompt tokens)
  lengths = _lengths(steps + 2, median, cap)
  cfg = _config(mode, steps, cap, eta, tensor)
  exp = experiment.build(cfg, os.path.join(out, name))
  exp.engine.ecfg = dataclasses.replace(exp.engine.ecfg, eos_ids=())  # lengths are the drawn ones, never EOS
  drawn = iter(range(10**9))
  real_requests = rollout_side._requests

  def requests(exp_, examples):  # batch k's groups get lengths[k]: the same workload in every mode
    k = next(drawn)
    return [dataclasses.replace(r, max_new_tokens=int(n)) for r, n in
            zip(real_requests(exp_, examples), lengths[min(k, len(lengths) - 1)], strict=True)]

  rollout_side._requests = requests
  records, spans = [], []
  t0 = time.perf_counter()
  try:
    loop.train_loop(exp, hooks=loop.LoopHooks(on_step=lambda s, m: records.append(m), on_span=spans.append))
  finally:
    rollout_side._requests = real_requests
    exp.close()
  wall = time.perf_counter() - t0
  for what, rows in (("spans", spans), ("metrics", records)):  # for calibrating again without running again
    with open(os.path.join(out, f"{what}_{name}.jsonl"), "w") as f:
      f.writelines(json.dumps(r, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x)) + "\n" for r in rows)
  tokens = [r["perf/tokens"] for r in records]
  steady = records[skip:]  # after the first `skip` steps (compilation): wall seconds between their metrics
  seconds = sum(r["time/step_s"] for r in steady)
  steps_per_hour, tokens_per_s = 3600.0 * len(steady) / seconds, sum(tokens[skip:]) / seconds
  # A continuous stream (disaggregated, async) is the simulator's async mode at the run's eta: no drain between
  # batches (the simulator's "disaggregated" is the drained one-step-off pipeline, rollout.continuous=False).
  sim_mode = "async" if cfg.continuous_rollout else mode
  params = calibrate.calibrate(spans, batch_seqs=PROMPTS * GROUP, tokens_per_step=float(np.median(tokens[skip:])),
                               sigma=SIGMA, max_ratio=cap / median, eta=max(eta, 1), skip_steps=skip,
                               rollout_devices=4 if mode != "colocated" else None, stream=cfg.continuous_rollout)
  predicted = simulator.steps_per_hour(sim_mode, params, n_steps=48)
  origin = min(s["start"] for s in spans)
  timeline = simulator.Timeline(mode=mode, params=params, lengths=np.zeros((steps, 1)), spans=tuple(
      simulator.Span(phase=s["phase"], role=s["role"] if mode != "colocated" else "colocated", step=s["step"],
                     start=s["start"] - origin, end=s["end"] - origin, gen_id=s["gen_id"])
      for s in spans if s["phase"] in plots._COLORS))
  png = plots.plot_timelines({mode: timeline}, os.path.join(out, f"timeline_{name}.png"), max_steps=steps)
  return {"mode": run, "eta": eta, "rollout_tensor": tensor, "steps": steps, "skip": skip, "wall_s": wall,
          "steps_per_hour": steps_per_hour,
          "tokens_per_s": tokens_per_s, "predicted_steps_per_hour": predicted, "simulated_as": sim_mode,
          "predicted_over_measured": predicted / steps_per_hour,
          "tokens_per_step": float(np.mean(tokens)),
          "overlap_tokens": int(sum(r["perf/overlap_tokens"] for r in records)),
          "staleness_max": int(max(r["staleness/max"] for r in records)), "timeline": png,
          "device": f"{jax.devices()[0].platform} x{jax.device_count()}", "jax": jax.__version__}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--median", type=int, default=64)
  ap.add_argument("--modes", default="colocated,disaggregated,async",
                  help="comma-separated; async:ETA runs async with max_staleness ETA (default 2)")
  ap.add_argument("--out", default="/tmp/modes_bench")
  ap.add_argument("--rollout_tensor", type=int, default=2, help="the rollout mesh's tensor axis (1, 2 or 4)")
  ap.add_argument("--skip", type=int, default=1, help="steady state: after the first SKIP steps (compilation)")
  args = ap.parse_args()
  if not 0 <= args.skip < args.steps:  # steps after the first --skip are timed: at least one
    ap.error(f"--steps={args.steps} --skip={args.skip}: need 0 <= --skip < --steps")
  os.makedirs(args.out, exist_ok=True)
  for mode in args.modes.split(","):
    print(json.dumps(run_mode(mode, args.steps, args.median, args.out, args.skip, args.rollout_tensor)), flush=True)


if __name__ == "__main__":
  main()
