"""EnvPool: environment calls (env.replay) in killable worker processes, with a timeout per call.

The reward pool's rules (reward_pool.py) for user code that may raise, hang or crash: each call runs
in a spawned worker; a call that raises, returns garbage or kills its worker comes back as an error,
one that runs past `timeout_s` as a timeout (its worker is killed and replaced), and the pool goes
on. Calls are (key, example, model texts so far); results come back as they finish, by key.
`n_workers=0` runs calls inline at submit (no timeouts: tests and small demos).
"""

from __future__ import annotations

import collections
import signal
import sys
import time
from collections.abc import Hashable, Mapping, Sequence

from jaxrl_topo.envs import env as env_lib
from jaxrl_topo.envs.reward_worker import Worker, WorkerPool


def env_worker_main(conn, sys_path: list[str], paths: list[str]) -> None:
  """Worker loop: resolve the environment, report ready, answer (example, texts) calls with replay's result."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  sys.path[:] = list(sys_path) + [p for p in sys.path if p not in sys_path]
  try:
    make_env = env_lib.resolve(paths[0])
  except Exception as e:
    conn.send(("init_error", str(e)))
    return
  conn.send(("ready", None))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    try:
      reply = ("ok", env_lib.replay(make_env, *msg))
    except Exception as e:
      reply = ("error", f"raised {type(e).__name__}: {e}")
    conn.send(reply)


Result = tuple[Hashable, str, object]  # (key, "ok" | "error" | "timeout", replay's result or the reason)


class EnvPool(WorkerPool):
  """One environment (import path) run in `n_workers` killable processes. See the module docstring."""

  what = "an environment worker"
  start_key = "env.start_timeout_s"

  def __init__(self, path: str, *, n_workers: int = 2, timeout_s: float = 10.0, start_timeout_s: float = 60.0):
    if n_workers < 0 or timeout_s <= 0:
      raise ValueError(f"need n_workers >= 0 and timeout_s > 0; got {n_workers}, {timeout_s}")
    self.path, self.timeout_s = path, timeout_s
    self._make = env_lib.resolve(path)  # fails here, before any worker starts
    self._todo: collections.deque = collections.deque()
    self._done: list[Result] = []
    self._start_workers(n_workers, start_timeout_s)

  def _new_worker(self) -> Worker:
    return Worker(self._ctx, list(sys.path), [self.path], self._start_timeout_s, target=env_worker_main,
                  name="env-worker")

  def _finished(self, call, kind: str, payload) -> None:
    self._done.append((call, kind, payload))

  def submit(self, key: Hashable, example: Mapping, model_texts: Sequence[str]) -> None:
    if not self._workers:
      try:
        self._done.append((key, "ok", env_lib.replay(self._make, example, list(model_texts))))
      except Exception as e:
        self._done.append((key, "error", f"raised {type(e).__name__}: {e}"))
      return
    self._todo.append((key, dict(example), list(model_texts)))
    self._dispatch()

  def busy(self) -> bool:
    return bool(self._todo or any(w.call is not None for w in self._workers))

  def poll(self, block: bool = False) -> list[Result]:
    """Finished calls; with `block`, waits until there is at least one (if any call is pending)."""
    self._dispatch()
    self._wait(0.0)
    self._dispatch()
    while block and not self._done and self.busy():
      self._wait(None)
      self._dispatch()
    out, self._done = self._done, []
    return out

  def _dispatch(self) -> None:
    for w in self._workers:
      if self._todo and w.ready and w.call is None:
        key, example, texts = self._todo.popleft()
        try:
          w.conn.send((example, texts))
        except OSError:
          self._todo.appendleft((key, example, texts))
          self._replace(w)
          continue
        w.call, w.deadline = key, time.monotonic() + self.timeout_s

  def __enter__(self) -> EnvPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
