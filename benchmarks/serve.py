"""Load test of the JetStream server (issue 16): requests/s, tokens/s and latency percentiles for 1-64
concurrent clients on localhost. Needs the jetstream extra (`make test-jetstream` builds .venv-jetstream).

  .venv-jetstream/bin/python benchmarks/serve.py [--model=DIR] [--clients=1,4,16,64] [--requests=64]

Without --model it writes a random-init `tiny` model (untied, char tokenizer) to a temp dir. The server is
launchers/serve.py in its own process (as a user starts it; greedy, --slots slots); the clients are threads
here, each sending token requests of --prompt_len random ids with max_tokens=--max_tokens, back to back.
One JSON line per client count on stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _one(stub, ids, max_tokens) -> tuple[float, int]:
  from jaxrl_topo.serving import client

  t = time.perf_counter()
  n = len(client.decode_ids(stub, ids, max_tokens))
  return time.perf_counter() - t, n


def run_clients(stub, clients: int, n_requests: int, prompt_len: int, max_tokens: int, vocab: int) -> dict:
  rng = np.random.default_rng(clients)
  prompts = [rng.integers(3, vocab, size=prompt_len).tolist() for _ in range(n_requests)]
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = list(pool.map(lambda p: _one(stub, p, max_tokens), prompts))
  wall = time.perf_counter() - t0
  lat = np.asarray([r[0] for r in results])
  tokens = sum(r[1] for r in results)
  return {"clients": clients, "requests": n_requests, "wall_s": wall, "requests_per_s": n_requests / wall,
          "tokens_per_s": tokens / wall, "tokens": tokens, "latency_p50_s": float(np.percentile(lat, 50)),
          "latency_p99_s": float(np.percentile(lat, 99))}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default=None)
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--clients", default="1,2,4,8,16,32,64")
  ap.add_argument("--requests", type=int, default=64, help="requests per client count (at least 2 per client)")
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--max_tokens", type=int, default=64)
  ap.add_argument("--slots", type=int, default=32)
  ap.add_argument("--port", type=int, default=0)
  args = ap.parse_args()

  from jaxrl_topo.models.fresh import write_fresh_model
  from jaxrl_topo.models.presets import get_preset

  with tempfile.TemporaryDirectory(prefix="serve_bench_") as tmp:  # the random model and the server's log
    model = args.model
    if model is None:
      model = os.path.join(tmp, "model")
      write_fresh_model(model, dataclasses.replace(get_preset(args.preset), tie_embeddings=False), seed=0)
    with open(os.path.join(tmp, "server.log"), "w+") as log:
      _serve_and_load(args, model, log)


def _serve_and_load(args, model: str, log) -> None:
  """Starts launchers/serve.py on `model`, warms it up, prints one row per client count, and stops it."""
  import jax

  from jaxrl_topo import cli
  from jaxrl_topo.models import hf_io
  from jaxrl_topo.serving import client

  vocab = min(hf_io.read_config(model).vocab_size, 200)
  port = args.port or cli.free_port()
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "serve.py"), f"--model={model}", f"--port={port}",
         f"--slots={args.slots}", f"--max_len={args.prompt_len + args.max_tokens + 32}",
         f"--max_new_tokens={args.max_tokens}"]
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
  try:
    stub = client.connect(port)
    client.wait_live(stub, proc=proc, log=log)
    run_clients(stub, 4, 8, args.prompt_len, args.max_tokens, vocab)  # warm-up: compiles every bucket
    for c in (int(x) for x in args.clients.split(",")):
      row = run_clients(stub, c, max(args.requests, 2 * c), args.prompt_len, args.max_tokens, vocab)
      row.update(model=args.model or f"random {args.preset} (untied)", slots=args.slots,
                 prompt_len=args.prompt_len, max_tokens=args.max_tokens, device=f"{jax.devices()[0].platform}",
                 jax=jax.__version__, date=time.strftime("%Y-%m-%d"))
      print(json.dumps(row), flush=True)
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:  # print where it hangs (launchers/serve.py dumps stacks on SIGUSR1)
      proc.send_signal(signal.SIGUSR1)
      time.sleep(2)
      proc.kill()
      log.seek(0)
      print(log.read()[-6000:], file=sys.stderr)
      raise

if __name__ == "__main__":
  main()
