"""Cost of a >= 100-job trace: multiplexed co-execution groups vs plain disaggregation vs colocated (issue 15 §7).

  python benchmarks/mux_trace.py [--spans=RUN/spans.jsonl --metrics=RUN/metrics.jsonl] [--mux_spans=G/mux_spans.jsonl]
      [--write_trace=TRACE.jsonl]    # the trace's job profiles, for `launchers/mux.py --plan=TRACE.jsonl`

Each line on stdout is one JSON record: the placement policy's cost beside the baselines', their ratios, SLO
attainment and the placement decisions, for a few values of the assumptions (node price ratio, and the
admission's extra SLO checks at shorter rollouts: placement.Cluster.check_fracs); a last record prints the
paper's numbers beside (RollMux: 1.84x over plain disaggregation, 1.38x over colocated, 100% SLO).

Calibration: with --spans (a run's spans.jsonl, e.g. `launchers/train.py` in disaggregated mode) the base job's
rates are `review/calibrate.calibrate`d from it (compile step skipped; tokens per step from --metrics; fitted as
a continuous stream when the run's config.json beside it says the loop ran one), so the trace is in that run's
time units; without, mux/trace.py BASE. The warm-switch cost is the median load + park
seconds of a group run's phases (--mux_spans, mux/report's input), else --switch_frac of the base job's
iteration (the paper: ~2 s against iterations of minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxrl_topo.mux import placement as pl  # noqa: E402
from jaxrl_topo.mux import trace as tr  # noqa: E402
from jaxrl_topo.review import calibrate, simulator  # noqa: E402
from jaxrl_topo.runtime import run  # noqa: E402

PAPER = {"vs_disaggregated": 1.84, "vs_colocated": 1.38, "slo_attainment": 1.0, "jobs": 200,
         "placed": {"pack": 0.605, "scale": 0.15, "new": 0.245}}


def base_params(spans: str | None, metrics: str | None, batch_seqs: int) -> tuple[simulator.SimParams, str]:
  if spans is None:
    return tr.BASE, "mux/trace.py BASE"
  tokens = None
  if metrics:
    with open(metrics) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    tokens = float(np.median([r["perf/tokens"] for r in rows[1:] or rows]))
  stream, eta = False, 1  # a run directory's config.json says whether its spans come from a continuous stream
  run_dir = os.path.dirname(os.path.abspath(spans))
  if os.path.isfile(os.path.join(run_dir, run.CONFIG_FILE)):
    cfg = run.load_config(run_dir)
    stream, eta = cfg.continuous_rollout, max(1, cfg.run.max_staleness)
  p = calibrate.calibrate(calibrate.load_spans(spans), batch_seqs=batch_seqs, tokens_per_step=tokens, skip_steps=1,
                          eta=eta, stream=stream)
  return p, f"calibrated from {spans}" + (" (a continuous rollout stream)" if stream else "")


def switch_s(mux_spans: str | None, base: simulator.SimParams, frac: float) -> tuple[float, str]:
  if mux_spans:
    with open(mux_spans) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    w = [r.get("load_s", 0.0) + r.get("park_s", 0.0) for r in rows if r.get("step", 0) > 0]
    if w:
      return float(np.median(w)), f"median load + park of {mux_spans}"
  solo = simulator.rollout_time(np.full(base.batch_seqs, base.median_len), base.tokens_per_s_per_device *
                                base.rollout_devices, base.per_seq_tokens_per_s) + base.train_s + base.sync_s()
  return frac * solo, f"{frac:g} x the base job's iteration"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--jobs", type=int, default=200)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--spans")
  ap.add_argument("--metrics")
  ap.add_argument("--batch_seqs", type=int, default=16, help="sequences per rollout of the calibration run")
  ap.add_argument("--mux_spans")
  ap.add_argument("--switch_frac", type=float, default=0.02)
  ap.add_argument("--write_trace", help="also write the trace's job profiles here (JSON lines)")
  args = ap.parse_args()
  base, source = base_params(args.spans, args.metrics, args.batch_seqs)
  w, w_source = switch_s(args.mux_spans, base, args.switch_frac)
  jobs = tr.synthetic_trace(tr.TraceConfig(n_jobs=args.jobs, seed=args.seed), base)
  if args.write_trace:  # with the cluster of the first row below (the switch cost in the trace's time units)
    pl.dump_trace(jobs, args.write_trace, pl.Cluster(switch_s=w))
  print(json.dumps({"base": source, "switch_s": w, "switch_source": w_source, "jobs": len(jobs),
                    "base_params": {k: v for k, v in dataclasses.asdict(base).items() if v is not None}}))
  for price in (2.0, 3.0):
    for fracs in ((), (0.75,), (0.5,)):
      cluster = pl.Cluster(rollout_node_per_h=1.0, train_node_per_h=price, switch_s=w, check_fracs=fracs)
      mux, dis, colo = tr.multiplexed(jobs, cluster), tr.disaggregated(jobs, cluster), tr.colocated(jobs, cluster)
      print(json.dumps({
          "train_to_rollout_price": price, "check_fracs": list(fracs),
          "cost": {"multiplexed": round(mux.cost, 3), "disaggregated": round(dis.cost, 3),
                   "colocated": round(colo.cost, 3)},
          "vs_disaggregated": round(dis.cost / mux.cost, 3), "vs_colocated": round(colo.cost / mux.cost, 3),
          "slo_attainment": round(mux.slo_met, 3), "colocated_slo_attainment": round(colo.slo_met, 3),
          "placed": {k: round(v / len(jobs), 3) for k, v in mux.kinds.items()},
          "decision_ms": round(mux.decide_ms, 3)}))
  print(json.dumps({"paper": PAPER}))


if __name__ == "__main__":
  main()
