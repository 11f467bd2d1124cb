"""Where a traced call's device time goes: a summary of a `jax.profiler` trace (an .xplane.pb), for benchmarks.

  summarize(path)  ->  {"file", "planes": [{"plane", "lines": [...], "top": [...], "top_ops": [...]}, ...]}

For each device plane (`/device:GPU:0`, ...; on CPU, where there is none, the host plane): per line (a GPU
stream, "XLA Ops", ...) its event count, summed event time and busy time (the union of its events' intervals)
over the line's span; the `top` event names of the kernel lines (GPU: the "Stream" lines; CPU: the XLA worker
threads) by summed time, with counts; and `top_ops`, the same for the "XLA Ops" line where the trace has one.
Read it on a GPU: there a stream's events are kernels that do not nest, and wall time per step minus busy time
per step is what the device spends waiting (for launches, a loop condition read back to the host, ...). On CPU
the host threads' events nest (an executor event holds the fusions it runs), so sums double count and exceed
the span; only the names and their counts mean much there. XLA launches GPU kernels one by one while a profile
runs (command buffers are off unless `--xla_enable_command_buffers_during_profiling`), so the gaps in a trace
overstate those of an untraced run; the kernel times hold.
"""

import collections
import glob
import os

from jaxrl_topo.review.overlap import union_length


def _kernel_line(plane_name: str, line_name: str) -> bool:
  if plane_name.startswith("/device:"):
    return line_name.startswith("Stream")
  return line_name.startswith("tf_XLA")  # the host plane's XLA worker threads (CPU)


def trace_file(path: str) -> str:
  """`path` itself, or the newest (last by name: the profiler names its folders by time) .xplane.pb under it."""
  if not os.path.isdir(path):
    return path
  found = sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True))
  if not found:
    raise FileNotFoundError(f"no .xplane.pb under {path}")
  return found[-1]


def summarize_planes(planes, top: int = 25) -> list[dict]:
  """The per-plane summary above, from planes with `.name` and `.lines`, each line with `.name` and `.events`,
  each event with `.name`, `.start_ns` and `.duration_ns` (jax.profiler.ProfileData's, or any such objects)."""
  planes = list(planes)
  chosen = [p for p in planes if p.name.startswith("/device:")] or [p for p in planes if p.name == "/host:CPU"]
  out = []
  for plane in chosen:
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
                    "busy_s": union_length((s, e) for s, e, _ in spans) / 1e9,
                    "span_s": (max(e for _, e, _ in spans) - min(s for s, _, _ in spans)) / 1e9})

    def ranked(totals):
      return [{"name": n[:160], "sum_s": t / 1e9, "count": c}
              for n, (t, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]

    out.append({"plane": plane.name, "lines": lines, "top": ranked(by_name), "top_ops": ranked(by_op)})
  return out


def summarize(path: str, top: int = 25) -> dict:
  """The summary above of the .xplane.pb at `path` (a file, or a trace directory searched for the newest)."""
  from jax.profiler import ProfileData  # noqa: PLC0415 (the pure parts above need no JAX)

  path = trace_file(path)
  return {"file": path, "planes": summarize_planes(ProfileData.from_file(path).planes, top)}
