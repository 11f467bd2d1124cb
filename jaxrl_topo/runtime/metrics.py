"""Per-step metrics of an RL run: a JSONL record stream, TensorBoard, a progress bar and a reward-curve PNG.

`MetricsWriter` is the one sink the run loop talks to (create it on process 0 only):

  <workdir>/metrics.jsonl     one JSON object per `log` call: {"step": step, **metrics}. The source of truth:
                              the plot and the resume-equality test read it back (`read_metrics`).
  <workdir>/histograms.jsonl  one object per `log_histogram` call: {"step", "name", "counts": {str(value): n}},
                              exact counts per distinct value, meant for discrete data such as the staleness
                              (weight-lag) histogram of a step's rollouts.
  <workdir>/tb/               TensorBoard events (tensorboardX): add_scalar per numeric metric, add_histogram.
  <workdir>/reward_curve.png  written by `close`: reward_mean (± reward_std) per step, held-out accuracy points.

Conventions:
  * JSON has no NaN/Infinity: a non-finite float is written as null (TensorBoard still gets the raw value).
    numpy scalars and 0-d arrays become Python numbers; bools stay bools; strings and None pass through.
  * Every wall-clock-dependent metric is named "time/..." or "perf/..." (step_s, tokens_per_s, ...), so two runs
    are compared by dropping those keys (`comparable`); everything else must be deterministic given the seed.
  * Each line is flushed as soon as it is written, so a killed process loses nothing it logged (no fsync: a
    machine crash can still lose the OS buffers).

Resume: a fresh run (`resume=False`) starts both JSONL files empty. A resumed run (`resume=True`) first rewrites
them keeping only records with step < start_step (the steps after the restored checkpoint are re-run and logged
again), so the files hold exactly what an uninterrupted run would have written. TensorBoard gets the same effect
from `purge_step`: TensorBoard discards earlier events at steps >= start_step when it reads the new event file.
A truncated last line (a process killed mid-write) is ignored on read and dropped on resume; a malformed line
anywhere else is an error.

No JAX here: values arrive as Python floats / numpy scalars, already fetched to the host.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
HISTOGRAMS_FILE = "histograms.jsonl"
TB_DIR = "tb"
PLOT_FILE = "reward_curve.png"

REWARD_MEAN = "reward_mean"
REWARD_STD = "reward_std"
EVAL_ACCURACY = "eval/accuracy"


def eval_pass_at(k: int) -> str:
  """The metric of each held-out prompt's best score over its k samples, averaged (run.eval_samples = k > 1)."""
  return f"eval/pass@{k}"

TIMING_PREFIXES = ("time/", "perf/")
TIMING_KEYS = ("wall_s", "tokens_per_s")

# Progress-bar postfix: label -> candidate metric keys, first present wins. The last value seen stays shown
# (held-out accuracy is only measured every few steps).
_POSTFIX = (
  ("reward", (REWARD_MEAN,)),
  ("acc", (EVAL_ACCURACY, "accuracy")),
  ("tok/s", ("perf/tokens_per_s", "tokens_per_s")),
  ("step_s", ("time/step_s", "step_s")),
)
_MAX_EXACT_TB_BINS = 512  # integer histograms with a wider range fall back to automatic bins in TensorBoard


def _json_value(key: str, value: Any) -> Any:
  """A metric value as a JSON-safe Python value (non-finite floats -> None)."""
  if isinstance(value, np.ndarray):
    if value.size != 1:
      raise TypeError(f"metric {key!r}: expected a scalar, got an array of shape {value.shape}")
    value = value.reshape(()).item()
  elif isinstance(value, np.generic):
    value = value.item()
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    value = float(value)
    return value if math.isfinite(value) else None
  raise TypeError(f"metric {key!r}: expected a number, bool, str or None, got {type(value).__name__}")


