"""The Pallas decode kernel on a real GPU: correctness against float64 numpy, its read time against the XLA
(bucketed) read, and the engine through it against the dense decoder (issue 12, item 6).

  python benchmarks/pallas_check.py            # on a GPU; on CPU the kernel runs in interpret mode (slow, small)
  python benchmarks/pallas_check.py --checks=kernel,engine      # some checks only (kernel, engine, parts, read)

JSON lines out, one per check:
  kernel   max |kernel - float64 reference| over ragged rows and an idle one, per (N, K, H, S, dtype, splits);
           the idle row must be exactly 0.
  read     one layer's decode read at the Qwen2.5-0.5B shape (14 query / 2 KV heads, head_dim 64, pages of 16),
           bf16 pool, B rows of lognormal contexts (median `--median_ctx`): median µs of the bucketed XLA read and
           of the kernel at 1, 2, 4 and 8 pages per loop trip (`pallas:C`, 2 warps a program) and at the
           default pages per trip with 1, 4 (Pallas' own default) and 8 warps (`pallas:C:wN`) or each row's
           pages over 2, 3 and 6 programs (`pallas:C:sN`, merged in XLA), and GB/s of the K/V bytes the rows
           actually hold (what an ideal read touches).
  engine   RolloutEngine(impl=pallas / bucketed / auto) greedy on the tiny preset (fp32) against generate_dense,
           at matmul precision "highest" (log-probs within 1e-5 expected) and "default" (TF32 on a GPU): tokens
           equal, max |Δ log-prob|, and the read "auto" resolved to.
  parts    at `--parts_preset` (bf16) and the last of `--batches`: the LM head and full-vocabulary sampling
           (temperature 1, greedy), median ms, next to the weights' read time at the copy bandwidth.
"""

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.decode import copy_gbps, weight_bytes  # noqa: E402
from jaxrl_topo.models.model import cast_params, init_params  # noqa: E402
from jaxrl_topo.models.presets import get_preset  # noqa: E402
from jaxrl_topo.rollout.dense import DecodeConfig, bucket_length, generate_dense  # noqa: E402
from jaxrl_topo.rollout.engine import EngineConfig, Request, RolloutEngine  # noqa: E402
from jaxrl_topo.rollout.paged import _decode_bucketed  # noqa: E402
from jaxrl_topo.rollout.pallas_paged import decode_attention, default_pages_per_trip  # noqa: E402
from jaxrl_topo.rollout.sampling import SamplingConfig, sample_tokens, sequence_keys  # noqa: E402

PAGES_PER_TRIP_SWEEP = (1, 2, 4, 8)
NUM_WARPS_SWEEP = (1, 4, 8)  # at the default pages per trip, beside the kernel's default warps (2)
SPLITS_SWEEP = (2, 3, 6)  # programs per row (decode_attention's splits), at the default pages and warps


