"""Data-path review, part two: where staleness is bounded and which phases overlap.

Two audits of a run (the overlap one lives in review/overlap.py), both plain data in and a frozen report
out (`to_dict` for JSON, `to_markdown` for humans):

  staleness_audit(cfg, histograms)   the configured bound eta and WHERE runtime/loop.py enforces it, what a
                                     generation in flight does when weights land, whether the loss corrects the
                                     sampler/trainer gap, and the weight-lag histogram the run observed.
                                     `check_staleness(report)` raises if any observed lag exceeds eta.
  overlap_audit(spans, predicted)    per-phase seconds (total and per-step median), which phase pairs overlapped
                                     in time and by how much, which ran serialised, each side's idle fraction,
                                     and measured per-step medians against a prediction (phases > tolerance off
                                     are flagged).

`read_run(workdir)` reads what a run leaves behind (config.json, spans.jsonl, metrics.jsonl, histograms.jsonl;
runtime/run.py and runtime/metrics.py). Span times are seconds since the run's start. Everything here is host
Python: no JAX, and the runtime modules (which import JAX) are only imported by `read_run`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from jaxrl_topo.runtime.config import RunConfig

from jaxrl_topo.review.overlap import PHASES, OverlapReport, overlap_audit  # noqa: F401  (audit's public API)

# ---------------------------------------------------------------- §2 staleness: what the code does, per mode

_PACING = ("runtime/loop.py train_loop: batch k is started only when the trainer has reached version k - eta "
           "(batch by batch: the `produced <= version + eta` check, so the ready queue never holds more than eta + 1 "
           "batches: `len(ready) <= eta`; continuous rollout: batch k joins the open stream (runtime/rollout_side.py "
           "Feed.top_up) only once k <= version + eta, and versions only grow, so no later admission can break it); "
           "each step's lag (trainer version minus each token's gen_id) is checked after "
           "landing (`land`: staleness/max > eta raises AssertionError naming the step)")

_MODE_ENFORCEMENT = {
    "colocated": "RunConfig forces eta = 0 for colocated: rollout k, train k and the weight sync run in "
                 "sequence on one device set, so batch k is always sampled under version k.",
    "disaggregated": "Rollout of batch k+1 runs on the rollout devices while train step k is dispatched but not "
                     "awaited; step k's weights land between batches, so with eta = 1 batch k+1 is exactly one "
                     "version behind (eta = 0: fully sequential).",
    "async": "Rollout batches run back to back; a train step's weights land between decode chunks: at the first "
             "chunk boundary after the step finished on its devices (with run.deterministic=True, and always "
             "across processes: after run.land_after_chunks={chunks} chunks of the running rollout, waiting for "
             "the step if it is not finished), so a batch can mix versions but none older than eta.",
}

UPDATE_POLICY_TEXT = {
    "keep_kv": "swap now, between decode chunks; live sequences continue on K/V cached under the old weights and "
               "sample their next tokens under the new ones (a sequence can mix versions; each token keeps the "
               "gen_id it was sampled under).",
    "finish_on_old": "live sequences finish on the old weights and nothing new is admitted until they have; then "
                     "the swap (the old weights stay alive until then): every sequence has one version, at the cost "
                     "of a drain bubble.",
    "abort_and_resume": "swap now; live sequences drop their K/V and are re-prefilled (prompt + tokens so far) under "
                        "the new weights, then continue: cached K/V always matches the weights, at the cost of a "
                        "re-prefill; tokens already sampled keep their old gen_id.",
}

_BETWEEN_BATCHES = ("weights land between batches (`land(flight, 'keep_kv')` after a rollout batch is finished): no "
                    "sequence is live at a swap, so rollout.update_policy={policy!r} has no effect and every batch "
                    "is sampled under a single version.")


class StalenessViolation(AssertionError):
  """An observed weight lag exceeded the configured bound eta (the bounded-staleness invariant)."""


@dataclasses.dataclass(frozen=True)
class StalenessReport:
  """The staleness bound of one config, where it is enforced, and (optionally) what a run observed."""

  mode: str
  eta: int
  enforcement: str
  in_flight: str  # what generations in flight do when a weight update lands
  update_policy: str
  correction: str  # how the loss corrects the sampler/trainer gap (or that it does not)
  corrected: bool
  warnings: tuple[str, ...]
  lag_histogram: dict[int, int]  # lag (versions) -> token count, summed over the observed steps
  step_max_lag: dict[int, int]  # step -> its largest observed lag
  max_observed_lag: int | None  # None: nothing observed
  step_min_lag: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> its smallest (histograms only)

  @property
  def violations(self) -> list[tuple[int, int]]:
    """(step, lag) for every step with a lag outside [0, eta]: its largest if above eta, else its smallest if
    negative (a token from the future)."""
    out = {s: lag for s, lag in self.step_max_lag.items() if lag > self.eta or lag < 0}
    out.update({s: lag for s, lag in self.step_min_lag.items() if lag < 0 and s not in out})
    return sorted(out.items())

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["lag_histogram"] = {str(k): v for k, v in sorted(self.lag_histogram.items())}
    d["step_max_lag"] = {str(k): v for k, v in sorted(self.step_max_lag.items())}
    d["warnings"] = list(self.warnings)
    d["violations"] = [list(v) for v in self.violations]
    if self.mode == "async":
      d["update_policies"] = dict(UPDATE_POLICY_TEXT)
    return d

  def to_markdown(self) -> str:
    lines = [f"### Staleness ({self.mode}, eta = {self.eta})", "",
             f"- **Enforced**: {self.enforcement}", f"- **In flight at a weight update**: {self.in_flight}",
             f"- **Loss correction**: {self.correction}"]
    lines += [f"- **Warning**: {w}" for w in self.warnings]
    if self.max_observed_lag is None:
      lines.append("- **Observed**: no staleness histograms")
    else:
      bad = self.violations
      verdict = f"VIOLATED at steps {[s for s, _ in bad]}" if bad else "within eta"
      lines += [f"- **Observed** over {len(self.step_max_lag)} steps: max lag {self.max_observed_lag} ({verdict})",
                "", "| lag | tokens |", "|---:|---:|"]
      lines += [f"| {k} | {v} |" for k, v in sorted(self.lag_histogram.items())]
    return "\n".join(lines) + "\n"


def enforcement_text(mode: str, eta: int, land_after_chunks: int = 1) -> str:
  """Where and how runtime/loop.py keeps every token at most eta weight versions old, for `mode`."""
  if mode not in _MODE_ENFORCEMENT:
    raise ValueError(f"unknown topology mode {mode!r}; expected one of {tuple(_MODE_ENFORCEMENT)}")
  return f"eta = {eta}. {_PACING}. {_MODE_ENFORCEMENT[mode].format(chunks=land_after_chunks)}"


def in_flight_text(mode: str, update_policy: str, continuous: bool = False) -> str:
  """What a generation in flight does when new weights land, for `mode`, rollout.update_policy and
  rollout.continuous."""
  if update_policy not in UPDATE_POLICY_TEXT:
    raise ValueError(f"unknown rollout.update_policy {update_policy!r}; expected one of {tuple(UPDATE_POLICY_TEXT)}")
  if mode == "colocated":
    return ("nothing is in flight: rollout, train and sync alternate on the same devices (the KV pool is released "
            "while training); " + _BETWEEN_BATCHES.format(policy=update_policy))
  if mode == "disaggregated" and not continuous:
    return _BETWEEN_BATCHES.format(policy=update_policy)
  if mode == "disaggregated":
    return (f"weights land between batches, but the continuous stream may hold later batches' sequences then (eta "
            f">= 2): those meet the update under rollout.update_policy={update_policy!r}: "
            f"{UPDATE_POLICY_TEXT[update_policy]}")
  return (f"weights land between decode chunks under rollout.update_policy={update_policy!r}: "
          f"{UPDATE_POLICY_TEXT[update_policy]} (When no rollout is running they land between batches, where every "
          "policy is the same.)")


def correction_text(is_cap: float | None, mask_low: float | None, mask_high: float | None, eta: int,
                    level: str = "token") -> tuple[str, bool, list[str]]:
  """(text, corrected, warnings) for the loss's off-policy correction (train/step.py, rl/offpolicy.py)."""
  masking = mask_low is not None or mask_high is not None
  bounds = f"[{'-inf' if mask_low is None else mask_low}, {'inf' if mask_high is None else mask_high}]"
  if is_cap is not None:
    ratio = {"token": "pi_old/mu", "sequence": "prod_t pi_old/mu", "geometric": "(prod_t pi_old/mu)^(1/len)"}[level]
    per = "per token" if level == "token" else f"per sequence (rl.is_level={level}), on all its tokens"
    text = (f"truncated importance weight w = min({ratio}, is_cap={is_cap}) {per} against the sampler's "
            "log-probs mu (rl/offpolicy.truncated_is_weight; its effective sample size is logged as is/ess)")
    if masking:
      text += (f"; {'tokens' if level == 'token' else 'sequences'} whose ratio lies outside {bounds} are masked out "
               "of the loss")
    return text, True, []
  gap = (f"tokens up to eta={eta} versions old are trained as if on-policy" if eta > 0 else
         "only the numeric sampler/trainer mismatch (e.g. bf16 vs fp32) remains, but it is not corrected")
  warnings = [f"not corrected: rl.is_cap is None, so the loss has no importance weight against the sampler; {gap}"]
  return "not corrected (rl.is_cap is None)", False, warnings