def jsonable(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """`metrics` as the JSON values a metrics.jsonl line would hold (non-finite floats -> None)."""
  return {k: _json_value(k, v) for k, v in metrics.items()}


def _tb_scalar(value: Any) -> float | None:
  """The float TensorBoard gets for a raw metric value, or None when it is not numeric."""
  if isinstance(value, np.ndarray):
    value = value.reshape(()).item()
  elif isinstance(value, np.generic):
    value = value.item()
  if isinstance(value, numbers.Real):  # bool included
    return float(value)
  return None


def read_jsonl(path: str) -> list[dict]:
  """Records of a JSONL file; a truncated final line (killed mid-write) is skipped, any other bad line raises."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  records = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:  # no trailing newline: the writer died inside this line
        break
      raise ValueError(f"{path}:{i + 1}: malformed JSON line ({e})") from e
    if not isinstance(record, dict) or "step" not in record:
      raise ValueError(f"{path}:{i + 1}: expected an object with a 'step' key, got {line[:80]!r}")
    records.append(record)
  return records


def _truncate_jsonl(path: str, start_step: int) -> None:
  """Rewrites `path` keeping only the records with step < start_step (atomically, via a temporary file)."""
  if not os.path.exists(path):
    return
  kept = [r for r in read_jsonl(path) if r["step"] < start_step]
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in kept)
  os.replace(tmp, path)


def read_metrics(workdir: str) -> list[dict]:
  """The records of `<workdir>/metrics.jsonl`, in file order (non-finite values read back as None)."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no metrics file at {path}: was a MetricsWriter created with workdir={workdir!r}?")
  return read_jsonl(path)


