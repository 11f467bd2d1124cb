"""The reward pool's worker processes (reward_pool.py): one spawned interpreter per worker, answering
(function index, prompts, completions, metadata) calls over a pipe until told to stop."""

import contextlib
import math
import signal
import sys
import time

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
      reply = ("ok", [float(x) for x in fns[k](prompts, completions, metadata)])
    except Exception as e:
      reply = ("error", f"raised {type(e).__name__}: {e}")
    conn.send(reply)


class Worker:
  """One worker process and the parent's end of its pipe, plus the call it is running, if any."""

  def __init__(self, ctx, sys_path: list[str], paths: list[str], start_timeout_s: float, target=None):
    self.conn, child_conn = ctx.Pipe(duplex=True)
    self.proc = ctx.Process(target=target or worker_main, args=(child_conn, sys_path, paths), daemon=True,
                            name="reward-worker")
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