def _lag_counts(histograms: Iterable[Mapping]) -> dict[int, dict[int, int]]:
  """step -> {lag: count} from histograms.jsonl records named "staleness" (other names are skipped)."""
  out: dict[int, dict[int, int]] = {}
  for i, rec in enumerate(histograms):
    if rec.get("name") != "staleness":
      continue
    if "step" not in rec or not isinstance(rec.get("counts"), Mapping):
      raise ValueError(f"histogram record {i}: expected {{'step', 'name', 'counts': {{lag: count}}}}, got {rec!r}")
    step_counts = out.setdefault(int(rec["step"]), {})
    for key, n in rec["counts"].items():
      lag = float(key)
      if not lag.is_integer():
        raise ValueError(f"histogram record {i} (step {rec['step']}): lag {key!r} is not a whole number of versions")
      step_counts[int(lag)] = step_counts.get(int(lag), 0) + int(n)
  return out


def staleness_audit(cfg: RunConfig, histograms: list[dict] | None = None, *,
                    metrics: list[dict] | None = None) -> StalenessReport:
  """The staleness review of `cfg`; with a run's histograms (and/or metrics' "staleness/max"), what it observed."""
  mode, eta = cfg.topology.mode, (0 if cfg.topology.mode == "colocated" else cfg.run.max_staleness)
  policy, rl = cfg.rollout.update_policy, cfg.rl
  correction, corrected, warnings = correction_text(rl.is_cap, rl.is_mask_low, rl.is_mask_high, eta, rl.is_level)
  per_step = _lag_counts(histograms or ())
  hist: dict[int, int] = {}
  for counts in per_step.values():
    for lag, n in counts.items():
      hist[lag] = hist.get(lag, 0) + n
  step_max = {s: max(lag for lag, n in c.items() if n > 0) for s, c in per_step.items() if any(c.values())}
  step_min = {s: min(lag for lag, n in c.items() if n > 0) for s, c in per_step.items() if any(c.values())}
  for rec in metrics or ():
    if rec.get("staleness/max") is not None:
      s = int(rec["step"])
      step_max[s] = max(step_max.get(s, -math.inf), int(rec["staleness/max"]))
  if histograms is not None and not per_step and not step_max:
    warnings.append("no staleness histograms in the run (histograms.jsonl empty or missing): nothing observed")
  return StalenessReport(mode=mode, eta=eta, enforcement=enforcement_text(mode, eta, cfg.run.land_after_chunks),
                         in_flight=in_flight_text(mode, policy, cfg.rollout.continuous), update_policy=policy,
                         correction=correction,
                         corrected=corrected, warnings=tuple(warnings), lag_histogram=dict(sorted(hist.items())),
                         step_max_lag=dict(sorted(step_max.items())), step_min_lag=dict(sorted(step_min.items())),
                         max_observed_lag=max(step_max.values()) if step_max else None)