def read_histograms(workdir: str) -> list[dict]:
  """The records of `<workdir>/histograms.jsonl` ({"step", "name", "counts"}), in file order."""
  path = os.path.join(workdir, HISTOGRAMS_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no histogram file at {path}")
  return read_jsonl(path)


def _is_timing_key(key: str, drop_prefixes: Sequence[str], drop_keys: Sequence[str]) -> bool:
  return key.startswith(tuple(drop_prefixes)) or key in drop_keys or key.rsplit("/", 1)[-1] in drop_keys


def comparable(records: Iterable[Mapping[str, Any]], drop_prefixes: Sequence[str] = TIMING_PREFIXES,
               drop_keys: Sequence[str] = TIMING_KEYS) -> list[dict]:
  """`records` without their wall-clock-dependent keys, for comparing two runs (e.g. uninterrupted vs resumed).

  Convention: every timing metric is named "time/..." or "perf/..."; a key is also dropped when it, or its last
  "/" component, is in `drop_keys` (a safety net for bare "wall_s" / "tokens_per_s"). "step" is always kept.
  """
  return [{k: v for k, v in r.items() if k == "step" or not _is_timing_key(k, drop_prefixes, drop_keys)}
          for r in records]


def _histogram_counts(name: str, values: Sequence[int | float]) -> dict[str, int]:
  """Exact counts per distinct value, ordered by value; integral floats count as ints ("1", not "1.0")."""
  arr = np.asarray(values).reshape(-1)
  if arr.size == 0:
    return {}
  if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
    raise TypeError(f"histogram {name!r}: expected real numbers, got dtype {arr.dtype}")
  if not np.all(np.isfinite(arr)):
    raise ValueError(f"histogram {name!r}: values must be finite")
  uniq, counts = np.unique(arr, return_counts=True)
  out = {}
  for v, n in zip(uniq.tolist(), counts.tolist(), strict=True):
    key = str(int(v)) if float(v).is_integer() else repr(float(v))
    out[key] = int(n)
  return out


class MetricsWriter:
  """Writes one run's metrics; see the module docstring for the files and the resume rule.

  Args:
    workdir: the run directory (created if missing).
    total_steps: the run's step count (the progress bar's total).
    tensorboard: also write TensorBoard events to `<workdir>/tb`.
    progress: show a tqdm progress bar on stderr.
    start_step: the first step this process logs (the restored checkpoint's step when resuming).
    resume: keep the records of steps < start_step already in the files (else start them empty).
  """

  def __init__(self, workdir: str, *, total_steps: int, tensorboard: bool = True, progress: bool = True,
               start_step: int = 0, resume: bool = False):
    if total_steps < 0:
      raise ValueError(f"total_steps must be >= 0, got {total_steps}")
    if not 0 <= start_step <= total_steps:
      raise ValueError(f"start_step must be in [0, total_steps={total_steps}], got {start_step}")
    self.workdir = workdir
    self.total_steps = total_steps
    self.start_step = start_step
    self.metrics_path = os.path.join(workdir, METRICS_FILE)
    self.histograms_path = os.path.join(workdir, HISTOGRAMS_FILE)
    self.plot_path = os.path.join(workdir, PLOT_FILE)
    os.makedirs(workdir, exist_ok=True)

    if resume:
      _truncate_jsonl(self.metrics_path, start_step)
      _truncate_jsonl(self.histograms_path, start_step)
    mode = "a" if resume else "w"
    self._metrics_f = open(self.metrics_path, mode, encoding="utf-8")  # noqa: SIM115 (closed in close())
    self._hist_f = open(self.histograms_path, mode, encoding="utf-8")  # noqa: SIM115
    self._closed = False

    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # lazy: protobuf import cost only when used

      # purge_step makes TensorBoard drop older events at steps >= it: the re-run steps of a resumed run, or
      # everything of an earlier run in the same directory for a fresh one.
      self._tb = SummaryWriter(os.path.join(workdir, TB_DIR), purge_step=start_step if resume else 0,
                               flush_secs=10)

    self._bar = None
    self._postfix: dict[str, str] = {}
    if progress:
      from tqdm.auto import tqdm

      self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

  def _check_open(self, what: str) -> None:
    if self._closed:
      raise RuntimeError(f"MetricsWriter.{what} after close()")

  def _check_step(self, step: int) -> int:
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (numbers.Integral)):
      raise TypeError(f"step must be an int, got {type(step).__name__}")
    step = int(step)
    if step < self.start_step:
      raise ValueError(f"step {step} is before start_step={self.start_step}: a resumed run's file already "
                       f"holds the earlier steps")
    return step

  def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
    """Appends {"step": step, **metrics} to metrics.jsonl (flushed), to TensorBoard, and advances the bar."""
    self._check_open("log")
    step = self._check_step(step)
    if "step" in metrics:
      raise ValueError("metrics must not contain the key 'step' (it is the record's own step)")
    record: dict[str, Any] = {"step": step}
    for key, value in metrics.items():
      if not isinstance(key, str):
        raise TypeError(f"metric names must be str, got {key!r}")
      record[key] = _json_value(key, value)
    self._metrics_f.write(json.dumps(record, allow_nan=False) + "\n")
    self._metrics_f.flush()

    if self._tb is not None:
      for key, value in metrics.items():
        scalar = _tb_scalar(value)
        if scalar is not None:
          self._tb.add_scalar(key, scalar, step)

    if self._bar is not None:
      for label, keys in _POSTFIX:
        for k in keys:
          if record.get(k) is not None and not isinstance(record[k], str):
            self._postfix[label] = f"{record[k]:.4g}"
            break
      if self._postfix:
        self._bar.set_postfix(self._postfix, refresh=False)
      advance = min(step + 1, self.total_steps) - self._bar.n
      if advance > 0:
        self._bar.update(advance)
      else:
        self._bar.refresh()

  def log_histogram(self, step: int, name: str, values: Sequence[int | float]) -> None:
    """Appends {"step", "name", "counts": {str(value): count}} to histograms.jsonl; TensorBoard add_histogram.

    Counts are exact per distinct value (meant for discrete data: staleness lags, response-length buckets).
    Integer data goes to TensorBoard with one bin per integer (up to a range of 512), anything else with
    TensorBoard's default bins. An empty `values` is recorded with empty counts and skipped in TensorBoard.
    """
    self._check_open("log_histogram")
    step = self._check_step(step)
    if not isinstance(name, str) or not name:
      raise TypeError(f"histogram name must be a non-empty str, got {name!r}")
    counts = _histogram_counts(name, values)
    self._hist_f.write(json.dumps({"step": step, "name": name, "counts": counts}, allow_nan=False) + "\n")
    self._hist_f.flush()
    if self._tb is not None and counts:
      arr = np.asarray(values, dtype=np.float64).reshape(-1)
      lo, hi = float(arr.min()), float(arr.max())
      integral = bool(np.all(arr == np.round(arr)))
      bins: Any = "tensorflow"
      if integral and hi - lo <= _MAX_EXACT_TB_BINS:
        bins = np.arange(lo - 0.5, hi + 1.5)  # one bin centred on each integer
      self._tb.add_histogram(name, arr, step, bins=bins)

  def close(self, *, plot: bool = True, accuracy: tuple[float, float] | None = None) -> str | None:
    """Flushes and closes every sink; with `plot`, writes reward_curve.png and returns its path
    (`accuracy`: the held-out accuracy before and after the run, drawn at its first and last step).

    The plot is drawn from metrics.jsonl, so a resumed run's curve covers the whole run. Returns None when
    plotting is off or there is no reward data. Closing twice is a no-op (the second returns None).
    """
    if self._closed:
      return None
    self._closed = True
    self._metrics_f.close()
    self._hist_f.close()
    if self._tb is not None:
      self._tb.close()
    if self._bar is not None:
      self._bar.close()
    return plot_reward_curve(self.workdir, accuracy=accuracy) if plot else None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    self.close(plot=exc_type is None)


