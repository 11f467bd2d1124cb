"""kill -9 at random moments, then resume: every run must finish with each prompt batch trained once (issue 13).

  python benchmarks/kill_resume.py --trials=10 --modes=disaggregated,async --out=/tmp/kill   # JSON lines

Per mode: one uninterrupted reference run of the tiny config (8 steps, checkpoint every 2, eta as the mode
takes it, `run.deterministic=True`), then `--trials` runs that are each sent SIGKILL at a random moment of
their RL phase (once the first step's metrics are written, after a delay uniform over the reference's
time from that point to its exit, seeded) and launched again in the same workdir. A
trial passes when the relaunch exits 0 and its metrics.jsonl holds steps 0..7 once each, every step
trained the reference's prompt batch (`data/prompt_hash`: nothing lost, nothing trained twice, the
order kept) within the staleness bound; `exact` says whether every metric (timings aside) equals the
reference's. Devices: 2 fake CPU devices per process (trainer 1 + rollout 1). The processes share a
persistent compilation cache, so a launch costs start-up, not compilation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxrl_topo.runtime.metrics import comparable, read_metrics  # noqa: E402

STEPS = 8
FLAGS = {"run.steps": STEPS, "run.checkpoint_every": 2, "run.eval_every": 0, "run.tensorboard": False,
         "run.plot": False, "reward.n_workers": 0, "run.sft_steps": 10, "run.sft_target_accuracy": 0.0,
         "data.batch_size": 4, "rl.group_size": 4, "rollout.n_slots": 16, "run.deterministic": True}
ETA = {"disaggregated": 1, "async": 2}


def launch(workdir: str, mode: str, cache: str, kill_after: float | None = None) -> tuple[int, float, bool]:
  """(exit code, seconds from the first step's metrics to the exit, killed by us) of one launch of
  launchers/train.py; `kill_after`: SIGKILL that many seconds after the first step's metrics appear."""
  flags = {**FLAGS, "topology.mode": mode, "run.max_staleness": ETA[mode]}
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "train.py"),
         f"--config={os.path.join(ROOT, 'configs', 'grpo_task.py')}:tiny", f"--workdir={workdir}", "--noprogress",
         *[f"--config.{k}={v}" for k, v in flags.items()]]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  metrics = os.path.join(workdir, "metrics.jsonl")
  with open(os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log"), "a") as log:
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=ROOT)
    while proc.poll() is None and not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
      time.sleep(0.02)  # the RL phase starts with the first step's metrics
    t0, killed = time.perf_counter(), False
    try:
      proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
      proc.send_signal(signal.SIGKILL)  # kill -9: no handler, no flush, no cleanup
      proc.wait()
      killed = True
    return proc.returncode, time.perf_counter() - t0, killed


def check(workdir: str, ref: list[dict], eta: int) -> dict:
  got = read_metrics(workdir)
  steps = [r["step"] for r in got]
  hashes = [r.get("data/prompt_hash") for r in got]
  return {"steps_once": steps == list(range(STEPS)),
          "same_prompts": hashes == [r.get("data/prompt_hash") for r in ref],
          "staleness_ok": all(r["staleness/max"] <= eta for r in got),
          "exact": comparable(got) == comparable(ref)}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--trials", type=int, default=10)
  ap.add_argument("--modes", default="disaggregated,async")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="/tmp/kill_resume")
  args = ap.parse_args()
  rng = random.Random(args.seed)
  cache = os.path.join(args.out, "cache")
  os.makedirs(cache, exist_ok=True)
  for mode in args.modes.split(","):
    ref_dir = os.path.join(args.out, f"{mode}_ref")
    rc, wall, _ = launch(ref_dir, mode, cache)
    if rc != 0:
      raise SystemExit(f"{mode}: the reference run failed (rc={rc}); see {ref_dir}.log")
    rc, wall, _ = launch(os.path.join(args.out, f"{mode}_ref2"), mode, cache)  # warm cache: the RL phase's length
    ref = read_metrics(ref_dir)
    passed = exact = killed_n = 0
    for trial in range(args.trials):
      work = os.path.join(args.out, f"{mode}_{trial}")
      delay = rng.uniform(0.0, 1.0) * wall
      rc_kill, _, killed = launch(work, mode, cache, kill_after=delay)
      rc, _, _ = launch(work, mode, cache)  # the relaunch resumes (or, if the first launch finished, only evaluates)
      result = {"bench": "kill_resume", "mode": mode, "trial": trial, "kill_after_s": round(delay, 2),
                "killed": killed, "first_rc": rc_kill, "resume_rc": rc}
      if os.path.exists(os.path.join(work, "summary.json")):
        with open(os.path.join(work, "summary.json")) as f:
          result["resumed_from"] = json.load(f)["resumed_from"]
      result.update(check(work, ref, ETA[mode]) if rc == 0 else {})
      ok = rc == 0 and result["steps_once"] and result["same_prompts"] and result["staleness_ok"]
      passed += ok
      exact += bool(result.get("exact"))
      killed_n += killed
      print(json.dumps(result), flush=True)
    print(json.dumps({"bench": "kill_resume", "mode": mode, "summary": True, "trials": args.trials,
                      "killed": killed_n, "passed": passed, "exact": exact, "reference_rl_s": round(wall, 1)}),
          flush=True)


if __name__ == "__main__":
  main()
