"""A synthetic trace of RL jobs, replayed three ways: plain disaggregation, colocated, multiplexed groups.

`synthetic_trace` draws jobs of mixed model sizes and response lengths. Each job's phase times come from
the review simulator (review/simulator.py): its rollout phase is `rollout_time` of a batch at max tokens
(admission's worst case) and, for the replay, the mean over steps of batches of lognormal lengths
clipped at max tokens (`sample_lengths`), on the job's rollout nodes; train and sync scale with the
model size and the tokens. The base rates are a `SimParams` (by default `BASE`, else calibrated from a
measured run's spans with `calibrate.calibrate`), so the trace is in that run's time units.

`replay` runs the trace through time: jobs arrive, are placed (mux/placement.py Placer, worst-case
profiles), run at their group's actual round-robin period (recomputed whenever a group changes), and
leave after their iterations; a group's nodes are paid while it has members. The baselines run every
job alone: plain disaggregation on its rollout + train nodes for iters * (R + T + S); colocated on its
train nodes only, rollout there taking R * rollout_nodes / train_nodes (same per-device decode rate:
an assumption) plus a `colocated_switch_s` per iteration (offload the KV pool, reload the optimizer).
A job meets its SLO when its completion time is at most slo times its plain-disaggregation time.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxrl_topo.mux import placement as pl
from jaxrl_topo.review import calibrate, simulator

# Tiny-model rates, in the ballpark of a CPU run of configs/grpo_task.py:tiny; replace with calibrate().
BASE = simulator.SimParams(n_devices=8, rollout_devices=4, batch_seqs=64, median_len=6.0, tokens_per_s_per_device=400.0,
                           per_seq_tokens_per_s=40.0, train_s=0.5, train_devices=4, sync_latency_s=0.05)

# (name, size multiplier over the base model, train nodes, rollout nodes, host GB per unit), after the
# paper's Qwen 3B-32B mix; node counts double with the size class.
SIZES = (("3b", 1.0, 1, 1, 60.0), ("7b", 2.3, 1, 1, 140.0), ("14b", 4.7, 2, 2, 280.0), ("32b", 10.7, 4, 4, 640.0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceConfig:
  n_jobs: int = 120
  seed: int = 0
  length_scales: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)  # response lengths over the base's (the paper: 4k-32k)
  max_over_median: float = 4.0  # max tokens / the median response length
  sigma: float = 1.0  # lognormal spread of actual lengths (clipped at max tokens)
  mean_gap_s: float = 0.0  # mean arrival gap; 0: a tenth of the mean job's solo iteration
  iters: tuple[int, int] = (100, 400)
  slo: tuple[float, float] = (1.0, 2.0)  # uniform, as the paper's trace


def job_profile(name: str, base: simulator.SimParams, *, size: float, train_nodes: int, rollout_nodes: int,
                length_scale: float, max_ratio: float, sigma: float, slo: float, host_gb: float, arrival_s: float,
                iters: int, seed: int) -> pl.JobProfile:
  """Phase times of one job from the simulator's rollout model (module docstring). `base` holds one base-size
  job on one node: its rollout devices decode, its train devices train."""
  tps = base.tokens_per_s_per_device * base.rollout_devices * rollout_nodes / size
  per_seq = base.per_seq_tokens_per_s / size
  median = base.median_len * length_scale
  worst = simulator.rollout_time(np.full(base.batch_seqs, median * max_ratio), tps, per_seq)
  p = dataclasses.replace(base, median_len=median, sigma=sigma, max_ratio=max_ratio, seed=seed)
  actual = float(np.mean([simulator.rollout_time(x, tps, per_seq) for x in simulator.sample_lengths(p, 8)]))
  tokens_ratio = length_scale * simulator.clipped_lognormal_mean_ratio(sigma, max_ratio)  # over the base's tokens
  train = base.train_s * size * tokens_ratio / train_nodes
  return pl.JobProfile(job=name, rollout_s=worst, train_s=train, sync_s=base.sync_s() * size,
                       rollout_nodes=rollout_nodes, train_nodes=train_nodes, slo=slo, host_bytes=int(host_gb * 2**30),
                       arrival_s=arrival_s, iters=iters, actual_frac=min(1.0, actual / worst))


def synthetic_trace(cfg: TraceConfig, base: simulator.SimParams = BASE) -> list[pl.JobProfile]:
  rng = np.random.default_rng(cfg.seed)
  draws = [(SIZES[rng.integers(len(SIZES))], float(rng.choice(cfg.length_scales)), float(rng.uniform(*cfg.slo)),
            int(rng.integers(cfg.iters[0], cfg.iters[1] + 1))) for _ in range(cfg.n_jobs)]
  jobs = []
  for i, ((name, size, tn, rn, host), scale, slo, iters) in enumerate(draws):
    jobs.append(job_profile(f"j{i:03d}-{name}", base, size=size, train_nodes=tn, rollout_nodes=rn, length_scale=scale,
                            max_ratio=cfg.max_over_median, sigma=cfg.sigma, slo=slo, host_gb=host, arrival_s=0.0,
                            iters=iters, seed=cfg.seed + i))
  gap = cfg.mean_gap_s or 0.1 * float(np.mean([j.solo_s for j in jobs]))
  arrivals = np.cumsum(rng.exponential(gap, cfg.n_jobs)) - gap
  return [dataclasses.replace(j, arrival_s=float(max(a, 0.0))) for j, a in zip(jobs, arrivals, strict=True)]


@dataclasses.dataclass(frozen=True)
class Replay:
  cost: float  # $ over the whole trace
  span_s: float  # first arrival to last completion
  jct_s: dict  # job -> completion time
  slo_met: float  # fraction of jobs within their SLO against running alone (plain disaggregation)
  kinds: dict  # placement decisions: pack / scale / new -> count
  decide_ms: float  # mean placement decision time


def solo_jct(j: pl.JobProfile) -> float:
  return j.iters * pl.solo_s(j, actual=True)


def disaggregated(jobs, cluster: pl.Cluster) -> Replay:
  cost = sum(solo_jct(j) * (j.rollout_nodes * cluster.rollout_node_per_h + j.train_nodes * cluster.train_node_per_h)
             for j in jobs) / 3600.0
  return Replay(cost, _span(jobs, {j.job: solo_jct(j) for j in jobs}), {j.job: solo_jct(j) for j in jobs}, 1.0, {}, 0.0)


def colocated(jobs, cluster: pl.Cluster, colocated_switch_s: float = 0.0) -> Replay:
  jct = {j.job: j.iters * (j.rollout_s * j.actual_frac * j.rollout_nodes / j.train_nodes + j.train_s + j.sync_s
                           + colocated_switch_s) for j in jobs}
  cost = sum(jct[j.job] * j.train_nodes * cluster.train_node_per_h for j in jobs) / 3600.0
  met = np.mean([jct[j.job] <= j.slo * solo_jct(j) * (1 + 1e-9) for j in jobs])
  return Replay(cost, _span(jobs, jct), jct, float(met), {}, 0.0)


def _span(jobs, jct: dict) -> float:
  return max(j.arrival_s + jct[j.job] for j in jobs) - min(j.arrival_s for j in jobs)


def multiplexed(jobs, cluster: pl.Cluster) -> Replay:
  """Fluid replay: between events every member advances at 1 / its group's actual period."""
  placer = pl.Placer(cluster)
  pending = sorted(jobs, key=lambda j: j.arrival_s)
  left = {}  # job -> iterations left
  group_of, rate, jct, kinds, decide = {}, {}, {}, {k: 0 for k in pl.KINDS}, []
  by_id = {j.job: j for j in jobs}
  now, cost = pending[0].arrival_s, 0.0

  def rerate(i: int) -> None:
    g = placer.groups[i]
    if g is not None:
      for m, period in zip(g.members, pl.periods(g, cluster.switch_s, actual=True), strict=True):
        rate[m.job] = 1.0 / period

  while pending or left:
    t_arrive = pending[0].arrival_s if pending else np.inf
    t_leave, who = min(((now + left[j] / rate[j], j) for j in left), default=(np.inf, None))
    t = min(t_arrive, t_leave)
    cost += placer.cost_per_h() * (t - now) / 3600.0
    for j in left:
      left[j] -= rate[j] * (t - now)
    now = t
    if t_leave <= t_arrive:
      del left[who]
      jct[who] = now - by_id[who].arrival_s
      rerate(placer.remove(who))
    else:
      job = pending.pop(0)
      t0 = time.perf_counter()
      d = placer.place(job)
      decide.append(time.perf_counter() - t0)
      kinds[d.kind] += 1
      group_of[job.job], left[job.job] = d.group, float(job.iters)
      rerate(d.group)
  met = np.mean([jct[j.job] <= j.slo * solo_jct(j) * (1 + 1e-6) for j in jobs])
  return Replay(cost, _span(jobs, jct), jct, float(met), kinds, 1e3 * float(np.mean(decide)))