def plot_reward_curve(workdir: str, path: str | None = None, accuracy: tuple[float, float] | None = None) -> str | None:
  """Draws reward_mean (± reward_std) per step and held-out accuracy from metrics.jsonl into a PNG.

  `accuracy`: (before, after) the run, drawn at step 0 and after the last step and named in the title.
  Returns the PNG's path (default `<workdir>/reward_curve.png`), or None when no record has a reward_mean.
  Uses matplotlib's Figure API directly (Agg canvas): no pyplot, no display, no global backend change.
  """
  if not os.path.exists(os.path.join(workdir, METRICS_FILE)):
    return None
  records = read_metrics(workdir)
  if not any(r.get(REWARD_MEAN) is not None for r in records):
    return None
  fig = reward_curve_figure(records, os.path.basename(os.path.abspath(workdir)), accuracy)
  out = path or os.path.join(workdir, PLOT_FILE)
  fig.savefig(out, format="png")
  return out


def reward_curve_figure(records: list[dict], name: str, accuracy: tuple[float, float] | None = None):
  """The reward-curve Figure of metric records (at least one with a reward_mean). The held-out accuracy
  axis is fixed at [0, 1], so the curves of different runs compare by eye."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  reward = [(r["step"], r[REWARD_MEAN], r.get(REWARD_STD)) for r in records if r.get(REWARD_MEAN) is not None]
  # An eval logged with step s ran after step s's update: it is drawn at s + 1, where step s + 1's rollouts begin.
  acc = [(r["step"] + 1, r[EVAL_ACCURACY]) for r in records if r.get(EVAL_ACCURACY) is not None]
  if accuracy is not None:
    acc = sorted({0: accuracy[0], **dict(acc), max(r["step"] for r in records) + 1: accuracy[1]}.items())
  fig = Figure(figsize=(8, 4.5), dpi=100)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  steps = np.array([s for s, _, _ in reward], dtype=np.float64)
  mean = np.array([m for _, m, _ in reward], dtype=np.float64)
  handles = ax.plot(steps, mean, color="tab:blue", marker="." if len(steps) < 50 else None, label=REWARD_MEAN)
  if any(sd is not None for _, _, sd in reward):
    std = np.array([np.nan if sd is None else sd for _, _, sd in reward], dtype=np.float64)
    band = ax.fill_between(steps, mean - std, mean + std, color="tab:blue", alpha=0.2, linewidth=0,
                           label=f"± {REWARD_STD}")
    handles.append(band)
  ax.set_xlabel("step")
  ax.set_ylabel("reward (train rollouts)")
  ax.grid(True, alpha=0.3)
  if acc:
    ax2 = ax.twinx()
    handles += ax2.plot([s for s, _ in acc], [a for _, a in acc], color="tab:orange", marker="o", linestyle="--",
                        label="held-out accuracy")
    ax2.set_ylabel("held-out accuracy")
    ax2.set_ylim(-0.02, 1.02)
  ax.legend(handles=handles, loc="best")
  title = f"Reward per step ({name})"
  if accuracy is not None:
    title += f"; held-out accuracy {accuracy[0]:.3f} -> {accuracy[1]:.3f}"
  ax.set_title(title)
  fig.tight_layout()
  return fig