def check_staleness(report: StalenessReport) -> StalenessReport:
  """Fails loudly: raises StalenessViolation naming each step whose observed lag is outside [0, eta]."""
  bad = report.violations
  if bad:
    listed = ", ".join(f"step {s}: lag {lag}" for s, lag in bad[:10]) + (" ..." if len(bad) > 10 else "")
    first_step, first_lag = bad[0]
    raise StalenessViolation(
        f"staleness bound violated in {report.mode} mode: step {first_step} trained on tokens {first_lag} weight "
        f"versions old, outside [0, eta={report.eta}] ({len(bad)} step(s): {listed}). The loop's pacing "
        "(runtime/loop.py `produced <= version + eta`) should make this impossible: this is a bug, not a setting.")
  return report


# ---------------------------------------------------------------- a run's files


def read_run(workdir: str) -> tuple[RunConfig, list[dict], list[dict], list[dict]]:
  """(cfg, spans, metrics, histograms) of a run directory; config.json is required, missing JSONL files read as []."""
  from jaxrl_topo.runtime import metrics as metrics_lib
  from jaxrl_topo.runtime import run as run_lib
  from jaxrl_topo.runtime import spans as spans_lib

  cfg = run_lib.load_config(workdir)
  spans = spans_lib.read_spans(workdir)
  metrics = (metrics_lib.read_metrics(workdir)
             if os.path.exists(os.path.join(workdir, metrics_lib.METRICS_FILE)) else [])
  histograms = (metrics_lib.read_histograms(workdir)
                if os.path.exists(os.path.join(workdir, metrics_lib.HISTOGRAMS_FILE)) else [])
  return cfg, spans, metrics, histograms
