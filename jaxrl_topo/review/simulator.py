"""Steps per hour of an RL run in each mode: a discrete-event simulator (issue 7 §4).

The model of one RL step k (units: tokens, seconds, bytes):

  rollout   B = batch_seqs sequences, lengths L ~ lognormal(median m, sigma) clipped to [1, max_ratio * m]
            (fresh lengths per step, from `seed`; the same lengths in every mode, so modes compare paired).
            Decoding is continuous batching with processor sharing: while n sequences are in flight each
            advances at r(n) = min(p, X / n) tokens/s, with X = tokens_per_s_per_device * rollout devices the
            engine's throughput and p = per_seq_tokens_per_s one sequence's decode rate. At most
            max_inflight_seqs (default B) sequences are in flight, so the engine's best rate is
            min(X, slots * p). A batch of B <= slots sequences decoded alone takes
                R = sum_i (l_(i) - l_(i-1)) / r(B - i + 1)      (l sorted ascending, l_(0) = 0)
            which is >= max(sum(L) / X, max(L) / p): the throughput bound and the tail bound. With constant
            lengths (sigma = 0) R = max(B m / X, m / p) exactly.
  reward    reward_s after the batch's last sequence (on reward workers: it delays training, not decoding).
  train     T(d) = train_s * train_devices / d on d trainer devices (ideal scaling).
  sync      S = sync_latency_s + sync_bytes * 8 / (link_gbps * 1e9); colocated uses local_link_gbps (a local
            reshard) when set. The trainer sends it; the rollout side swaps weights between decode chunks.
  switch    colocated only: switch_s per step (release the KV pool, reload optimizer state, and back).

The modes differ only in when batch k may start decoding (its admission gate) and which devices run what:

  colocated      all n devices do both, in turn: rollout k, reward, switch, train k, sync k, then rollout k+1.
                 Step time = R(n) + reward_s + switch_s + T(n) + S_local.
  disaggregated  rollout on `rollout_devices`, training on the other n - rollout_devices, pipelined eta steps
                 deep: batch k starts when batch k-1 finished decoding (the engine drains) and weights k-eta
                 have landed (sync k-1-eta ended). At eta = 1 (one step off) the steady state is max(R, T + S)
                 (and >= (R + reward + T + S) / 2); eta = 0 is sequential, R + reward + T + S.
  async          disjoint devices, decoding never drains: a freed slot takes the next batch's sequence as soon
                 as that batch is allowed, i.e. once sync k-1-eta ended (weights version k-eta exist), so the
                 producer is at most eta versions ahead. While batch k's stragglers finish, batch k+1 decodes:
                 the tail is absorbed and the rate approaches the throughput bound sum(L) / X, limited by
                 T + S and by the staleness cycle (tail + reward + T + S) / (eta + 1). eta = 0 is the
                 sequential on-policy loop R + reward + T + S.

The trainer consumes batches in order: train k starts at max(batch k decoded + reward_s, sync k-1 ended).
`simulate(mode, params, n_steps)` runs the event loop and returns a `Timeline` of spans (phase, role, step,
start, end, gen_id); step k is done when its sync ends; steps/hour = n_steps / makespan * 3600, or, in
steady state, (n_steps - warmup) / (done[n-1] - done[warmup-1]) * 3600. `calibrate.calibrate` fits SimParams
to the spans a real run wrote (`<workdir>/spans.jsonl`), `sweep_split` moves the rollout/trainer split; review/plots.py
draws the Gantt charts and the sweep.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable, Sequence

import numpy as np

MODES = ("colocated", "disaggregated", "async")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimParams:
  """One cluster and workload. Throughputs in tokens/s, times in s, bytes in bytes, links in Gbit/s."""

  n_devices: int
  rollout_devices: int  # the split for disaggregated/async; trainer gets the rest. Colocated uses all.
  batch_seqs: int
  median_len: float
  tokens_per_s_per_device: float
  per_seq_tokens_per_s: float
  train_s: float  # seconds per train step on `train_devices` devices
  train_devices: int
  sync_bytes: float = 0.0
  link_gbps: float = 100.0
  sync_latency_s: float = 0.0
  local_link_gbps: float | None = None  # colocated weight sync (local reshard); None: link_gbps
  switch_s: float = 0.0
  reward_s: float = 0.0
  max_inflight_seqs: int | None = None  # the engine's continuous-batching slots; None: batch_seqs
  eta: int = 1
  max_ratio: float = 30.0
  sigma: float = 1.0
  seed: int = 0

  def __post_init__(self):
    for name in ("n_devices", "rollout_devices", "batch_seqs", "train_devices", "eta", "seed"):
      if not isinstance(getattr(self, name), int | np.integer):
        raise TypeError(f"SimParams.{name} must be an int, got {getattr(self, name)!r}")
    for name in ("n_devices", "rollout_devices", "batch_seqs", "train_devices", "median_len",
                 "tokens_per_s_per_device", "per_seq_tokens_per_s", "link_gbps"):
      if not getattr(self, name) > 0:
        raise ValueError(f"SimParams.{name} must be > 0, got {getattr(self, name)!r}")
    for name in ("train_s", "sync_bytes", "sync_latency_s", "switch_s", "reward_s", "eta", "sigma"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"SimParams.{name} must be >= 0, got {getattr(self, name)!r}")
    if self.rollout_devices > self.n_devices:
      raise ValueError(f"rollout_devices={self.rollout_devices} exceeds n_devices={self.n_devices}")
    if self.max_ratio < 1:
      raise ValueError(f"SimParams.max_ratio must be >= 1 (a multiple of the median), got {self.max_ratio}")
    if self.max_inflight_seqs is not None and not self.max_inflight_seqs >= 1:
      raise ValueError(f"SimParams.max_inflight_seqs must be >= 1 or None, got {self.max_inflight_seqs}")
    if self.local_link_gbps is not None and not self.local_link_gbps > 0:
      raise ValueError(f"SimParams.local_link_gbps must be > 0 or None, got {self.local_link_gbps}")

  @property
  def slots(self) -> int:
    return self.max_inflight_seqs or self.batch_seqs

  @property
  def trainer_devices(self) -> int:
    return self.n_devices - self.rollout_devices

  def train_s_per_step_at(self, devices: int) -> float:
    """T(d) = train_s * train_devices / d: ideal data-parallel scaling from the measured point."""
    if devices <= 0:
      raise ValueError(f"train needs at least one device, got {devices}")
    return self.train_s * self.train_devices / devices

  def sync_s(self, local: bool = False) -> float:
    gbps = self.local_link_gbps if local and self.local_link_gbps is not None else self.link_gbps
    return self.sync_latency_s + self.sync_bytes * 8.0 / (gbps * 1e9)


@dataclasses.dataclass(frozen=True)
class Span:
  phase: str  # rollout | reward | switch | train | sync
  role: str  # colocated | rollout | reward | trainer
  step: int
  start: float
  end: float
  gen_id: int | None = None  # rollout: the weight version the batch started decoding under


@dataclasses.dataclass(frozen=True)
class Timeline:
  mode: str
  params: SimParams
  spans: tuple[Span, ...]
  lengths: np.ndarray  # [n_steps, batch_seqs] tokens, as sampled

  @property
  def n_steps(self) -> int:
    return self.lengths.shape[0]

  def of(self, phase: str) -> list[Span]:
    return sorted((s for s in self.spans if s.phase == phase), key=lambda s: s.step)

  def step_done(self) -> np.ndarray:
    """When each step's new weights are out (its sync ended)."""
    return np.array([s.end for s in self.of("sync")])

  @property
  def makespan(self) -> float:
    return max(s.end for s in self.spans)

  def steps_per_hour(self, warmup: int = 0) -> float:
    """n_steps / makespan * 3600 (warmup=0), or the steady-state rate after `warmup` steps."""
    if not 0 <= warmup < self.n_steps:
      raise ValueError(f"warmup must lie in [0, {self.n_steps}), got {warmup}")
    if warmup == 0:
      return self.n_steps / self.makespan * 3600.0
    done = self.step_done()
    return (self.n_steps - warmup) / (done[-1] - done[warmup - 1]) * 3600.0

  def max_staleness(self) -> int:
    return max(s.step - s.gen_id for s in self.of("rollout"))

  def to_span_dicts(self) -> list[dict]:
    """The controller's spans.jsonl format (devices: rollout 0..r-1, trainer r..n-1, colocated all)."""
    p = self.params
    devices = {"colocated": list(range(p.n_devices)), "rollout": list(range(p.rollout_devices)),
               "trainer": list(range(p.rollout_devices, p.n_devices)), "reward": []}
    return [{"phase": s.phase, "role": s.role, "devices": devices[s.role], "step": s.step,
             "gen_id": s.step if s.gen_id is None else s.gen_id, "start": s.start, "end": s.end}
            for s in self.spans]