def profile_from_spans(spans, *, job: str, batch_seqs: int, max_tokens: float, tokens_per_step: float | None = None,
                       slo: float = 1.2, host_bytes: int = 0, rollout_nodes: int = 1, train_nodes: int = 1,
                       skip_steps: int = 1) -> pl.JobProfile:
  """A job's admission profile from a short calibration run's spans: the simulator is calibrated on them
  (`calibrate.calibrate`), then asked for a rollout with every response at `max_tokens` (the worst case),
  and train time is scaled from the measured tokens to max-token batches (train time ~ tokens)."""
  p = calibrate.calibrate(spans, batch_seqs=batch_seqs, tokens_per_step=tokens_per_step, skip_steps=skip_steps)
  tps = p.tokens_per_s_per_device * p.rollout_devices
  worst = simulator.rollout_time(np.full(batch_seqs, float(max_tokens)), tps, p.per_seq_tokens_per_s)
  measured = simulator.rollout_time(simulator.sample_lengths(p, 1)[0], tps, p.per_seq_tokens_per_s)
  tokens = p.batch_seqs * p.median_len * simulator.clipped_lognormal_mean_ratio(p.sigma, p.max_ratio)
  return pl.JobProfile(job=job, rollout_s=worst, train_s=p.train_s * batch_seqs * max_tokens / tokens,
                       sync_s=p.sync_s(), rollout_nodes=rollout_nodes, train_nodes=train_nodes, slo=slo,
                       host_bytes=host_bytes, actual_frac=min(1.0, measured / worst))
