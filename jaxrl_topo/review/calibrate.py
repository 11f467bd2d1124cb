"""Fits the review simulator (simulator.py) to a measured run: `calibrate(spans, ...)` turns the spans a run
wrote (`<workdir>/spans.jsonl`, read by `load_spans`) into `SimParams` whose simulated rollout, train, reward and
sync times equal the measured medians."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl_topo.review import overlap, simulator
from jaxrl_topo.review.simulator import SimParams
from jaxrl_topo.runtime.metrics import read_jsonl

_SPAN_KEYS = ("phase", "role", "devices", "step", "start", "end")


def load_spans(path: str) -> list[dict]:
  """Reads a spans.jsonl (one JSON object per line; blank lines and a torn last line of a killed run skipped)."""
  return read_jsonl(path)


def _per_step(spans: Sequence[Mapping], phase: str, skip_steps: int) -> list[float]:
  """Per step from skip_steps, the seconds a phase ran (`overlap.step_seconds`, as the overlap audit reads them):
  a step that compiled a new shape is read at the speed it ran. Before, the step's extent (last end - first
  start) counted the scoring between DAPO's rounds as decoding, and the rounds' decoding as scoring."""
  return list(overlap.seconds_by_step((s for s in spans if s["phase"] == phase), skip_steps).values())


def _validate_spans(spans: Sequence[Mapping]) -> None:
  for i, s in enumerate(spans):
    missing = [k for k in _SPAN_KEYS if k not in s]
    if missing:
      raise ValueError(f"span {i} lacks {missing}: {dict(s)}")
    if s["end"] < s["start"]:
      raise ValueError(f"span {i} ends before it starts: {dict(s)}")


def phase_median(spans: Sequence[Mapping], phase: str, skip_steps: int = 0) -> float | None:
  """Median over steps >= skip_steps of a phase's per-step seconds (`_per_step`); None if it has no such span."""
  xs = _per_step(spans, phase, skip_steps)
  return float(np.median(xs)) if xs else None


def _devices(spans: Sequence[Mapping], phase: str) -> set[int]:
  return {int(d) for s in spans if s["phase"] == phase for d in s["devices"]}


def _fit_throughput(rollout_s: float, lengths: np.ndarray, devices: int, per_seq: float | None) -> tuple[float, float]:
  """(tokens/s/device, per-seq tokens/s) whose median simulated batch time equals the measured rollout_s.

  Without a per-sequence rate, the engine is assumed to saturate exactly at batch_seqs in flight
  (p = X / B): then time scales as 1/X and the fit is closed-form. With one, X is found by bisection; where
  the per-sequence cap binds throughout (slots * p <= X) X is not identifiable and the smallest consistent X
  is returned.
  """
  B = lengths.shape[1]
  if per_seq is None:
    t1 = float(np.median([simulator.rollout_time(l, 1.0, 1.0 / B) for l in lengths]))
    X = t1 / rollout_s
    return X / devices, X / B
  t_of = lambda X: float(np.median([simulator.rollout_time(l, X, per_seq) for l in lengths]))
  if t_of(1e30) > rollout_s * (1 + 1e-9):
    raise ValueError(f"per_seq_tokens_per_s={per_seq} cannot produce the measured rollout of {rollout_s:.4g}s: "
                     f"the tail alone takes {t_of(1e30):.4g}s")
  X = _smallest_rate(t_of, rollout_s, 1e-9, 1e30, steps=100)
  return X / devices, per_seq


def _smallest_rate(t_of, target_s: float, lo: float, hi: float, steps: int) -> float:
  """Bisection on a log scale for the smallest rate X in [lo, hi] whose simulated time t_of(X) is <= target_s
  (t_of falls as X rises)."""
  for _ in range(steps):
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if t_of(mid) > target_s else (lo, mid)
  return hi


def tile_rollouts(spans: Sequence[Mapping]) -> list[dict]:
  """The spans with their rollout spans (one per step) as a continuous rollout stream records them
  (runtime/rollout_side.Feed.take): batches are returned in order, so batch k's span ends no earlier than batch
  k-1's, and it starts when the batch joined or when batch k-1's span ended, if later. Such spans tile the
  stream's busy time: a tail that overlapped the next batch counts once."""
  tiled, last = [], -math.inf
  for s in sorted((s for s in spans if s["phase"] == "rollout"), key=lambda s: s["step"]):
    end = max(s["end"], last)
    tiled.append({**s, "start": max(s["start"], last), "end": end})
    last = end
  return [dict(s) for s in spans if s["phase"] != "rollout"] + tiled