# ------------------------------------------------------------------------------------------------ the model


def sample_lengths(params: SimParams, n_steps: int) -> np.ndarray:
  """[n_steps, batch_seqs] lognormal lengths with the given median, clipped to [1, max_ratio * median]."""
  z = np.random.default_rng(params.seed).standard_normal((n_steps, params.batch_seqs))
  return np.clip(params.median_len * np.exp(params.sigma * z), 1.0, params.max_ratio * params.median_len)


def rollout_time(lengths: np.ndarray, throughput: float, per_seq: float) -> float:
  """Seconds to decode one batch alone under processor sharing r(n) = min(per_seq, throughput / n)."""
  l = np.sort(np.asarray(lengths, dtype=np.float64))
  n_active = np.arange(len(l), 0, -1)
  return float(np.sum(np.diff(l, prepend=0.0) / np.minimum(per_seq, throughput / n_active)))


def _check_mode(mode: str, params: SimParams) -> None:
  if mode not in MODES:
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
  if mode != "colocated" and params.trainer_devices < 1:
    raise ValueError(f"{mode} needs disjoint devices: rollout_devices={params.rollout_devices} leaves no trainer "
                     f"device out of n_devices={params.n_devices}")


class _Trainer:
  """The trainer side: consumes decoded batches in order and records reward/switch/train/sync spans."""

  def __init__(self, mode: str, params: SimParams, n_steps: int):
    colocated = mode == "colocated"
    self.role = "colocated" if colocated else "trainer"
    self.reward_role = "colocated" if colocated else "reward"
    self.switch_s = params.switch_s if colocated else 0.0
    self.reward_s = params.reward_s
    self.train_s = params.train_s_per_step_at(params.n_devices if colocated else params.trainer_devices)
    self.sync_s = params.sync_s(local=colocated)
    self.decoded: list[float | None] = [None] * n_steps
    self.sync_end: list[float] = []
    self.spans: list[Span] = []

  def batch_decoded(self, k: int, t: float) -> None:
    self.decoded[k] = t
    while len(self.sync_end) < len(self.decoded) and self.decoded[len(self.sync_end)] is not None:
      self._train(len(self.sync_end))

  def _train(self, k: int) -> None:
    t = self.decoded[k]
    for phase, role, dur in (("reward", self.reward_role, self.reward_s), ("switch", self.role, self.switch_s)):
      if dur > 0:
        self.spans.append(Span(phase, role, k, t, t + dur))
        t += dur
    start = max(t, self.sync_end[k - 1] if k else 0.0)
    self.spans.append(Span("train", self.role, k, start, start + self.train_s))
    self.spans.append(Span("sync", self.role, k, start + self.train_s, start + self.train_s + self.sync_s))
    self.sync_end.append(start + self.train_s + self.sync_s)


