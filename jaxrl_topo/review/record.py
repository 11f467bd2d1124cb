"""The decision record: one page answering, for a config, what crosses the wire each step, what the step
waits on, how stale rollouts may be, and which mode and split are fastest (issue 7 §5).

`write_record(cfg, out_dir, workdir=None, assumptions=...)` writes
  record.md           the page: placement and why, sync with its byte figures, staleness bound and where it
                      is enforced, overlaps the mode requires, rate matching (rollout/trainer split)
  record.json         every figure on the page
  timelines.png       simulated timeline per mode; split_sweep.png  steps/hour against the device split
From the config alone the simulator runs on stated assumptions (decode throughput, train time, link
bandwidth: `Assumptions`, each printed on the page). With `workdir` (a run of launchers/train.py) it is
calibrated from the run's spans instead, and the page adds the measured phase breakdown against the
prediction (phases more than 20% off flagged), the observed staleness histogram (an error if the bound
was ever exceeded) and the measured overlaps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import numpy as np

from jaxrl_topo.review import audit, calibrate, outdir, plots, simulator
from jaxrl_topo.review import step_bytes as step_lib
from jaxrl_topo.runtime.config import RunConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Assumptions:
  """What the simulator needs and a config does not say; every value is printed in the record."""

  n_devices: int | None = None  # default: the devices the topology uses
  decode_tokens_per_s_per_device: float = 2000.0
  per_seq_tokens_per_s: float = 50.0
  train_s: float = 30.0  # seconds per train step on the configured trainer devices
  link_gbps: float = 100.0  # trainer -> rollout link, Gbit/s
  median_len: float | None = None  # default: a quarter of rollout.max_new_tokens
  sigma: float = 1.0
  max_ratio: float = 30.0
  changed_frac: float = 0.02  # delta sync
  device_memory_gb: float = 80.0  # one accelerator's memory in GiB (an "H100 80GB" holds 80 GiB), for the fit check


def memory_fit(step: step_lib.StepBytes, mode: str, device_memory_gb: float) -> dict:
  """Per-device bytes of the state that lives for the whole run: the trainer's weights, gradients and two
  AdamW moments (LoRA: the moments and gradients of the adapters only) and, colocated, the rollout's copy
  on the same devices. Activations and the KV pool come on top, so `fits` False is certain, True is not."""
  weights = step.trainer_param_bytes_per_device
  trained = step.sync_lora if step.sync_lora is not None else weights
  trainer = weights + 3 * trained
  on_device = trainer + (step.rollout_param_bytes_per_device if mode == "colocated" else 0)
  return {"trainer_state_per_device": trainer, "rollout_weights_per_device": step.rollout_param_bytes_per_device,
          "largest_per_device": max(on_device, step.rollout_param_bytes_per_device),
          "device_memory_gb": device_memory_gb,
          "fits": max(on_device, step.rollout_param_bytes_per_device) <= device_memory_gb * 2**30}


_WHY = {
    "colocated": "one pool time-shared: rollout, then training, on every device. No idle side, no cross-device "
                 "sync (a local reshard, zero-copy when layouts match), but the step is R + T + switch.",
    "disaggregated": "disjoint pools: rollout of step k+1 overlaps training of step k (one step off-policy). The "
                     "step is max(R, T + sync) once the split matches the two rates.",
    "async": "disjoint pools running continuously, rollouts at most eta versions stale; weights land between "
             "decode chunks, so long-tailed generations do not stall the trainer.",
    "on-policy": "disjoint pools, strictly on-policy (run.max_staleness=0): each rollout waits for the weights of "
                 "the step before, so the two pools take turns and the step is R + T + sync (a multiplexed group, "
                 "launchers/mux.py, fills each idle pool with another job's phase).",
}
_OVERLAPS = {
    "colocated": "none: phases serialise on shared devices (the KV pool is freed while training).",
    "disaggregated": "rollout of batch k+1 must overlap train step k on the other devices, and the weight sync "
                     "must fit in the rollout's slack.",
    "async": "rollout must run continuously while train steps complete; weight sync overlaps decoding.",
    "on-policy": "none within the run: a rollout waits for the last step's weights (in a multiplexed group, other "
                 "jobs' phases overlap it).",
}


def _placement(cfg: RunConfig) -> str:
  """The key of _WHY and _OVERLAPS: the mode, or "on-policy" for disjoint pools at run.max_staleness=0."""
  mode = cfg.topology.mode
  return "on-policy" if mode == "disaggregated" and cfg.run.max_staleness == 0 else mode


def _axes_devices(axes) -> int:
  return int(np.prod([n for _, n in axes])) if axes else 1


def sim_params(cfg: RunConfig, a: Assumptions, sync_bytes: float) -> simulator.SimParams:
  t_dev, r_dev = _axes_devices(cfg.topology.trainer_axes), _axes_devices(cfg.topology.rollout_axes)
  colocated = cfg.topology.mode == "colocated"
  n = a.n_devices or (max(t_dev, r_dev) if colocated else t_dev + r_dev)
  return simulator.SimParams(
      n_devices=n, rollout_devices=r_dev if not colocated else max(1, n // 2),
      batch_seqs=cfg.data.batch_size * cfg.rl.group_size,
      median_len=a.median_len or max(1.0, cfg.rollout.max_new_tokens / 4),
      tokens_per_s_per_device=a.decode_tokens_per_s_per_device, per_seq_tokens_per_s=a.per_seq_tokens_per_s,
      train_s=a.train_s, train_devices=t_dev if not colocated else n, sync_bytes=sync_bytes, link_gbps=a.link_gbps,
      eta=_eta(cfg), sigma=a.sigma, max_ratio=a.max_ratio)


def _eta(cfg: RunConfig) -> int:
  """The staleness bound the simulated modes run at: the configured one (disaggregated at 0 is sequential), or
  one step for a colocated config (which forces 0) so that its disjoint-mode rows show what they would give."""
  return 1 if cfg.topology.mode == "colocated" else cfg.run.max_staleness


def write_record(cfg: RunConfig, out_dir: str, *, workdir: str | None = None,
                 assumptions: Assumptions = Assumptions()) -> dict:
  """Writes record.md, record.json and the PNGs into `out_dir`; returns the JSON figures.

  `cfg` is the config the record is for; with `workdir`, a what-if on the run's measured phases: what the run
  measured (its spans' batch, stream, staleness) is read under the run's own config (its config.json; `cfg`
  when it has none). The observed lags are checked against the run's bound, not the what-if's."""
  outdir.check_out(out_dir, workdir)
  mode = cfg.topology.mode
  spans, histograms, metrics, ran = [], [], [], cfg
  if workdir is not None:
    from jaxrl_topo.runtime import metrics as metrics_lib
    from jaxrl_topo.runtime import spans as spans_lib
    ran = _runs_own_config(workdir, cfg)
    spans, metrics = spans_lib.read_spans(workdir), metrics_lib.read_metrics(workdir)
    histograms = metrics_lib.read_histograms(workdir)
  os.makedirs(out_dir, exist_ok=True)
  step = step_lib.step_bytes(cfg, changed_frac=assumptions.changed_frac)
  sync_bytes = step.sync_per_step
  skip = 1 if len({s["step"] for s in spans if s["phase"] == "train"}) > 2 else 0  # step 0: first runs
  if spans:  # calibrated from the measured run
    tokens = float(np.median([m["perf/tokens"] for m in metrics])) if metrics else None
    fit = ran or cfg
    params = calibrate.calibrate(spans, batch_seqs=fit.data.batch_size * fit.rl.group_size, tokens_per_step=tokens,
                                 eta=_eta(fit), skip_steps=skip, stream=fit.continuous_rollout)
    fitted = params  # as the run ran: the measured timeline is checked against it
    params = dataclasses.replace(params, eta=_eta(cfg))  # simulated at the config's bound
    source = f"calibrated from the spans of {workdir}"
    if ran is None or ran != cfg:  # a what-if: the config's devices too, at the run's per-device rates
      planned = sim_params(cfg, assumptions, sync_bytes)
      params = dataclasses.replace(params, n_devices=planned.n_devices, rollout_devices=planned.rollout_devices)
      source += (f" (per-device decode rate, each sequence at most the run's rate, so more rollout devices do not "
                 f"shorten a batch the run's devices decoded at full occupancy; train time from its "
                 f"{params.train_devices} trainer devices, scaled ideally; its batch of {params.batch_seqs} "
                 f"sequences), simulated on this config's {params.n_devices} devices at eta = {params.eta}")
  else:
    params = sim_params(cfg, assumptions, sync_bytes)
    source = "assumptions (no measured run given)"
  modes = simulator.MODES if params.n_devices >= 2 else ("colocated",)  # one device: nothing to split
  timelines = {m: simulator.simulate(m, params, n_steps=24) for m in modes}
  rates = {m: timelines[m].steps_per_hour(warmup=6) for m in modes}
  splits = list(range(1, params.n_devices))
  sweep = simulator.sweep_split(params, splits, n_steps=24) if splits else {}
  best = {m: max(sweep, key=lambda s, m=m: sweep[s][m]) for m in modes if m != "colocated"} if sweep else {}
  step = dataclasses.replace(step, steps_per_hour=rates[mode])
  # The lags were measured under the run's bound: a what-if config at another one shows its own bound, unobserved.
  # (ran None: the run's config.json no longer converts, so its bound is unknown and its lags go unchecked.)
  apart = ran is None or _bound(ran) != _bound(cfg)
  observed = audit.staleness_audit(ran or cfg, histograms or None, metrics=metrics or None)
  stale = audit.staleness_audit(cfg) if apart else audit.staleness_audit(cfg, histograms or None,
                                                                           metrics=metrics or None)
  fig = {"mode": mode, "why": _WHY[_placement(cfg)], "overlaps_required": _OVERLAPS[_placement(cfg)],
         "bytes": step.to_dict(),
         "staleness": stale.to_dict(), "simulator_source": source, "sim_params": dataclasses.asdict(params),
         "steps_per_hour": rates, "split_sweep": {str(k): v for k, v in sweep.items()},
         "best_rollout_devices": best, "assumptions": dataclasses.asdict(assumptions),
         "memory": memory_fit(step, mode, assumptions.device_memory_gb)}
  beside = observed if apart and ran is not None else None  # the run's own bound, shown beside the config's
  if beside is not None:
    fig["run_staleness"] = beside.to_dict()
  overlap = None  # the measured timeline against the prediction (a run's spans only)
  if spans:
    same = fitted == params and fit.topology.mode == mode  # else a what-if: the run as it ran, simulated apart
    sim = timelines[mode] if same else simulator.simulate(fit.topology.mode, fitted, n_steps=24)
    predicted = {ph: float(np.median([s.end - s.start for s in sim.of(ph)])) for ph in ("rollout", "train", "sync")
                 if sim.of(ph)}
    # The simulator's train phase holds the log-prob pre-pass (calibrate adds it in); the run logs it apart.
    logprobs = calibrate.phase_median(spans, "logprobs", skip)
    if logprobs is not None and "train" in predicted:
      predicted["train"] = max(0.0, predicted["train"] - logprobs)
    overlap = audit.overlap_audit(spans, predicted, skip_steps=skip)
    fig["overlap"] = overlap.to_dict()
  plots.plot_timelines(timelines, os.path.join(out_dir, "timelines.png"))
  if sweep:
    plots.plot_split_sweep(sweep, os.path.join(out_dir, "split_sweep.png"))
  with open(os.path.join(out_dir, "record.json"), "w") as f:
    json.dump(fig, f, indent=2, default=str)
  with open(os.path.join(out_dir, "record.md"), "w") as f:
    f.write(_markdown(cfg, fig, stale, overlap, beside))
  if ran is not None:
    audit.check_staleness(observed)  # fail loudly, after the record that shows the violation is written
  return fig


def _runs_own_config(workdir: str, cfg: RunConfig) -> RunConfig | None:
  """The run's own config (its config.json); `cfg` when it has none; None when it no longer converts (a run
  recorded under an older schema): its bound is then unknown, and its lags go unchecked, as the warning says."""
  from jaxrl_topo.runtime import run as run_lib

  if not os.path.isfile(os.path.join(workdir, run_lib.CONFIG_FILE)):
    return cfg
  try:
    return run_lib.load_config(workdir)
  except (ValueError, TypeError, KeyError) as e:
    logging.warning("%s's config.json does not convert (%s): its spans are fitted under the given config, and "
                    "its observed staleness goes unchecked", workdir, e)
    return None


def _bound(cfg: RunConfig) -> tuple[str, int]:
  """(mode, eta) a run's observed lags are checked against (colocated forces eta 0)."""
  return cfg.topology.mode, 0 if cfg.topology.mode == "colocated" else cfg.run.max_staleness