def stream_mean(tiles: Sequence[float], cap: float = 3.0) -> float:
  """The mean of a stream's per-step tiles, each counted at most `cap` times the median non-empty tile: the
  stream's busy time per batch, except that one batch slowed by something besides decoding (host work, a compile
  outside the listener's events, another process on the same cores) does not set the rate. The same statistic
  is taken of the simulated stream, so a long tail the simulator models is clipped alike on both sides."""
  busy = [t for t in tiles if t > 0]
  if not busy:
    return 0.0
  limit = cap * float(np.median(busy))
  return float(np.mean(np.minimum(np.asarray(tiles, dtype=float), limit)))


def _fit_stream(rollout_s: float, probe: SimParams, devices: int, per_seq: float | None,
                n_steps: int = 48) -> tuple[float, float]:
  """(tokens/s/device, per-seq tokens/s) at which the simulated stream (async at probe.eta on `devices` rollout
  devices: no drain, batch k admitted once weights k - eta exist) tiles its busy time into batches whose
  mean, after the first quarter of n_steps, is the measured mean rollout_s (both `stream_mean`). The mean, not
  the median: the stream's busy time falls as the rate rises, but a single tile need not (a faster stream waits
  for the trainer more often, and a batch that joins late carries its tail alone)."""
  B = probe.batch_seqs

  def t_of(X: float) -> float:
    p = dataclasses.replace(probe, rollout_devices=devices, tokens_per_s_per_device=X / devices,
                            per_seq_tokens_per_s=per_seq or X / B)
    tiled = tile_rollouts(simulator.simulate("async", p, n_steps).to_span_dicts())
    return stream_mean(_per_step(tiled, "rollout", n_steps // 4))

  X0 = float(np.sum(simulator.sample_lengths(probe, 1))) / rollout_s  # about the busy rate
  lo, hi = X0 * 1e-3, X0 * 1e3
  if t_of(hi) > rollout_s:
    raise ValueError(f"per_seq_tokens_per_s={per_seq} cannot produce the measured rollout of {rollout_s:.4g}s "
                     f"per batch in a stream")
  X = _smallest_rate(t_of, rollout_s, lo, hi, steps=60)
  return X / devices, per_seq or X / B


def calibrate(spans: Sequence[Mapping], *, batch_seqs: int, tokens_per_step: float | None = None,
              median_len: float | None = None, sigma: float = 0.0, max_ratio: float = 30.0,
              per_seq_tokens_per_s: float | None = None, sync_bytes: float | None = None,
              link_gbps: float | None = None, sync_latency_s: float = 0.0, switch_s: float = 0.0,
              eta: int = 1, rollout_devices: int | None = None, skip_steps: int = 0, seed: int = 0,
              stream: bool = False) -> SimParams:
  """SimParams from a measured run's spans (median per-step durations of rollout, reward, logprobs + train, sync).

  Tokens per step: `tokens_per_step`, else the median per-step sum of a `tokens` field on rollout spans, else
  batch_seqs * median_len * E[L]/m. The median length follows from the tokens (or is given). Throughput is
  fitted so the simulated rollout reproduces the measured one at the measured rollout device count. Sync:
  without sync_bytes the measured time becomes a pure latency; with sync_bytes and no link_gbps the link is
  solved for; with both, the latency is what is left. A run whose rollout and train devices coincide was
  colocated: its split (for the disjoint modes) defaults to half the devices.

  `stream=True`: the spans come from a continuous rollout stream (`RunConfig.continuous_rollout`: the loop's
  disaggregated and async modes). Their rollout spans tile the stream's busy time (`tile_rollouts`), with
  each batch's tail overlapping the next batch, so a span is not a batch decoded alone. The rate is then
  fitted so that the simulator's stream (its async mode at `eta`) tiles the same way to the measured mean
  (`stream_mean`: an outlying batch counts at three times the median).
  """
  _validate_spans(spans)
  med = {ph: phase_median(spans, ph, skip_steps) for ph in ("rollout", "reward", "logprobs", "train", "sync")}
  rollout_s, train_s = med["rollout"], med["train"]
  if train_s is not None and med["logprobs"] is not None:  # the simulator's train phase includes the pre-pass
    train_s += med["logprobs"]
  if rollout_s is None or train_s is None:
    r, t = (sorted({s["step"] for s in spans if s["phase"] == ph}) or "none" for ph in ("rollout", "train"))
    skip = f"; the fit skips the first {skip_steps}, whose spans hold compiles" if skip_steps else ""
    raise ValueError(f"no step from step {skip_steps} on has both a rollout and a train span (rollout spans: steps "
                     f"{r}; train spans: steps {t}{skip}): review a run that has finished at least {skip_steps + 1} "
                     "step(s)")
  r_dev, t_dev = _devices(spans, "rollout"), _devices(spans, "train")
  if not r_dev or not t_dev:
    raise ValueError("rollout and train spans must list their devices")
  n_devices = len(r_dev | t_dev | _devices(spans, "sync"))
  split = rollout_devices or (max(1, n_devices // 2) if r_dev == t_dev else len(r_dev))
  tok = [sum(float(s.get("tokens", 0)) for s in spans if s["phase"] == "rollout" and s["step"] == k)
         for k in sorted({s["step"] for s in spans if s["phase"] == "rollout" and s["step"] >= skip_steps})]
  tokens_per_step = tokens_per_step or (float(np.median(tok)) if tok and min(tok) > 0 else None)
  mean_ratio = simulator.clipped_lognormal_mean_ratio(sigma, max_ratio)
  if median_len is None:
    if tokens_per_step is None:
      raise ValueError("calibrate needs tokens_per_step (or spans with a `tokens` field) or median_len")
    median_len = tokens_per_step / (batch_seqs * mean_ratio)
  probe = SimParams(n_devices=n_devices, rollout_devices=split, batch_seqs=batch_seqs, median_len=median_len,
                    tokens_per_s_per_device=1.0, per_seq_tokens_per_s=1.0, train_s=train_s,
                    train_devices=len(t_dev), sigma=sigma, max_ratio=max_ratio, seed=seed)
  sync = _fit_sync(med["sync"] or 0.0, sync_bytes, link_gbps, sync_latency_s)
  probe = dataclasses.replace(probe, **sync, switch_s=switch_s, reward_s=med["reward"] or 0.0, eta=eta)
  if stream:
    if r_dev & t_dev:
      raise ValueError("stream=True: a continuous rollout stream runs on its own devices, but these spans' "
                       "rollout and train devices overlap (a colocated run)")
    rollout_s = stream_mean(_per_step(spans, "rollout", skip_steps))
    tps, per_seq = _fit_stream(rollout_s, probe, len(r_dev), per_seq_tokens_per_s)
  else:
    tps, per_seq = _fit_throughput(rollout_s, simulator.sample_lengths(probe, 64), len(r_dev), per_seq_tokens_per_s)
  return dataclasses.replace(probe, tokens_per_s_per_device=tps, per_seq_tokens_per_s=per_seq)


def _fit_sync(sync_s: float, sync_bytes: float | None, link_gbps: float | None, latency_s: float) -> dict:
  if not sync_bytes:
    return {"sync_bytes": 0.0, "link_gbps": link_gbps or 100.0, "sync_latency_s": sync_s}
  if link_gbps is None:
    if sync_s <= latency_s:
      raise ValueError(f"measured sync {sync_s:.4g}s leaves no transfer time after sync_latency_s={latency_s}")
    return {"sync_bytes": sync_bytes, "link_gbps": sync_bytes * 8 / ((sync_s - latency_s) * 1e9),
            "sync_latency_s": latency_s}
  latency = sync_s - sync_bytes * 8 / (link_gbps * 1e9)
  if latency < -1e-9:
    raise ValueError(f"{sync_bytes} bytes at {link_gbps} Gbit/s take longer than the measured sync {sync_s:.4g}s")
  return {"sync_bytes": sync_bytes, "link_gbps": link_gbps, "sync_latency_s": max(latency, 0.0)}
