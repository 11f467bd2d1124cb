"""Worker processes for user code: one spawned interpreter per worker, answering calls over a pipe until told to
stop. `WorkerPool` is what the reward pool (reward_pool.py) and the environment pool (env_pool.py) share: starting
workers, replacing one that hangs or dies, and waiting for replies, deaths and deadlines."""

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import signal
import sys
import time
import weakref

from jaxrl_topo.envs import rewards

KILL_GRACE_S = 1.0  # after SIGTERM, this long before SIGKILL


def worker_main(conn, sys_path: list[str], paths: list[str]) -> None:
  """Worker loop: resolve the functions, report ready, then answer (k, prompts, completions, metadata) calls."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  sys.path[:] = list(sys_path) + [p for p in sys.path if p not in sys_path]
  try:
    fns = [rewards.resolve(p) for p in paths]
  except Exception as e:
    conn.send(("init_error", str(e)))
    return
  conn.send(("ready", None))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):  # the parent went away
      return
    if msg is None:
      return
    k, prompts, completions, metadata = msg
    try:
      out = fns[k](prompts, completions, metadata)
    except Exception as e:
      reply = ("error", f"raised {type(e).__name__}: {e}")
    else:
      try:
        reply = ("ok", scores_of(out))
      except (TypeError, ValueError) as e:
        reply = ("error", f"returned an unusable value ({e})")
    conn.send(reply)


def scores_of(out) -> list[float]:
  """A reward function's return value as floats: a sequence of real numbers (numpy ones and bools too). A string,
  or an item that is no number (before: float() took "1.0"), is a TypeError saying what it got."""
  if isinstance(out, str | bytes) or not hasattr(out, "__iter__"):
    raise TypeError(f"returned {type(out).__name__} {out!r:.40}; expected a list of numbers, one per completion")
  scores = []
  for x in out:
    if isinstance(x, str | bytes):
      raise TypeError(f"returned a {type(x).__name__} score {x!r:.40}; scores are numbers")
    scores.append(float(x))
  return scores


class Worker:
  """One worker process and the parent's end of its pipe, plus the call it is running, if any."""

  def __init__(self, ctx, sys_path: list[str], paths: list[str], start_timeout_s: float, target=None,
               name: str = "reward-worker"):
    self.conn, child_conn = ctx.Pipe(duplex=True)
    self.proc = ctx.Process(target=target or worker_main, args=(child_conn, sys_path, paths), daemon=True, name=name)
    self.proc.start()
    child_conn.close()
    self.ready = False
    self.start_deadline = time.monotonic() + start_timeout_s
    self.call: tuple[int, int, int, int] | None = None  # (ticket, function index, lo, hi)
    self.deadline = math.inf

  def stop(self, *, graceful: bool = True) -> None:
    """Asks an idle worker to exit (if `graceful`); terminates, then kills, one that does not. Always joins."""
    if graceful and self.proc.is_alive() and self.ready and self.call is None:
      with contextlib.suppress(OSError):
        self.conn.send(None)
      self.proc.join(KILL_GRACE_S)
    if self.proc.is_alive():
      self.proc.terminate()
      self.proc.join(KILL_GRACE_S)
    if self.proc.is_alive():
      self.proc.kill()
      self.proc.join()
    self.conn.close()


def stop_all(workers: list[Worker]) -> None:
  for w in workers:
    w.stop()
  workers.clear()


class WorkerPool:
  """Killable workers. A subclass names them (`what`, e.g. "a reward worker"), says what one runs
  (`_new_worker`), and takes each finished call (`_finished(call, kind, payload)`: kind "ok" with the worker's
  reply; "error" or "timeout" with why it failed); it sets `timeout_s` and dispatches calls itself (setting each
  busy worker's `call` and `deadline`)."""

  what = "a worker"
  start_key = "start_timeout_s"  # the config key that sets the start timeout, for messages
  timeout_s: float

  def _start_workers(self, n: int, start_timeout_s: float) -> None:
    """Starts `n` workers and waits until each has reported ready (a failure to start raises, workers stopped)."""
    self._ctx = multiprocessing.get_context("spawn")
    self._start_timeout_s = start_timeout_s
    self._workers: list[Worker] = []
    self._finalizer = weakref.finalize(self, stop_all, self._workers)
    try:
      self._workers += [self._new_worker() for _ in range(n)]
      while not all(w.ready for w in self._workers):
        self._wait(None)
    except BaseException:
      self.close()
      raise

  def _new_worker(self) -> Worker:
    raise NotImplementedError

  def _finished(self, call, kind: str, payload) -> None:
    raise NotImplementedError

  def close(self) -> None:
    """Stops and joins every worker. Idempotent."""
    self._finalizer()

  def _replace(self, w: Worker) -> None:
    w.stop(graceful=False)
    self._workers[self._workers.index(w)] = self._new_worker()

  def _wait(self, timeout: float | None) -> None:
    """Waits for one event (a reply, a death, a deadline; at most `timeout` s when given) and handles every event
    that has happened: a call past its deadline is a "timeout" and its worker is replaced."""
    active = [w for w in self._workers if w.call is not None or not w.ready]
    deadlines = [w.deadline if w.ready else w.start_deadline for w in active]
    wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
    if timeout is not None:
      wait = timeout if wait is None else min(wait, timeout)
    watched = [x for w in active for x in (w.conn, w.proc.sentinel)]
    fired = set(multiprocessing.connection.wait(watched, wait)) if watched else set()
    now = time.monotonic()
    for w in list(self._workers):
      if w.conn in fired or w.proc.sentinel in fired:
        self._collect(w)
      elif w.call is not None and now >= w.deadline:
        self._finished(w.call, "timeout", f"ran past timeout_s={self.timeout_s}; worker killed and replaced")
        self._replace(w)
      elif not w.ready and now >= w.start_deadline:
        raise RuntimeError(f"{self.what} did not start within {self._start_timeout_s} s: its imports may be slow, or "
                           f"the machine loaded; raise {self.start_key}")

  def _collect(self, w: Worker) -> None:
    try:
      kind, payload = w.conn.recv() if w.conn.poll() else ("died", None)
    except (EOFError, OSError):
      kind, payload = "died", None
    if kind == "ready":
      w.ready = True
    elif kind == "init_error":
      raise RuntimeError(f"{self.what} could not resolve what it runs: {payload}")
    elif not w.ready:
      raise RuntimeError(f"{self.what} died while starting (exit code {w.proc.exitcode}). Workers are spawned and "
                         "import your main module again: a script that starts training must do so under "
                         "`if __name__ == \"__main__\":`")
    elif kind == "died":
      w.proc.join(KILL_GRACE_S)  # reap it, so that its exit code is known
      self._finished(w.call, "error", f"killed its worker process (exit code {w.proc.exitcode}); replaced")
      self._replace(w)
    else:
      call, w.call, w.deadline = w.call, None, math.inf
      self._finished(call, kind, payload)
