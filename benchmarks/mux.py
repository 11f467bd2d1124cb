"""Phase-level multiplexing on CPU: 2-3 tiny jobs alone (disaggregated, eta = 0) and as one co-execution group.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
      python benchmarks/mux.py --jobs=3 --steps=10 --out=/tmp/mux_bench   # JSON lines on stdout
      python benchmarks/mux.py --jobs=2 --steps=6 --resize=off,on          # the group without / with mux.resize

Per job: seconds per step after the first (compilation) step, alone and in the group, and the slowdown.
Per pool: the busy fraction, alone (each job's own run) and in the group, over the steady state (after
every job's first step). Writes <out>/mux_timeline.png (the group's phases, coloured by job). Trainer
fsdp=4 on devices 0-3, rollout data=2 x tensor=2 on 4-7; all 8 fake devices share the machine's cores, so
a pool's phase slows the other pool's (the figures are CPU figures, not a GPU cluster's).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

from jaxrl_topo.mux import report
from jaxrl_topo.mux.group import Group
from jaxrl_topo.mux.spec import JobSpec, MuxConfig, on_policy
from jaxrl_topo.runtime import experiment, loop
from jaxrl_topo.runtime.config import config_from_file, from_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = {"n_train": 400, "n_heldout": 20, "max_operand": 20}
JOBS = [("grpo_task", {}), ("dapo", {"data.source": "arithmetic", "data.task": {"name": "arithmetic", **TASK},
                                     "run.seed": 3}),
        ("grpo_task", {"data.source": "countdown", "data.task": {"name": "countdown", **TASK}, "run.seed": 5,
                       "model.overrides": {"n_layers": 3}})]


def job_cfg(i: int, steps: int, max_new_tokens: int = 24, decode_chunk: int = 2, deterministic: bool = True,
            impl: str = "auto"):
  name, own = JOBS[i]
  c = config_from_file(os.path.join(ROOT, "configs", f"{name}.py"), "tiny")
  common = {"run.steps": steps, "run.eval_every": 0, "reward.n_workers": 0, "run.sft_steps": 20,
            "run.sft_target_accuracy": 0.0, "data.batch_size": 8, "rl.group_size": 8, "rollout.n_slots": 64,
            "run.deterministic": deterministic, "reward.overlong_buffer": 3, "rollout.impl": impl,
            # longer answers in short chunks: a rollout has a tail of several chunks (long-tail migration moves it)
            "rollout.max_new_tokens": max_new_tokens, "rollout.decode_chunk": decode_chunk}
  for dotted, value in {**common, **own}.items():
    node = c
    *path, last = dotted.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  c.topology = dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2})
  return on_policy(from_config_dict(c))


def per_step(times: list[float]) -> float:
  return (times[-1] - times[0]) / (len(times) - 1)


def _pool_spans(spans: list[dict], job: str) -> list[dict]:
  """A solo run's loop spans as pool phases (rollout; logprobs + train + sync on the trainer)."""
  pool = {"rollout": "rollout", "logprobs": "train", "train": "train", "sync": "train"}
  return [{"job": job, "pool": pool[s["phase"]], "step": s["step"], "start": s["start"], "end": s["end"]}
          for s in spans if s["phase"] in pool]


def solo(i: int, steps: int, workdir: str, skip: int = 1, impl: str = "auto") -> dict:
  exp = experiment.build(job_cfg(i, steps, impl=impl), workdir)
  done, spans = [], []
  hooks = loop.LoopHooks(on_step=lambda step, m: done.append(time.perf_counter()), on_span=spans.append)
  try:
    loop.train_loop(exp, hooks=hooks)
  finally:
    exp.close()
  pooled = _pool_spans(spans, str(i))
  return {"s_per_step": per_step(done[skip - 1:]),
          "busy": report.busy_fractions(pooled, report.steady_start(pooled, skip))}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--jobs", type=int, default=3)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--migrate_at", type=float, default=0.8)
  ap.add_argument("--out", default="/tmp/mux_bench")
  ap.add_argument("--impl", default="auto", help="rollout.impl of every job (fast: a row-exact read, stragglers merge)")
  ap.add_argument("--skip", type=int, default=1, help="steady state: after every job's first SKIP steps (compiles)")
  ap.add_argument("--resize", default="off", help="comma-separated group runs: off (run.deterministic, every "
                  "rollout on the whole mesh) and/or on (mux.resize: rollouts beside a tail on the free shards)")
  args = ap.parse_args()
  if args.skip < 1:  # the steady state starts after a job's first (compiling) step, and is timed from its end
    ap.error(f"--skip={args.skip} must be >= 1")
  if args.steps < args.skip + 2:  # mux_per_step: train spans that end in the steady state, one apart at least
    ap.error(f"--steps={args.steps}: at least --skip + 2 = {args.skip + 2}, to time steps after the first --skip")
  os.makedirs(args.out, exist_ok=True)
  alone = {str(i): solo(i, args.steps, os.path.join(args.out, f"solo_{i}"), args.skip, args.impl)
           for i in range(args.jobs)}
  for resize in args.resize.split(","):
    if resize not in ("off", "on"):
      raise SystemExit(f"--resize: {resize!r} is neither 'off' nor 'on'")
    run_group(args, alone, resize == "on")


