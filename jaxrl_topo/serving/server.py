"""Start JetStream's orchestrator and gRPC server over our engine (launchers/serve.py; issue 16).

`resolve_model_dir` takes an HF directory, or exports a run's newest checkpoint to `export_dir(workdir)`,
`<workdir>/serve_hf/<pid>/`, one per server process so two servers of one run never write the same files
(delete them when done; runtime/export.py, the same code as launchers/export.py); `build_engine`
lays the weights out on the rollout mesh and wraps a `RolloutEngine` in `JetStreamEngine`; `follow_run`
swaps a run's newer checkpoints in while serving; `start` checks the port and runs `jetstream.core.server_lib.run` in
interleaved mode (one engine prefills and generates). What can be checked before devices are touched is
checked first, with the flag at fault in the message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

import jax

from jaxrl_topo.rollout.engine_config import engine_options
from jaxrl_topo.rollout.sampling import SamplingConfig

INSTALL_HINT = ("make test-jetstream builds .venv-jetstream with it (then run .venv-jetstream/bin/python "
                "launchers/serve.py ...), or pip install -e '.[jetstream]' into this environment (google-jetstream "
                "0.2.2; it pulls TensorFlow, about 3 GB)")


def require_jetstream() -> None:
  """Raises UserError naming the pip command when the optional extra is missing."""
  import logging

  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  try:
    import jetstream.core.server_lib  # noqa: F401
    # Importing JetStream's orchestrator sets the root logger to DEBUG and adds a stdout handler: every
    # compile and every decode step would be printed (and a server whose stdout is a pipe nobody reads
    # blocks). Put the caller's logging back as it was.
    root.setLevel(level)
    for h in root.handlers[:]:
      if h not in handlers:
        root.removeHandler(h)
  except ImportError as e:
    from jaxrl_topo.cli import UserError
    raise UserError(f"serving needs the jetstream extra, which is not installed ({e}): {INSTALL_HINT}") from e
  if not hasattr(jax, "tree_map"):
    # JetStream 0.2.2 (archived in 2026) frees each prefix with `jax.tree_map`, which JAX removed in
    # 0.6: without the alias its generate thread dies at the first insert and the server hangs.
    jax.tree_map = jax.tree.map


def check_port(port: int) -> None:
  """Raises OSError if `port` is out of range or anything holds it on any interface: JetStream binds
  `[::]:port` (all interfaces), and a failed bind there would come later, less clearly."""
  if not 0 < port < 65536:
    raise ValueError(f"--port={port}: expected 1-65535")
  try:
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)  # dual-stack: IPv4 holders conflict too
    host = "::"
  except OSError:  # no IPv6 here
    s, host = socket.socket(socket.AF_INET, socket.SOCK_STREAM), "0.0.0.0"
  with s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind((host, port))
    except OSError as e:
      raise OSError(f"--port={port} is busy ({e.strerror}): pick another port or stop what holds it") from e


# EngineConfig's fields that build_engine sets from a ServeConfig's own fields and the model directory
_SERVE_SETS = ("n_slots", "page_size", "n_pages", "max_len", "decode_chunk", "eos_ids", "pad_id", "sampling", "impl")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  slots: int = 16  # concurrent sequences (JetStream's max_concurrent_decodes)
  max_len: int = 512  # prompt + completion tokens per sequence
  max_new_tokens: int = 256  # cap per request (a request's max_tokens cuts earlier)
  page_size: int = 16
  decode_chunk: int = 8
  data: int = 1  # rollout mesh
  tensor: int = 1
  dtype: str = "float32"
  greedy: bool = True
  temperature: float = 1.0  # when not greedy, as are top_p, top_k and min_p (rollout/sampling.py)
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  seed: int = 0
  policy: str = "finish_on_old"  # how a hot weight swap lands
  read: str = "auto"  # the engine's paged decode read (EngineConfig.impl; rollout/paged.py)
  # other EngineConfig knobs by name (kv_dtype, min_pack_rows, min_window_tokens, ...), not the ones set above: a
  # mapping or (name, value) pairs, kept as sorted pairs (the config stays immutable and hashable)
  engine: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    from jaxrl_topo.rollout.paged import check_read

    for name in ("slots", "max_len", "max_new_tokens", "page_size", "decode_chunk", "data", "tensor"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name}={getattr(self, name)} must be positive")
    if self.page_size > self.max_len:  # max_len is rounded down to whole pages: none would be left
      raise ValueError(f"page_size={self.page_size} must be <= max_len={self.max_len}")
    check_read(self.read, "read")
    if self.slots % self.data:
      raise ValueError(f"slots={self.slots} must split over data={self.data}")
    self.sampling  # noqa: B018  (validates temperature / top-k / top-p / min-p now)
    object.__setattr__(self, "engine", tuple(sorted(engine_options(self.engine, _SERVE_SETS, "serving").items())))

  @property
  def sampling(self) -> SamplingConfig:
    if self.greedy:
      return SamplingConfig(greedy=True)
    return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)


def resolve_model_dir(model_dir: str | None, workdir: str | None) -> str:
  """The HF directory to serve: --model as given, or --workdir's newest checkpoint exported."""
  if (model_dir is None) == (workdir is None):
    raise ValueError("give exactly one of --model=DIR (an HF directory) or --workdir=RUN (a training run)")
  if model_dir is not None:
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
      raise FileNotFoundError(f"--model={model_dir}: no config.json there (expected a local Hugging Face directory)")
    return model_dir
  if not os.path.isfile(os.path.join(workdir, "config.json")):
    raise FileNotFoundError(f"--workdir={workdir}: no config.json there (expected a run of launchers/train.py)")
  from jaxrl_topo.runtime.export import export
  out = export_dir(workdir)
  step = export(workdir, out)
  print(f"serving the policy of step {step} of {workdir} (exported to {out})", flush=True)
  return out