def emit(**row):
  print(json.dumps({"bench": "pallas_check", "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "date": datetime.date.today().isoformat(), **row}), flush=True)


def ragged_pool(rng, lengths, N, K, H, S, L=2, spare=4):
  """A pool holding `lengths` tokens per row on shuffled pages (garbage elsewhere), queries and the table."""
  pages = -(-lengths // S)
  P, M = int(pages.sum()) + spare, max(int(pages.max()), 1)
  perm = rng.permutation(P)
  table = np.full((len(lengths), M), -1, np.int32)
  at = 0
  for b, n in enumerate(pages):
    table[b, :n] = perm[at : at + n]
    at += n
  k, v = (rng.normal(size=(L, P, S, K, H)).astype(np.float32) for _ in range(2))
  q = rng.normal(size=(len(lengths), N, H)).astype(np.float32)
  return q, k, v, table


def numpy_read(q, k_PSKH, v_PSKH, table, pos):
  B, N, H = q.shape
  S, K = k_PSKH.shape[1:3]
  out = np.zeros((B, N, H))
  for b in range(B):
    if pos[b] < 0:
      continue
    ks = np.stack([k_PSKH[table[b, p // S], p % S] for p in range(pos[b] + 1)]).astype(np.float64)
    vs = np.stack([v_PSKH[table[b, p // S], p % S] for p in range(pos[b] + 1)]).astype(np.float64)
    for n in range(N):
      logit = ks[:, n // (N // K)] @ q[b, n] / np.sqrt(H)
      w = np.exp(logit - logit.max())
      out[b, n] = (w / w.sum()) @ vs[:, n // (N // K)]
  return out


def _as(x, dtype):
  return jnp.asarray(x).astype(dtype)


def check_kernel(rng):
  for (N, K, H, S) in [(14, 2, 64, 16), (4, 2, 16, 16), (32, 8, 128, 16), (16, 16, 64, 32)]:
    for dtype, splits in ((jnp.float32, 1), (jnp.bfloat16, 1), (jnp.float32, 3)):
      lengths = np.array([1, 17, 200, 0, 33, 64, 5, 129])
      q, k, v, table = ragged_pool(rng, lengths, N, K, H, S)
      c = functools.partial(_as, dtype=dtype)
      got = decode_attention(c(q), c(k), c(v), jnp.asarray(table), jnp.asarray(lengths - 1, jnp.int32),
                             layer=1, page_size=S, splits=splits)
      got = np.asarray(got.astype(jnp.float32))
      want = numpy_read(*(np.asarray(c(x).astype(jnp.float32)) for x in (q, k[1], v[1])), table, lengths - 1)
      emit(check="kernel", N=N, K=K, H=H, S=S, dtype=jnp.dtype(dtype).name, splits=splits,
           max_abs_err=float(np.abs(got - want).max()), idle_row_zero=bool((got[3] == 0).all()),
           finite=bool(np.isfinite(got).all()))


def timed(f, *args, repeats=50):
  jax.block_until_ready(f(*args))
  walls = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    walls.append(time.perf_counter() - t0)
  return statistics.median(walls)


def check_read(rng, batch, median_ctx):
  N, K, H, S = 14, 2, 64, 16
  lengths = np.clip(np.rint(rng.lognormal(np.log(median_ctx), 0.6, batch)), 1, 8 * median_ctx).astype(np.int64)
  q, k, v, table = ragged_pool(rng, lengths, N, K, H, S, L=1)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  table, pos = jnp.asarray(table), jnp.asarray(lengths - 1, jnp.int32)
  xla = jax.jit(lambda q, k, v, t, p: _decode_bucketed(q, k, v, 0, t, p, S, fold_heads=False))
  reads = {"bucketed": xla}
  for C in PAGES_PER_TRIP_SWEEP:
    reads[f"pallas:{C}"] = jax.jit(functools.partial(decode_attention, layer=0, page_size=S, pages_per_trip=C))
  C = default_pages_per_trip(S, H)
  for w in NUM_WARPS_SWEEP:
    reads[f"pallas:{C}:w{w}"] = jax.jit(functools.partial(decode_attention, layer=0, page_size=S, num_warps=w))
  for n in SPLITS_SWEEP:
    reads[f"pallas:{C}:s{n}"] = jax.jit(functools.partial(decode_attention, layer=0, page_size=S, splits=n))
  want = xla(q, k, v, table, pos).astype(jnp.float32)
  useful = float(lengths.sum()) * 2 * K * H * 2  # K and V, bf16
  for name, f in reads.items():
    err = float(jnp.abs(f(q, k, v, table, pos).astype(jnp.float32) - want).max())
    s = timed(f, q, k, v, table, pos)
    emit(check="read", impl=name, batch=batch, median_ctx=median_ctx, max_ctx=int(lengths.max()), us=s * 1e6,
         useful_gbps=useful / s / 1e9, max_abs_diff_vs_bucketed=err)


def check_engine(precision: str):
  """Greedy through the engine (kernel, XLA read, and what "auto" picks) against generate_dense, all under
  `jax.default_matmul_precision(precision)`: at "highest" the fp32 log-probs must agree within 1e-5 (the
  invariant the CPU tests hold); at "default" a GPU runs the model's fp32 matmuls in TF32."""
  cfg = get_preset("tiny")
  graphdef, params = init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(3, 40, 12)]
  greedy = SamplingConfig(greedy=True)
  rows = np.zeros((len(prompts), bucket_length(max(map(len, prompts)), 8)), np.int32)
  for r, p in enumerate(prompts):
    rows[r, : len(p)] = p
  lens = np.asarray([len(p) for p in prompts], np.int32)
  with jax.default_matmul_precision(precision):
    toks, lps, n, _ = jax.device_get(generate_dense(
        graphdef, params, rows, lens, np.arange(len(prompts), dtype=np.int32), jax.random.key(0),
        decode=DecodeConfig(max_new_tokens=24, sampling=greedy, eos_ids=())))
    want = [(toks[r, : n[r]].tolist(), lps[r, : n[r]]) for r in range(len(prompts))]
    for impl in ("pallas", "bucketed", "auto"):
      ecfg = EngineConfig(n_slots=8, page_size=16, n_pages=64, max_len=128, impl=impl, sampling=greedy, eos_ids=())
      eng = RolloutEngine(graphdef, cfg, params, ecfg, seed=0)
      got = eng.run([Request(p, max_new_tokens=24) for p in prompts])
      diff = max(float(np.abs(np.subtract(g.logprobs, w[1])).max()) for g, w in zip(got, want, strict=True))
      emit(check="engine", precision=precision, impl=impl, resolved=eng.impl,
           tokens_equal=[g.tokens for g in got] == [w[0] for w in want], max_logprob_diff=diff)


def check_parts(batch: int, preset: str):
  """What a decode step spends outside attention, at `preset` in bf16 with `batch` rows: the LM head
  (hidden -> logits) and sampling over the full vocabulary (temperature 1 and greedy), median ms each,
  next to the time the weights take to read once at the copy bandwidth (the step's floor without KV)."""
  cfg = dataclasses.replace(get_preset(preset), dtype="bfloat16")
  graphdef, params = init_params(cfg, jax.random.key(0), compiled=False)  # one program: ~1 min on GPU
  params = cast_params(params, jnp.bfloat16)
  bw = copy_gbps((512 if jax.default_backend() == "gpu" else 64) * 2**20)  # decode.py's copy test and sizes
  h = jax.random.normal(jax.random.key(1), (batch, 1, cfg.d_model), jnp.bfloat16)
  logits = jax.random.normal(jax.random.key(2), (batch, cfg.vocab_size), jnp.float32) * 3
  keys = sequence_keys(jax.random.key(3), jnp.arange(batch), jnp.full((batch,), 7))
  head = jax.jit(lambda p, h: nnx.merge(graphdef, p).logits(h))
  parts = {"lm_head": (head, params, h),
           "sample_t1": (jax.jit(lambda l, k: sample_tokens(l, k, SamplingConfig(temperature=1.0))), logits, keys),
           "sample_greedy": (jax.jit(lambda l, k: sample_tokens(l, k, SamplingConfig(greedy=True))), logits, keys)}
  row = {"weights_at_copy_ms": weight_bytes(params) / (bw * 1e9) * 1e3, "copy_gbps": bw}
  for name, (f, *args) in parts.items():
    row[f"{name}_ms"] = timed(f, *args, repeats=20) * 1e3
  emit(check="parts", preset=preset, batch=batch, vocab=cfg.vocab_size, weight_bytes=weight_bytes(params),
       **row)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", default="256", help="read: comma-separated row counts")
  parser.add_argument("--median_ctx", default="384", help="read: comma-separated median contexts")
  parser.add_argument("--parts_preset", default="qwen2.5-0.5b", help="parts: the model shape (bf16)")
  parser.add_argument("--checks", default="kernel,engine,parts,read", help="comma-separated checks to run")
  args = parser.parse_args()
  wanted = args.checks.split(",")
  unknown = set(wanted) - {"kernel", "engine", "parts", "read"}
  if unknown:
    parser.error(f"--checks: unknown {sorted(unknown)} (kernel, engine, parts, read)")
  rng = np.random.default_rng(0)
  checks = [("kernel", functools.partial(check_kernel, rng)), ("engine", functools.partial(check_engine, "highest")),
            ("engine", functools.partial(check_engine, "default")),
            ("parts", functools.partial(check_parts, int(args.batches.split(",")[-1]), args.parts_preset))]
  checks += [("read", functools.partial(check_read, rng, int(b), int(c)))
             for b in args.batches.split(",") for c in args.median_ctx.split(",")]
  failed = 0
  # a check that fails (a lowering error, say) is reported and the rest still run
  for name, check in [(n, c) for n, c in checks if n in wanted]:
    try:
      check()
    except Exception as e:  # noqa: BLE001
      failed += 1
      traceback.print_exc()
      emit(check=name, error=f"{type(e).__name__}: {e}"[:2000])
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