def run_group(args, alone: dict, resize: bool) -> None:
  done = {str(i): None for i in range(args.jobs)}
  tag = "resize_" if resize else ""
  group = Group([JobSpec(str(i), job_cfg(i, args.steps, deterministic=not resize, impl=args.impl),
                         os.path.join(args.out, f"mux_{tag}{i}")) for i in range(args.jobs)],
                MuxConfig(migrate_at=args.migrate_at, resize=resize), os.path.join(args.out, f"{tag}group"))
  group.build()
  results = group.run()
  assert all(r["ok"] for r in results.values()), results
  steady = report.steady_start(group.spans, args.skip)  # every job's compile-heavy first steps are over
  busy = report.busy_fractions(group.spans, steady)
  park = [s["load_s"] + s["park_s"] for s in group.spans if s["step"] >= args.skip]
  report.plot_timeline(group.spans, os.path.join(args.out, f"{tag}mux_timeline.png"),
                       title=f"{args.jobs} tiny jobs on 8 fake CPU devices (mux.migrate_at={args.migrate_at}"
                             f"{', resize' if resize else ''})")
  meta = {"device": jax.devices()[0].device_kind, "n_devices": jax.device_count(), "jax": jax.__version__,
          "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "migrate_at": args.migrate_at, "resize": resize,
          "skip": args.skip, "impl": args.impl}

  def mux_per_step(jid: str) -> float:
    return per_step([s["end"] for s in sorted(group.spans, key=lambda s: s["end"])
                     if s["job"] == jid and s["pool"] == "train" and s["end"] >= steady])

  for jid in done:
    s_mux = mux_per_step(jid)
    print(json.dumps({**meta, "job": jid, "solo_s_per_step": alone[jid]["s_per_step"], "mux_s_per_step": s_mux,
                      "slowdown": s_mux / alone[jid]["s_per_step"], "solo_busy": alone[jid]["busy"]}))
  group_sph = sum(1 / mux_per_step(j) for j in done)
  solo_sph = sum(1 / alone[j]["s_per_step"] for j in done)
  print(json.dumps({**meta, "group_busy": busy, "group_steps_per_s": group_sph,
                    "steps_per_s_alone_on_as_many_pool_pairs": solo_sph,
                    "throughput_per_pool_pair_vs_solo": group_sph / (solo_sph / args.jobs),
                    "warm_switch_s_mean": sum(park) / len(park)}))
  print(json.dumps({**meta, **migration([s for s in group.spans if s["start"] >= steady])}))


def migration(spans: list[dict]) -> dict:
  """What long-tail migration gave: rollout phases whose turn passed early, those whose stragglers moved to the
  tail engine's data shards, and what that freed (decode slot-steps, KV bytes, seconds the freed shards did
  none of the job's work while its tail ran)."""
  rolls = [s for s in spans if s["pool"] == "rollout"]
  moved = [s for s in rolls if s.get("moved_at") is not None]
  return {"rollout_phases": len(rolls), "turn_passed_early": sum(s.get("migrated_at") is not None for s in rolls),
          "stragglers_moved": len(moved), "tail_devices": moved[0]["tail_devices"] if moved else [],
          "freed_slot_steps": sum(s["freed_slot_steps"] for s in moved),
          "tail_slot_steps": sum(s["tail_steps"] * s["tail_slots"] for s in moved),
          "freed_kv_bytes_per_move": moved[0]["freed_kv_bytes"] if moved else 0,
          "freed_shard_s": sum(s["end"] - s["moved_at"] for s in moved),
          "rollouts_on_free_shards": sum(bool(s.get("on_rest")) for s in rolls),
          "on_free_shards_s": sum(s["end"] - s["start"] for s in rolls if s.get("on_rest")),
          "early_turn_s": sum(s["end"] - s["migrated_at"] for s in rolls if s.get("migrated_at") is not None)}


if __name__ == "__main__":
  main()