def export_dir(workdir: str) -> str:
  """Where this server process exports a run's checkpoints (its own: servers of one run never share it)."""
  return os.path.join(workdir, "serve_hf", str(os.getpid()))


def newest_step(workdir: str) -> int | None:
  """The newest complete checkpoint of a run (None if it has none yet)."""
  from jaxrl_topo.runtime.checkpoint import Checkpointer

  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return None
  with Checkpointer(directory, async_save=False, read_only=True) as ckpt:
    return ckpt.latest_step()


def follow_run(js_engine, workdir: str, sc: ServeConfig, stop: threading.Event, *, every_s: float = 30.0,
               served_step: int | None = None) -> None:
  """Until `stop`: every `every_s` seconds, a newer checkpoint of `workdir` is exported and swapped into
  the served engine under its policy, with its step as the gen_id (a run serving its latest policy)."""
  from jaxrl_topo.models import hf_io
  from jaxrl_topo.runtime.export import export
  from jaxrl_topo.topology.rules import ROLLOUT_RULES

  served = newest_step(workdir) if served_step is None else served_step
  mesh = js_engine.engine.mesh
  while not stop.wait(every_s):
    step = newest_step(workdir)
    if step is None or (served is not None and step <= served):
      continue
    out = export_dir(workdir)
    export(workdir, out, step=step)
    _, _, params = hf_io.load_model(out, mesh, ROLLOUT_RULES if mesh else None, dtype=sc.dtype)
    js_engine.swap_weights(params, gen_id=step)
    served = step
    print(f"swapped in the policy of step {step} (policy {js_engine.policy})", flush=True)


