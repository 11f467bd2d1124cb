"""README's serving commands, as written, in .venv-jetstream (tests/test_readme.py leaves them here).

The block's `make` line is what built this venv. `launchers/serve.py` runs until stopped: each serve
command is started, asked one request through JetStream's client once live, and stopped with SIGTERM
(exit 0). `--workdir=runs/grpo` is the Quickstart's run: a 2-step run of the same command stands in.
"""

import os
import re
import signal
import subprocess
import sys

from jetstream.core.proto import jetstream_pb2

from jaxrl_topo.serving import client

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_readme import SMALL, blocks, commands  # noqa: E402


def _serving_commands() -> list[str]:
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  block = next(body for lang, body in blocks(text) if lang == "sh" and "launchers/serve.py" in body)
  return [c for c in commands(block) if not c.startswith("make ")]


def _serve_once(cmd: str, cwd, env, log_path) -> None:
  port = int(re.search(r"--port=(\d+)", cmd).group(1))
  with open(log_path, "w+") as log:
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      stub = client.connect(port)
      client.wait_live(stub, proc=proc, log=log)
      req = jetstream_pb2.DecodeRequest(text_content=jetstream_pb2.DecodeRequest.TextContent(text="abc"),
                                        max_tokens=4)
      list(stub.Decode(req, timeout=120))
      os.killpg(proc.pid, signal.SIGTERM)
      log.seek(0)
      assert proc.wait(timeout=60) == 0, f"{cmd}:\n{log.read()[-3000:]}"
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def test_readme_serving_commands_run_as_written(tmp_path):
  cmds = _serving_commands()
  assert any("--model=" in c for c in cmds) and any("--workdir=" in c for c in cmds), cmds
  for name in ("launchers", "configs", "benchmarks", ".venv-jetstream"):
    os.symlink(os.path.join(ROOT, name), tmp_path / name)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env["JAX_PLATFORMS"] = "cpu"
  py = os.path.join(ROOT, ".venv-jetstream", "bin", "python")
  train = (f"{py} launchers/train.py --config=configs/grpo_task.py:tiny --workdir=runs/grpo {SMALL} "
           "--config.run.checkpoint_every=2")
  r = subprocess.run(["bash", "-c", train], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  for i, cmd in enumerate(cmds):
    if "launchers/serve.py" in cmd:
      _serve_once(cmd, tmp_path, env, tmp_path / f"serve{i}.log")
    else:
      r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
      assert r.returncode == 0, f"README command failed: {cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
