"""Where a traced call's device time goes: a summary of a `jax.profiler` trace (an .xplane.pb), for benchmarks.

  summarize(path)  ->  {"planes": [{"plane", "lines": [...], "top": [...]}, ...]}

For each device plane (`/device:GPU:0`, ...; on CPU, where there is none, the host plane's XLA threads): per line
(a GPU stream, "XLA Ops", ...) its event count, summed event time and busy time (the union of its events'
intervals) over the line's span; the `top` event names of the kernel lines by summed time, with counts, and
`top_ops`, the same for the "XLA Ops" line (HLO ops, where the trace has one). On a
GPU, wall time per step minus busy time per step is what the device spends waiting (for launches, a loop
condition read back to the host, ...). Note: XLA launches kernels one by one while a profile runs (command
buffers are off unless `--xla_enable_command_buffers_during_profiling`), so the gaps in a trace overstate those of
an untraced run; the kernel times hold.
"""

import collections
import glob
import os

from jax.profiler import ProfileData


def _busy_ns(intervals) -> int:
  """Length of the union of (start, end) intervals."""
  busy, end = 0, None
  for s, e in sorted(intervals):
    if end is None or s > end:
      busy, end = busy + e - s, e
    elif e > end:
      busy, end = busy + e - end, e
  return busy


def _kernel_line(plane_name: str, line_name: str) -> bool:
  if plane_name.startswith("/device:"):
    return line_name.startswith("Stream")
  return line_name.startswith("tf_XLA")  # the host plane's XLA worker threads (CPU)


def summarize(path: str, top: int = 25) -> dict:
  """The summary above of the .xplane.pb at `path` (a file, or a trace directory searched for one)."""
  if os.path.isdir(path):
    found = sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True))
    if not found:
      raise FileNotFoundError(f"no .xplane.pb under {path}")
    path = found[-1]
  data = ProfileData.from_file(path)
  planes = [p for p in data.planes if p.name.startswith("/device:")] or [
      p for p in data.planes if p.name == "/host:CPU"]
  out = []
  for plane in planes:
    lines, by_name, by_op = [], collections.defaultdict(lambda: [0, 0]), collections.defaultdict(lambda: [0, 0])
    for line in plane.lines:
      spans = [(ev.start_ns, ev.start_ns + ev.duration_ns, ev.name) for ev in line.events]
      if not spans:
        continue
      kernels = _kernel_line(plane.name, line.name)
      into = by_name if kernels else by_op if line.name == "XLA Ops" else None
      for s, e, name in spans if into is not None else ():
        into[name][0] += e - s
        into[name][1] += 1
      lines.append({"line": line.name, "kernels": kernels, "events": len(spans),
                    "sum_s": sum(e - s for s, e, _ in spans) / 1e9,
                    "busy_s": _busy_ns((s, e) for s, e, _ in spans) / 1e9,
                    "span_s": (max(e for _, e, _ in spans) - min(s for s, _, _ in spans)) / 1e9})
    def ranked(totals):
      return [{"name": n[:160], "sum_s": t / 1e9, "count": c}
              for n, (t, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]

    out.append({"plane": plane.name, "lines": lines, "top": ranked(by_name), "top_ops": ranked(by_op)})
  return {"file": path, "planes": out}
