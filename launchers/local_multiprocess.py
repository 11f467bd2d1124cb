"""Run a command as N cooperating JAX processes on this machine (jax.distributed over localhost).

  python launchers/local_multiprocess.py --num_processes=2 --devices_per_process=4 -- \
      python my_script.py --flag=value

Each child gets JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID (read by
`jaxrl_topo.runtime.distributed.initialize`) and, on CPU, that many fake devices. Output lines are
prefixed with [pN]; if one process fails the others are stopped and the exit code is non-zero.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

from absl import app, flags

_N = flags.DEFINE_integer("num_processes", 2, "Processes to start.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "Fake CPU devices per process (CPU only).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 600, "Kill everything after this many seconds.")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def child_env(process_id: int, num_processes: int, port: int, devices: int, base=os.environ) -> dict:
  env = dict(base)
  env.update(JAXRL_COORDINATOR=f"localhost:{port}", JAXRL_NUM_PROCESSES=str(num_processes),
             JAXRL_PROCESS_ID=str(process_id), PYTHONUNBUFFERED="1")
  if env.get("JAX_PLATFORMS", "cpu") == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return env


def run(command: Sequence[str], num_processes: int, devices_per_process: int, timeout_s: int = 600) -> int:
  """Starts the processes, streams their output, returns the first non-zero exit code (or 0)."""
  port = free_port()
  procs = [subprocess.Popen(list(command), env=child_env(i, num_processes, port, devices_per_process),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(num_processes)]

  def pump(i, p):
    for line in p.stdout:
      sys.stdout.write(f"[p{i}] {line}")

  threads = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
  for t in threads:
    t.start()
  code = 0
  try:
    for p in procs:
      rc = p.wait(timeout=timeout_s)
      if rc and not code:
        code = rc
        for q in procs:  # one failed: the others would wait forever in a collective
          q.kill()
  except subprocess.TimeoutExpired:
    code = 124
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for t in threads:
      t.join(timeout=5)
  return code


def main(argv: Sequence[str]) -> None:
  if len(argv) < 2:
    raise app.UsageError("give the command after --, e.g. -- python script.py")
  sys.exit(run(argv[1:], _N.value, _DEVICES.value, _TIMEOUT.value))


if __name__ == "__main__":
  app.run(main)