def _gate(mode: str, k: int, eta: int, trainer: _Trainer) -> float | None:
  """Earliest time batch k may start decoding, or None while it depends on events not yet simulated."""
  if mode == "colocated":
    need, drain = k - 1, False  # weights k must exist: sync k-1 (which follows batch k-1)
  elif mode == "disaggregated":
    need, drain = k - 1 - eta, True  # weights k-eta (eta = 1: one step off); the engine drains between batches
  else:
    need, drain = k - 1 - eta, False  # at most eta versions behind
  times = [0.0]
  if need >= 0:
    if need >= len(trainer.sync_end):
      return None
    times.append(trainer.sync_end[need])
  if drain and k > 0:
    if trainer.decoded[k - 1] is None:
      return None
    times.append(trainer.decoded[k - 1])
  return max(times)


def simulate(mode: str, params: SimParams, n_steps: int = 48) -> Timeline:
  """Runs the event loop (sequence completions and admission gates) for n_steps RL steps."""
  _check_mode(mode, params)
  if n_steps < 1:
    raise ValueError(f"n_steps must be >= 1, got {n_steps}")
  lengths = sample_lengths(params, n_steps)
  B, slots = params.batch_seqs, params.slots
  X = params.tokens_per_s_per_device * (params.n_devices if mode == "colocated" else params.rollout_devices)
  rate = lambda n: min(params.per_seq_tokens_per_s, X / n)
  trainer = _Trainer(mode, params, n_steps)
  # Uniform rate for all in-flight sequences, so each finishes at a fixed point of the shared "virtual" clock V.
  t, V, heap, left = 0.0, 0.0, [], [B] * n_steps
  nxt_batch, nxt_seq, first, gen_ids = 0, 0, [0.0] * n_steps, [0] * n_steps
  while len(trainer.sync_end) < n_steps:
    gate = _gate(mode, nxt_batch, params.eta, trainer) if nxt_batch < n_steps else None
    while gate is not None and gate <= t and len(heap) < slots:
      if nxt_seq == 0:
        first[nxt_batch] = t
        gen_ids[nxt_batch] = sum(1 for e in trainer.sync_end if e <= t)
      heapq.heappush(heap, (V + lengths[nxt_batch, nxt_seq], nxt_batch))
      nxt_seq += 1
      if nxt_seq == B:
        nxt_batch, nxt_seq = nxt_batch + 1, 0
        gate = _gate(mode, nxt_batch, params.eta, trainer) if nxt_batch < n_steps else None
    t_done = t + (heap[0][0] - V) / rate(len(heap)) if heap else math.inf
    t_gate = gate if gate is not None and gate > t and len(heap) < slots else math.inf
    if t_gate < t_done:
      V, t = V + (t_gate - t) * (rate(len(heap)) if heap else 0.0), t_gate
      continue
    if not heap:
      raise RuntimeError(f"simulation stalled at t={t} before batch {nxt_batch} (a bug: no pending event)")
    V, t = heap[0][0], t_done
    while heap and heap[0][0] <= V:
      _, k = heapq.heappop(heap)
      left[k] -= 1
      if left[k] == 0:
        trainer.batch_decoded(k, t)
  role = "colocated" if mode == "colocated" else "rollout"
  spans = [Span("rollout", role, k, first[k], trainer.decoded[k], gen_ids[k]) for k in range(n_steps)]
  spans = sorted(spans + trainer.spans, key=lambda s: (s.start, s.step))
  return Timeline(mode=mode, params=params, spans=tuple(spans), lengths=lengths)


