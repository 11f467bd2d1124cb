"""Decode throughput and memory-bandwidth utilisation: the paged engine against the dense reference (issues 4, 12).

  python benchmarks/decode.py                      # long-tail workload, tiny preset; on CPU batches 1,4,16,
                                                   # the default read (window) and bucketed beside dense
  python benchmarks/decode.py --workload=fixed     # fixed-length workload (issue 12), batches 8,32
  python benchmarks/decode.py --workload=pool      # one decode chunk's step time vs pool size and context
  python benchmarks/decode.py --workload=fixed --preset=qwen2.5-0.5b --dtype=bfloat16 --batches=256 \
      --prompt_len=128 --new_tokens=256 --repeats=5 --impl=dense,paged:pallas,paged:bucketed
                        # the H100 target (MBU >= 60% at batch 256), the Pallas kernel and the XLA read side by side
                        # (measured in RESULTS.md; about 2 minutes on an H100, most of it compiling); add
                        # --profile=DIR for a per-step kernel summary of each (a 'decode_profile' line)
  python benchmarks/decode.py --preset=qwen2.5-0.5b --dtype=bfloat16 --batches=256 --median_len=256 \
      --prompt_len=128 --kv_budget_gb=40 --impl=dense,paged:pallas --repeats=1
                        # the same on the long-tail workload (allow several minutes: one compile per live-row bucket)

Workload, per batch size B: `--n_seqs` (default 2B) prompts of `--prompt_len` random tokens, and for each a
completion length drawn from a lognormal with median `--median_len` and log-sd `--sigma`, rounded, clipped to
[1, cap], cap = 8 x median. Greedy decoding, no EOS: every sequence generates exactly its drawn length, so both
implementations do the same useful work whatever the (random-weight) model emits.
  paged  RolloutEngine, B slots, one Request(max_new_tokens=length) per sequence; continuous batching refills a
         slot as soon as its sequence ends. The pool holds B x ceil((prompt + cap) / page_size) pages (the memory
         the dense decoder takes, so nothing is preempted; `preemptions` reports it).
  dense  generate_dense (the reference decoder) over consecutive batches of B sequences; each batch decodes to its
         longest length (that is what a dense batch with EOS does). Its cache is sized prompt + that longest length,
         not prompt + cap, which flatters dense a little (a real run allocates and reads for the cap).
Fixed-length workload (`--workload=fixed`): the Llama-3-shaped model below (random init, fp32, untied; `--preset`
swaps in another shape), B prompts of `--prompt_len` (32) random tokens, exactly `--new_tokens` (64) new tokens
each (no EOS), temperature 1; tokens/s of new tokens over the whole call,
median of `--repeats` (20) after a warm-up. paged = RolloutEngine with B slots; dense = one generate_dense call.
Pool workload (`--workload=pool`): the same model, B = 8 slots prefilled to `--contexts` tokens, then one decode chunk
timed (median of `--repeats`, a fresh prefill before each); one line per (paged impl, pool pages, context):
`step_s` = chunk / the steps it ran (K, fewer where a `window` chunk ends at its longest row's edge: `steps_run`),
`insert_s` = one prompt's insert (its prefill and first token, read back): mean of a round's 8, median of rounds.
The engine's lines also report host_reads / uploads per 1000 generated tokens (blocking device-to-host reads;
calls carrying host data to the device), `occupancy` = slot-steps that emitted a token / slot-steps run (steps a
chunk skipped because every row had finished are not run), and `occupancy_queued`, the same over the chunks dispatched
while requests were waiting for a slot (what admission controls; the tail after the queue empties is the workload's;
null when no request ever waited),
and `occupancy_rows`, the same over the rows the steps computed (a step runs its shard's live rows packed into a
power-of-two batch, so idle slots cost nothing there).
Each configuration runs the whole workload once untimed (compiles every shape it needs), then `--repeats` times
timed, the implementations taking turns within each repeat (so load from other processes hits both alike)
(time.perf_counter around the run, results fetched to the host). One JSON line per (impl, batch):
  wall_s        median of the timed runs (all of them in wall_s_all), prefills and host work included
  decode_steps  batched one-token forward passes executed (dense: sum over batches of longest - 1, the first token
                comes from the prefill; paged: steps the chunks ran (a chunk stops once no row is live), idle slots in)
  step_s        wall_s / decode_steps;  tokens_per_s = generated tokens / wall_s
  bytes_per_step  weight bytes (all parameters, less an untied input embedding, of which a step reads B rows)
                + useful KV bytes / decode_steps. Useful KV bytes = what the attention must read: a sequence of
                prompt P and length L reads (L - 1) P + L (L - 1) / 2 cached tokens over its L - 1 decode steps,
                at kv_bytes_per_token = 2 x layers x kv_heads x head_dim x dtype bytes. The same total for both
                implementations; padding, finished rows and masked keys a step reads anyway are not counted.
  mbu           bytes_per_step / step_s / copy bandwidth; copy_gbps = 2 x bytes / time of a jitted `x + 1` over
                `--copy_mb` (best of 10) on the same device
  seqs_fit_*    sequences whose KV fits `--kv_budget_gb` (1 GB = 1e9 bytes) at once: dense reserves prompt + cap
                tokens per sequence; paged reserves ceil((prompt + L) / page_size) pages, averaged over 100,000 draws
                of the same length distribution (final lengths: a live sequence holds no more than that)
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from lengths import sample_lengths  # this script's folder is on sys.path

from jaxrl_topo.models.config import ModelConfig, num_params
from jaxrl_topo.models.model import cast_params, init_params
from jaxrl_topo.models.presets import PRESETS, get_preset
from jaxrl_topo.rollout.dense import DecodeConfig, bucket_length, generate_dense
from jaxrl_topo.rollout.engine import EngineConfig, Request, RolloutEngine
from jaxrl_topo.rollout.paged import IMPLS
from jaxrl_topo.rollout.sampling import SamplingConfig

GREEDY = SamplingConfig(greedy=True)
SAMPLED = SamplingConfig(temperature=1.0)
FIT_DRAWS = 100_000
# The fixed-length workload's model (issue 12): Llama-3 shape, 4 layers, random init.
FIXED_MODEL = ModelConfig(family="llama", vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                          head_dim=64, d_ff=512, rope_theta=500_000.0, tie_embeddings=False, dtype="float32")


def kv_bytes_per_token(cfg) -> int:
  return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def weight_bytes(params) -> int:
  """Parameter bytes one decode step reads: all of them, except an untied input embedding (B rows of it)."""
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  return total - (params["embed_tokens"].nbytes if "lm_head" in params else 0)


def useful_kv_tokens(lengths, prompt_len: int) -> int:
  """Cached tokens the decode steps must read: sum over sequences of (L - 1) P + L (L - 1) / 2."""
  L = np.asarray(lengths, np.int64)
  return int(((L - 1) * prompt_len + L * (L - 1) // 2).sum())


def copy_gbps(nbytes: int, repeats: int = 10) -> float:
  """Device copy bandwidth: 2 x bytes / best time of a jitted elementwise `x + 1` (read + write)."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda x: x + 1)
  jax.block_until_ready(f(x))
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    best = min(best, time.perf_counter() - t0)
  return 2 * x.nbytes / best / 1e9