def _gb(n: float | None) -> str:
  return "n/a" if n is None else f"{n / 1e9:.3g} GB"


def fit_warning(memory: dict, mode: str) -> str | None:
  """One line when the run's lasting state alone exceeds a device's memory, else None."""
  if memory["fits"]:
    return None
  where = "trainer state and the rollout copy (colocated)" if mode == "colocated" else "the largest side's state"
  return (f"does not fit: {where} need {memory['largest_per_device'] / 2**30:.3g} GiB per device, more than the "
          f"{memory['device_memory_gb']:g} GiB of one device; add trainer fsdp devices, use LoRA, or a smaller model")


def _fit_lines(memory: dict, mode: str) -> list[str]:
  warning = fit_warning(memory, mode)
  return [f"- **WARNING: {warning}**"] if warning else []


def _markdown(cfg: RunConfig, fig: dict, stale: audit.StalenessReport, overlap: audit.OverlapReport | None,
              observed: audit.StalenessReport | None = None) -> str:
  b, mode = fig["bytes"], fig["mode"]
  rates = fig["steps_per_hour"]
  lines = [f"# Decision record: {b['model']} ({mode})", "",
           "## Placement", f"- trainer axes {b['trainer_axes']}, rollout axes {b['rollout_axes']}",
           f"- policy weights per device: trainer {_gb(b['trainer_param_bytes_per_device'])}, "
           f"rollout {_gb(b['rollout_param_bytes_per_device'])}",
           f"- trainer state per device (weights, gradients, AdamW moments): "
           f"{_gb(fig['memory']['trainer_state_per_device'])}; activations and the KV pool come on top",
           *_fit_lines(fig["memory"], mode),
           f"- why {mode}: {fig['why']}", "",
           "## Weight sync and bytes per step",
           f"- full sync ({b['sync_dtype']}): {_gb(b['sync_full'])} ({_gb(b['sync_full_per_rollout_device'])} per "
           f"rollout device); delta at {b['changed_frac']:.0%} changed: {_gb(b['sync_delta'])}; "
           f"LoRA: {_gb(b['sync_lora'])}{' (aliased colocated: none moves)' if b['sync_lora_moved'] == 0 else ''}; "
           f"this run's sync.mode={b['sync_mode']} sends "
           f"{_gb(b['totals']['sync'])} a step",
           f"- rollout payload: {_gb(b['payload']['total'])}; gradient collectives per trainer rank: "
           f"{_gb(b['policy_collectives']['total'])}; reference {_gb(b['reference_collectives'])}, "
           f"critic {_gb(b['critic_collectives']['total'])}"]
  if "per_hour" in b:
    lines.append("- per hour at the simulated rate: " + ", ".join(f"{k} {_gb(v)}" for k, v in b["per_hour"].items()))
  lines += ["", "## Staleness", stale.to_markdown()]
  if observed is not None:
    lines += [f"Measured under the run's own bound ({observed.mode}, eta = {observed.eta}), not this config's:", "",
              observed.to_markdown()]
  lines += ["", "## Overlaps required", f"- {fig['overlaps_required']}"]
  if overlap is not None:
    lines += ["", "## Measured timeline", overlap.to_markdown()]
  source = fig["simulator_source"]
  if overlap is None:
    source += "; " + ", ".join(f"{k}={v}" for k, v in fig["assumptions"].items() if v is not None)
  lines += ["", "## Throughput and rate matching", f"Simulator: {source}.", "",
            f"| mode | steps/hour | best rollout devices (of {fig['sim_params']['n_devices']}) |", "|---|---|---|"]
  lines += [f"| {m} | {rates[m]:.1f} | {fig['best_rollout_devices'].get(m, '-')} |" for m in rates]
  best_mode = max(rates, key=rates.get)
  lines += ["", f"Fastest on these figures: **{best_mode}**. Configured: {mode} with "
            f"{fig['sim_params']['rollout_devices']} rollout devices.", "",
            "![timelines](timelines.png)"]
  if fig["split_sweep"]:
    lines.append("![split sweep](split_sweep.png)")
  lines.append("")
  return "\n".join(lines)
