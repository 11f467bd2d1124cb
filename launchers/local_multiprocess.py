r"""Run a command as N cooperating JAX processes on this machine (jax.distributed over localhost).

  python launchers/local_multiprocess.py --num_processes=2 --devices_per_process=4 -- \
      python my_script.py --flag=value

Each child gets JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID (read by
`jaxrl_topo.runtime.distributed.initialize`) and, on CPU (JAX_PLATFORMS=cpu, or no accelerator
visible), that many fake devices, added to the user's XLA_FLAGS. Output lines are prefixed with
[pN]. As soon as one process exits non-zero the others are stopped, the failed one's last lines are
repeated, and its exit code is returned. A command starting with `python` runs under this launcher's interpreter.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from absl import app, flags

from jaxrl_topo import cli

_N = flags.DEFINE_integer("num_processes", 2, "Processes to start.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "Fake CPU devices per process (CPU only).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 600, "Kill everything after this many seconds.")


def child_env(process_id: int, num_processes: int, port: int, devices: int, base=os.environ) -> dict:
  """The child's environment: the jax.distributed contract, and `devices` fake CPU devices when the run
  is on CPU (JAX_PLATFORMS=cpu). Without JAX_PLATFORMS the machine is left as it is (a GPU host runs on
  its GPUs); the user's other XLA_FLAGS are kept, only the fake-device count is set."""
  env = dict(base)
  env.update(JAXRL_COORDINATOR=f"localhost:{port}", JAXRL_NUM_PROCESSES=str(num_processes),
             JAXRL_PROCESS_ID=str(process_id), PYTHONUNBUFFERED="1")
  if env.get("JAX_PLATFORMS") == "cpu" or (devices and _no_accelerator(env)):
    env["JAX_PLATFORMS"] = "cpu"
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*kept, f"{_COUNT_FLAG}={devices}"])
  return env


_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _no_accelerator(env) -> bool:
  """True when JAX_PLATFORMS is unset and no GPU/TPU is visible (checked without starting JAX)."""
  if env.get("JAX_PLATFORMS"):
    return False
  if env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
    return True
  return not (os.path.exists("/dev/nvidia0") or os.path.exists("/dev/accel0"))


_TAIL = 30  # lines of a failed process's output repeated at the end


def run(command: Sequence[str], num_processes: int, devices_per_process: int, timeout_s: int = 600,
        grace_s: float = 5.0) -> int:
  """Starts the processes and streams their output; as soon as one exits non-zero the others are
  stopped (SIGTERM, then SIGKILL after `grace_s`), and the first failure's last lines are repeated.
  Returns the first non-zero exit code, 124 on timeout, else 0."""
  port = cli.free_port()
  procs = [subprocess.Popen(list(command), env=child_env(i, num_processes, port, devices_per_process),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")  # a byte that is not UTF-8 must not stop the pump (the child would block)
           for i in range(num_processes)]
  tails = [collections.deque(maxlen=_TAIL) for _ in procs]
  lock = threading.Lock()

  def pump(i, p):
    for line in p.stdout:
      tails[i].append(line)
      with lock:
        sys.stdout.write(f"[p{i}] {line}")
        sys.stdout.flush()

  threads = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
  for t in threads:
    t.start()
  code, first, deadline = 0, None, time.monotonic() + timeout_s
  try:
    while any(p.poll() is None for p in procs):
      failed = [i for i, p in enumerate(procs) if p.poll()]
      if failed:
        first = failed[0]
        code = procs[first].returncode
        break
      if time.monotonic() > deadline:
        code = 124
        break
      time.sleep(0.05)
    else:
      failed = [i for i, p in enumerate(procs) if p.returncode]
      if failed:
        first = failed[0]
        code = procs[first].returncode
  finally:
    _stop(procs, grace_s)
    for t in threads:
      t.join(timeout=5)
  if code == 124:
    print(f"local_multiprocess: timed out after {timeout_s} s; stopped all {num_processes} processes",
          file=sys.stderr)
  elif first is not None:
    code = code if code > 0 else 128 - code  # killed by a signal: the shell's convention
    others = [i for i in range(num_processes) if i != first]
    print(f"local_multiprocess: process {first} failed (exit code {procs[first].returncode}); stopped "
          f"process{'es' if len(others) > 1 else ''} {', '.join(map(str, others))}. Its last lines:\n"
          + "".join(f"  [p{first}] {line}" for line in tails[first]), file=sys.stderr, end="")
  return code


def _stop(procs, grace_s: float) -> None:
  for p in procs:
    if p.poll() is None:
      p.terminate()
  end = time.monotonic() + grace_s
  for p in procs:
    try:
      p.wait(timeout=max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def main(argv: Sequence[str]) -> None:
  if len(argv) < 2:
    raise app.UsageError("give the command after --, e.g. -- python script.py")
  if _N.value < 1 or _DEVICES.value < 1 or _TIMEOUT.value < 1:
    raise app.UsageError(f"--num_processes={_N.value}, --devices_per_process={_DEVICES.value} and "
                         f"--timeout_s={_TIMEOUT.value} must each be >= 1")
  sys.exit(run(with_this_python(argv[1:]), _N.value, _DEVICES.value, _TIMEOUT.value))


def with_this_python(command: Sequence[str]) -> list[str]:
  """A command starting with `python` or `python3` runs under this launcher's own interpreter (its venv, whether
  or not the venv is activated in the shell)."""
  command = list(command)
  if command and command[0] in ("python", "python3"):
    command[0] = sys.executable
  return command


if __name__ == "__main__":
  cli.launch(main)