def build_engine(model_dir: str, sc: ServeConfig, *, gen_id: int = 0):
  """(JetStreamEngine, tokenizer or None) with the weights laid out on the rollout mesh; `gen_id` tags
  the served weights' version (a run's checkpoint step)."""
  from jaxrl_topo.models import hf_io
  from jaxrl_topo.models.tokenizer import Tokenizer, read_eos_token_ids
  from jaxrl_topo.rollout.engine import EngineConfig, RolloutEngine
  from jaxrl_topo.serving.jetstream_engine import JetStreamEngine
  from jaxrl_topo.topology.rules import ROLLOUT_RULES, make_mesh

  n = sc.data * sc.tensor
  if n > jax.device_count():
    raise ValueError(f"data={sc.data} x tensor={sc.tensor} needs {n} devices; this process sees {jax.device_count()}")
  mesh = make_mesh({"data": sc.data, "tensor": sc.tensor}, jax.devices()[:n]) if n > 1 else None
  cfg = hf_io.read_config(model_dir, dtype=sc.dtype)
  limit = cfg.max_position
  if min(sc.max_len, limit) < sc.page_size:  # max_len is capped at the model's limit, then rounded down to pages
    raise ValueError(f"page_size={sc.page_size} exceeds the model's position limit {limit} "
                     "(max_position_embeddings): no whole page fits")
  graphdef, params = hf_io.load_params(model_dir, cfg, mesh, ROLLOUT_RULES if mesh else None)
  has_tok = os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
  tokenizer = Tokenizer.from_dir(model_dir) if has_tok else None
  eos = tuple(tokenizer.eos_token_ids if tokenizer else read_eos_token_ids(model_dir))
  pad = tokenizer.pad_token_id if tokenizer and tokenizer.pad_token_id is not None else 0
  max_len = min(sc.max_len, cfg.max_position)
  max_len -= max_len % sc.page_size
  ecfg = EngineConfig(n_slots=sc.slots, page_size=sc.page_size, n_pages=sc.slots * (max_len // sc.page_size),
                      max_len=max_len, decode_chunk=sc.decode_chunk, eos_ids=eos, pad_id=pad,
                      sampling=sc.sampling, impl=sc.read,
                      **dict(sc.engine))
  engine = RolloutEngine(graphdef, cfg, params, ecfg, gen_id=gen_id, seed=sc.seed, mesh=mesh,
                         detokenize=tokenizer.decode if tokenizer else None)
  return JetStreamEngine(engine, tokenizer=tokenizer, max_new_tokens=sc.max_new_tokens, policy=sc.policy), tokenizer


def start(js_engine, port: int, *, threads: int | None = None):
  """JetStream's gRPC server on `port` with `js_engine` interleaved on its mesh's devices; returns it
  (`.stop()` ends the orchestrator threads and the server)."""
  require_jetstream()
  from jetstream.core import config_lib, orchestrator, server_lib

  check_port(port)
  devices = list(js_engine.mesh.devices.flat)
  platform = devices[0].platform
  config = config_lib.ServerConfig(interleaved_slices=(f"{platform}={len(devices)}",),
                                   interleaved_engine_create_fns=(lambda _devices: js_engine,))
  before = set(threading.enumerate())
  try:
    return server_lib.run(port=port, config=config, devices=devices, threads=threads)
  except RuntimeError as e:
    # The port was taken after check_port. JetStream started its orchestrator's threads and its event-loop
    # thread (some not daemons) before the bind failed, and returns no handle: found by their targets and
    # stopped here, or the process never exits.
    drivers = set()
    for t in set(threading.enumerate()) - before:
      target = getattr(t, "_target", None)
      owner = getattr(getattr(target, "func", target), "__self__", None)
      if isinstance(owner, asyncio.AbstractEventLoop):
        owner.call_soon_threadsafe(owner.stop)
        t.join(timeout=10)
      elif isinstance(owner, orchestrator.Driver):
        drivers.add(owner)
    for driver in drivers:
      driver.stop()
    if "bind" in str(e):
      raise OSError(f"--port={port} is busy (JetStream could not bind [::]:{port}): pick another port") from e
    raise