def seqs_fit(cfg, budget: float, prompt_len: int, median: int, sigma: float, page_size: int, seed: int):
  """(paged, dense) sequences whose KV fits `budget` bytes at once."""
  per_tok = kv_bytes_per_token(cfg)
  dense = int(budget // ((prompt_len + 8 * median) * per_tok))
  L = sample_lengths(FIT_DRAWS, median, sigma, seed + 7)
  pages = np.ceil((prompt_len + L) / page_size).mean()
  return int(budget // (pages * page_size * per_tok)), dense


def paged_read(impl: str) -> tuple[str, int]:
  """--impl's engine name -> (EngineConfig.impl, pallas_splits): "paged" -> auto, "paged:pallas-s3" -> pallas with
  each row's page walk over 3 programs."""
  read, _, splits = (impl.partition(":")[2] or "auto").partition("-s")
  return read, int(splits or 0)


def paged_runner(graphdef, cfg, params, prompts, lengths, args, batch: int, sampling=GREEDY, read: str = "paged"):
  """A callable running the whole workload once on one engine: (generated tokens, decode steps, engine stats).
  `read`: the engine's name in --impl (paged = auto, paged:R with R one of paged.IMPLS, paged:pallas-sN)."""
  read, splits = paged_read(read)
  cap = int(max(lengths)) if args.workload == "fixed" else 8 * args.median_len
  ecfg = EngineConfig(n_slots=batch, page_size=args.page_size, max_len=args.prompt_len + cap, impl=read,
                      n_pages=batch * -(-(args.prompt_len + cap) // args.page_size), decode_chunk=args.decode_chunk,
                      max_chunk=args.max_chunk, sampling=sampling, eos_ids=(), overlap=not args.no_overlap,
                      min_window_tokens=args.min_window_tokens, min_pack_rows=args.min_pack_rows,
                      pallas_splits=splits)
  engine = RolloutEngine(graphdef, cfg, params, ecfg, seed=args.seed)
  requests = [Request(p, n=1, max_new_tokens=int(n)) for p, n in zip(prompts, lengths, strict=True)]

  def once():
    before = engine.stats.copy()
    samples = engine.run(requests)  # returns host lists: every chunk's tokens were fetched
    stats = engine.stats - before
    return sum(len(s.tokens) for s in samples), stats["slot_steps"] // batch, stats

  return once


def dense_runner(graphdef, cfg, params, prompts, lengths, args, batch: int, sampling=GREEDY):
  """A callable running consecutive batches of `batch` rows through `generate_dense`, each to its longest length:
  (tokens, decode steps, {}). A short last batch is padded with dummy rows, as generate_ids does."""
  T = bucket_length(args.prompt_len, 8)
  batches = []
  for i in range(0, len(prompts), batch):
    n = min(batch, len(prompts) - i)
    rows = np.zeros((batch, T), np.int32)
    rows[:n, : args.prompt_len] = prompts[i : i + n]
    lens = np.full((batch,), args.prompt_len, np.int32)
    seq_ids = np.where(np.arange(batch) < n, i + np.arange(batch), -1).astype(np.int32)
    decode = DecodeConfig(max_new_tokens=int(lengths[i : i + n].max()), sampling=sampling, eos_ids=())
    batches.append((rows, lens, seq_ids, decode, lengths[i : i + n]))
  key = jax.random.key(args.seed)

  def once():
    tokens = 0
    for rows, lens, seq_ids, decode, want in batches:
      _, _, n_B = jax.device_get(generate_dense(graphdef, params, rows, lens, seq_ids, key, decode=decode)[:3])
      tokens += int(np.minimum(n_B[: len(want)], want).sum())
    return tokens, sum(b[3].max_new_tokens - 1 for b in batches), {}

  return once


def timed(runs: dict, repeats: int) -> dict:
  """Each run once untimed (compiles every shape), then `repeats` rounds timing every run in turn, so
  load from other processes hits all of them alike: {name: (median wall_s, all walls, last result)}."""
  results = {}
  for name, once in runs.items():
    t0 = time.perf_counter()
    results[name] = once()
    print(f"[decode] {name}: warm-up (compiles) {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
  walls = {name: [] for name in runs}
  for rep in range(repeats):
    for name, once in runs.items():
      t0 = time.perf_counter()
      results[name] = once()
      walls[name].append(time.perf_counter() - t0)
    print(f"[decode] round {rep + 1}/{repeats}: " + ", ".join(f"{n} {w[-1]:.2f} s" for n, w in walls.items()),
          file=sys.stderr, flush=True)
  return {name: (statistics.median(walls[name]), walls[name], results[name]) for name in runs}


def profile_once(once, trace_dir: str, impl: str, batch: int, steps: int, common: dict):
  """One more (warm) run of `once` under jax.profiler, summarized per decode step: a 'decode_profile' line."""
  from trace_summary import summarize  # noqa: PLC0415 (only --profile needs it; this script's folder is on sys.path)

  t0 = time.perf_counter()
  with jax.profiler.trace(trace_dir):
    once()
  wall = time.perf_counter() - t0
  summary = summarize(trace_dir, top=40)
  for plane in summary["planes"]:
    for row in plane["lines"] + plane["top"] + plane["top_ops"]:
      row["per_step_us"] = 1e6 * row["sum_s"] / steps
  print(json.dumps({"bench": "decode_profile", "impl": impl, "batch": batch, "decode_steps": steps,
                    "traced_wall_s": wall, "traced_step_us": 1e6 * wall / steps, **summary,
                    **{k: common[k] for k in ("device", "jax", "date", "preset", "dtype")}}), flush=True)


def engine_rates(stats, tokens: int) -> dict:
  """Host syncs and uploads per 1000 generated tokens, and slot occupancy, from an engine's stats."""
  return {"host_reads_per_1k": 1000 * stats.get("host_reads", 0) / max(tokens, 1),
          "uploads_per_1k": 1000 * stats.get("uploads", 0) / max(tokens, 1),
          "occupancy": stats.get("busy_steps", 0) / max(stats.get("slot_steps", 0), 1),
          "occupancy_queued": (stats["busy_steps_queued"] / stats["slot_steps_queued"]  # None: nothing ever queued
                               if stats.get("slot_steps_queued") else None),
          "occupancy_rows": stats.get("busy_steps", 0) / max(stats.get("row_steps", 0), 1),
          "slot_steps_queued": stats.get("slot_steps_queued", 0),
          "prefill_calls": stats.get("prefill_calls", 0), "chunks": stats.get("chunks", 0)}


def pool_sweep(graphdef, cfg, params, args, common, impls):
  """One decode chunk at B=8 slots prefilled to each context, for each pool size and paged impl in `impls`: step_s
  against both. Every configuration gets its own engine up front; the timed rounds then take them in turn, so
  load from other processes hits all configurations alike."""
  B, K = 8, args.decode_chunk
  rng = np.random.default_rng(args.seed)
  engines = {}
  for impl in (i for i in impls if i != "dense"):
    for n_pages in (int(p) for p in args.pools.split(",")):
      for ctx in (int(c) for c in args.contexts.split(",")):
        max_len = -(-(ctx + K + 1) // args.page_size) * args.page_size
        if B * max_len // args.page_size <= n_pages:
          ecfg = EngineConfig(n_slots=B, page_size=args.page_size, n_pages=n_pages, max_len=max_len, decode_chunk=K,
                              sampling=SAMPLED, eos_ids=(), min_bucket=ctx, impl=paged_read(impl)[0],
                              pallas_splits=paged_read(impl)[1])
          engines[(impl, n_pages, ctx)] = RolloutEngine(graphdef, cfg, params, ecfg, seed=args.seed)
  walls, inserts = {key: [] for key in engines}, {key: [] for key in engines}
  for rep in range(args.repeats + 1):  # round 0 compiles
    for (impl, n_pages, ctx), engine in engines.items():
      t0 = time.perf_counter()
      slots = [engine.insert(rng.integers(0, cfg.vocab_size, ctx).tolist(), B * rep + b, max_new_tokens=K + 1)[0]
               for b in range(B)]  # each insert: one prefill, its first token read back
      t1 = time.perf_counter()
      emitted_KB = engine.generate()[2]  # dispatch, run and read back one chunk
      ran = int(emitted_KB.any(axis=1).sum())  # < K where a window chunk ended at its longest row's edge
      if rep:
        walls[(impl, n_pages, ctx)].append((time.perf_counter() - t1, ran))
        inserts[(impl, n_pages, ctx)].append((t1 - t0) / B)
      for slot in slots:
        engine.free(slot)
  for (impl, n_pages, ctx), w in walls.items():
    chunks = [t for t, _ in w]
    print(json.dumps({"impl": impl, "workload": "pool", "batch": B, "n_pages": n_pages, "context": ctx,
                      "decode_chunk": K, "chunk_s": statistics.median(chunks), "steps_run": [n for _, n in w],
                      "step_s": statistics.median(t / n for t, n in w), "chunk_s_all": chunks,
                      "insert_s": statistics.median(inserts[(impl, n_pages, ctx)]), **common}), flush=True)


def make_parser(on_gpu: bool) -> argparse.ArgumentParser:
  """decode.py's flags; tunix_compare.py parses its runners' settings with it too (so they cannot drift)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", default="longtail", choices=["longtail", "fixed", "pool"])
  parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                      help="the model (default: longtail tiny; fixed and pool the Llama-3-shaped model above)")
  parser.add_argument("--batches", default=None, help="comma-separated batch sizes (decode slots / dense rows); "
                      "default longtail 1,4,16 (GPU 1,4,16,64,256), fixed 8,32")
  parser.add_argument("--impl", default="dense,paged" if on_gpu else "dense,paged,paged:bucketed",
                      help="comma-separated: dense, paged (its default read), paged:READ with READ one of "
                      + ", ".join(IMPLS) + " (e.g. paged:pallas,paged:bucketed: the kernel path and the XLA path "
                      "side by side), or paged:pallas-sN (the kernel with each row's pages over N programs); "
                      "default dense,paged, and on CPU paged:bucketed too")
  parser.add_argument("--median_len", type=int, default=64, help="median completion length (cap = 8 x median)")
  parser.add_argument("--sigma", type=float, default=1.0, help="log-sd of the lognormal completion lengths")
  parser.add_argument("--prompt_len", type=int, default=32, help="prompt tokens per sequence")
  parser.add_argument("--new_tokens", type=int, default=64, help="fixed: new tokens per sequence")
  parser.add_argument("--n_seqs", type=int, default=None, help="sequences per configuration (default 2 x batch; "
                      "fixed: batch)")
  parser.add_argument("--page_size", type=int, default=16)
  parser.add_argument("--decode_chunk", type=int, default=8, help="paged: decode steps per generate() call")
  parser.add_argument("--no_overlap", action="store_true", help="paged: read each chunk before the next dispatch")
  parser.add_argument("--max_chunk", type=int, default=EngineConfig.max_chunk,
                      help="paged: longest chunk when nothing needs chunk boundaries (0 = tail chunks only)")
  parser.add_argument("--min_window_tokens", type=int, default=EngineConfig.min_window_tokens,
                      help="paged, window read: no window or read narrower than this (0 = bucketed's widths)")
  parser.add_argument("--min_pack_rows", type=int, default=EngineConfig.min_pack_rows,
                      help="paged: a chunk's live rows are packed into no fewer than this many")
  parser.add_argument("--pools", default="256,2048,8192", help="pool: pool sizes in pages")
  parser.add_argument("--contexts", default="64,256,1024", help="pool: tokens cached per slot")
  parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                      help="compute, weight and KV dtype (default: preset)")
  parser.add_argument("--kv_budget_gb", type=float, default=40.0 if on_gpu else 1.0, help="KV budget for seqs_fit")
  parser.add_argument("--copy_mb", type=float, default=512.0 if on_gpu else 64.0, help="array size of the copy test")
  parser.add_argument("--repeats", type=int, default=None, help="timed runs (median reported); default 20, pool 3")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--profile", default=None, metavar="DIR",
                      help="fixed and longtail workloads: after the timed runs, trace one more run of each impl into "
                      "DIR/<impl>-<batch> (jax.profiler) and print a 'decode_profile' line: device time by line and "
                      "the top kernels, per decode step (benchmarks/trace_summary.py; meant for a GPU)")
  return parser


def main():
  on_gpu = jax.default_backend() == "gpu"
  parser = make_parser(on_gpu)
  args = parser.parse_args()
  impls = args.impl.split(",")
  known = {"dense", "paged", *(f"paged:{r}" for r in IMPLS)}
  split_kernel = {i for i in impls if i.startswith("paged:pallas-s") and i[len("paged:pallas-s"):].isdigit()}
  if not set(impls) - split_kernel <= known:
    parser.error(f"--impl={args.impl}: expected a comma-separated subset of {sorted(known)}")
  fixed = args.workload in ("fixed", "pool")
  if args.profile:
    if args.workload == "pool":
      parser.error("--profile traces the fixed and longtail workloads, not --workload=pool")
    try:
      os.makedirs(args.profile, exist_ok=True)
    except OSError as e:
      parser.error(f"--profile={args.profile}: cannot create it ({e.strerror})")
    if not os.access(args.profile, os.W_OK):
      parser.error(f"--profile={args.profile}: not writable")
  # 20 rounds on the long-tail workload too: at batch 1 a round is ~12 ms on CPU, and 3 of them moved the
  # engine/dense ratio by +-20% between quiet runs
  args.repeats = args.repeats or (3 if args.workload == "pool" else 20)
  args.batches = args.batches or ("8,32" if fixed else "1,4,16,64,256" if on_gpu else "1,4,16")

  args.preset = args.preset or ("llama3-4l-256" if fixed else "tiny")
  cfg = FIXED_MODEL if args.preset == "llama3-4l-256" else get_preset(args.preset)
  cfg = dataclasses.replace(cfg, **({"dtype": args.dtype} if args.dtype else {}))
  # The longest sequence a workload runs (pool: its longest context and chunk): a random-weight model's position
  # limit is only recorded (rope runs past it), and the engine refuses a max_len beyond it, so raise it to fit.
  longest = (max(int(c) for c in args.contexts.split(",")) + args.decode_chunk + 1 if args.workload == "pool"
             else args.prompt_len + (args.new_tokens if fixed else 8 * args.median_len))
  cfg = dataclasses.replace(cfg, max_position=max(cfg.max_position, -(-longest // args.page_size) * args.page_size))
  graphdef, params = init_params(cfg, jax.random.key(args.seed), compiled=False)  # one program: ~1 min on GPU
  params = jax.block_until_ready(jax.jit(lambda p: cast_params(p, jnp.dtype(cfg.dtype)))(params))
  w_bytes, per_tok = weight_bytes(params), kv_bytes_per_token(cfg)
  bw = copy_gbps(int(args.copy_mb * 2**20))
  budget = args.kv_budget_gb * 1e9
  fit_paged, fit_dense = seqs_fit(cfg, budget, args.prompt_len, args.median_len, args.sigma, args.page_size,
                                  args.seed)
  common = {
      "bench": "decode", "workload": args.workload, "device": jax.devices()[0].device_kind,
      "backend": jax.default_backend(), "jax": jax.__version__, "date": datetime.date.today().isoformat(),
      "preset": args.preset, "params": num_params(cfg), "dtype": cfg.dtype,
      "weight_bytes": w_bytes, "kv_bytes_per_token": per_tok, "prompt_len": args.prompt_len,
      "page_size": args.page_size, "copy_gbps": bw,
  }
  if not fixed:
    common.update({"median_len": args.median_len, "sigma": args.sigma, "cap": 8 * args.median_len,
                   "kv_budget_bytes": int(budget), "seqs_fit_paged": fit_paged, "seqs_fit_dense": fit_dense})
  if args.workload == "pool":
    return pool_sweep(graphdef, cfg, params, args, common, impls)
  sampling = SAMPLED if fixed else GREEDY
  for batch in (int(b) for b in args.batches.split(",")):
    n_seqs = args.n_seqs or (batch if fixed else 2 * batch)
    if fixed:
      lengths = np.full((n_seqs,), args.new_tokens, np.int64)
    else:
      lengths = sample_lengths(n_seqs, args.median_len, args.sigma, args.seed + batch)
    rng = np.random.default_rng(args.seed + 1_000_003 * batch)
    prompts = rng.integers(0, cfg.vocab_size, (n_seqs, args.prompt_len)).tolist()
    kv_useful = useful_kv_tokens(lengths, args.prompt_len) * per_tok
    work = (graphdef, cfg, params, prompts, lengths, args, batch, sampling)
    runs = {impl: dense_runner(*work) if impl == "dense" else paged_runner(*work, read=impl)
            for impl in impls}
    timings = timed(runs, args.repeats)
    rows = {impl: timings[impl][2][0] / timings[impl][0] for impl in impls}  # tokens / median wall
    for impl in impls:
      wall, walls, (tokens, steps, stats) = timings[impl]
      assert tokens == int(lengths.sum()), f"{impl}: {tokens} tokens generated, {int(lengths.sum())} drawn"
      steps = max(steps, 1)
      bytes_per_step = w_bytes + kv_useful / steps
      print(json.dumps({
          "impl": impl, "batch": batch, "n_seqs": n_seqs, "max_len": int(lengths.max()),
          "mean_len": float(lengths.mean()), "tokens": tokens, "wall_s": wall, "wall_s_all": walls,
          "tokens_per_s": tokens / wall, "decode_steps": steps, "step_s": wall / steps,
          "bytes_per_step": bytes_per_step, "mbu": bytes_per_step / (wall / steps) / (bw * 1e9),
          **({"vs_dense": rows[impl] / rows["dense"]} if impl != "dense" and "dense" in rows else {}),
          **common,
          **({"decode_chunk": args.decode_chunk, "max_chunk": args.max_chunk, "overlap": not args.no_overlap,
              "min_window_tokens": args.min_window_tokens, "min_pack_rows": args.min_pack_rows,
              "prefills": stats.get("prefills", 0),
              "preemptions": stats.get("preemptions", 0), **engine_rates(stats, tokens)} if impl != "dense" else {}),
      }), flush=True)
      if args.profile:
        profile_once(runs[impl], f"{args.profile}/{impl.replace(':', '-')}-{batch}", impl, batch, steps, common)


if __name__ == "__main__":
  main()