def steps_per_hour(mode: str, params: SimParams, n_steps: int = 48, warmup: int | None = None) -> float:
  """Steady-state steps/hour: simulate n_steps, drop the first `warmup` (default n_steps // 4)."""
  warmup = n_steps // 4 if warmup is None else warmup
  return simulate(mode, params, n_steps).steps_per_hour(warmup)


def sweep_split(params: SimParams, splits: Iterable[int], modes: Sequence[str] = MODES,
                n_steps: int = 48) -> dict[int, dict[str, float]]:
  """{rollout_devices: {mode: steps/hour}}; colocated ignores the split (a flat reference line)."""
  out = {}
  for split in splits:
    p = dataclasses.replace(params, rollout_devices=int(split))
    out[int(split)] = {mode: steps_per_hour(mode, p, n_steps) for mode in modes}
  return out


def clipped_lognormal_mean_ratio(sigma: float, max_ratio: float) -> float:
  """E[min(X, c)] / m for X = m exp(sigma Z), c = max_ratio * m (the 1-token lower clip is ignored)."""
  if sigma == 0:
    return 1.0
  Phi = lambda x: 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
  lc = math.log(max_ratio)
  return math.exp(sigma**2 / 2) * Phi((lc - sigma**2) / sigma) + max_ratio * (1.0 - Phi(lc / sigma))
