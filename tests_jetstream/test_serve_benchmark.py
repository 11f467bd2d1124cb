"""benchmarks/serve.py (the JetStream load test) runs at its smallest setting and prints one row per client count.

It runs nowhere else, and `make test-benchmarks` cannot run it (it needs this venv's JetStream). Times nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_serve_benchmark_runs_and_prints_a_row_per_client_count(tmp_path):
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,  # the server: one device
         "TMPDIR": str(tmp_path)}  # where its random model and the server's log go, and must not stay
  cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "serve.py"), "--clients=1,2", "--requests=4",
         "--prompt_len=8", "--max_tokens=6", "--slots=4"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert [r["clients"] for r in rows] == [1, 2]
  for r in rows:  # each request returns at least its first token and at most --max_tokens
    assert r["requests"] == 4 and 4 <= r["tokens"] <= 4 * 6 and r["requests_per_s"] > 0
    assert r["latency_p50_s"] <= r["latency_p99_s"]
  assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("serve_")], "the benchmark left its temp files"
