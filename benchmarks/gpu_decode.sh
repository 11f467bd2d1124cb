#!/usr/bin/env bash
# The GPU decode runs of issue 12 in one go, each in its own process with its own time limit, every output under
# OUT (default /tmp/gpu_decode_out; the device machine sets OUT), and all of them again in ARCHIVE (default
# OUT/all.tgz) after each run (the device tool returns at most 8 files: there, OUT=/tmp/o ARCHIVE=$OUT/all.tgz): the fixed-length batch-256 run with a per-step
# kernel trace (decode.py --profile), then the leads RESULTS.md names (all GEMMs through cuBLAS; rbg random bits),
# each beside dense in the same process. Further runs: `splits` (the kernel at 1, 2 and 3 programs a row beside
# dense), `fast` and `bucketed` (the XLA reads, each beside the kernel), `check`
# (pallas_check.py's kernel correctness and one-layer read sweep), `train` (train_step.py's MFU target), and the
# leads RESULTS.md names for the next GPU session: `tail` (split rows at 8 and 32 rows of long contexts) and
# `train512` (flash attention at 512-token tiles).
# JAX_LOG_COMPILES=1 logs every compile, so a run that stalls shows where (runs once 'stalled' past 90-120 s: the
# model's random init compiled for 48-62 s; decode.py now builds it op by op);
# a run past its limit gets SIGABRT first, and PYTHONFAULTHANDLER=1 then writes every thread's Python stack to its log.
#
#   bash benchmarks/gpu_decode.sh                                      # on the GPU machine (its python3)
#   RUNS='cublas window0' bash benchmarks/gpu_decode.sh                # some runs only (names: the case below)
#   PYTHON=.venv/bin/python JAX_PLATFORMS=cpu PRESET=tiny DTYPE=float32 BATCH=8 PROMPT=16 NEW=16 IMPL=dense,paged \
#       bash benchmarks/gpu_decode.sh                                  # a smoke run on CPU (about a minute)
set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_decode_out}
PRESET=${PRESET:-qwen2.5-0.5b} DTYPE=${DTYPE:-bfloat16} BATCH=${BATCH:-256} PROMPT=${PROMPT:-128} NEW=${NEW:-256}
IMPL=${IMPL:-dense,paged:pallas} LIMIT=${LIMIT:-150}  # LIMIT scales each run's own limit (150 = as written)
ARCHIVE=${ARCHIVE:-$OUT/all.tgz}  # every output so far, rewritten after each run
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_LOG_COMPILES=1 PYTHONFAULTHANDLER=1
"$PYTHON" -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" > "$OUT/versions.txt" 2>&1
args=(--workload=fixed "--preset=$PRESET" "--dtype=$DTYPE" "--batches=$BATCH" "--prompt_len=$PROMPT"
      "--new_tokens=$NEW" --repeats=3 "--impl=$IMPL")

run() {  # run NAME SECONDS [ENV=VALUE ...] -- [extra decode.py flags]: one process, its JSON lines and its log
  local name=$1 limit=$(( $2 * LIMIT / 150 )); shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local t0=$SECONDS
  env "${envs[@]}" timeout -s ABRT -k 20 "$limit" "$PYTHON" benchmarks/decode.py "${args[@]}" "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.log"
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - t0)) s; $(grep -c '"bench": "decode"' "$OUT/$name.jsonl") result lines"
  grep -E '^\[decode\]' "$OUT/$name.log" | tail -4
  if [ $rc -ne 0 ]; then  # a stall: the innermost frames and ours (the whole dump is in the log)
    sed -n '/^Current thread/,/^$/p' "$OUT/$name.log" | grep -m4 'File' | grep -v '/benchmarks/\|/jaxrl_topo/'
    sed -n '/^Current thread/,/^$/p' "$OUT/$name.log" | grep '/benchmarks/\|/jaxrl_topo/' | head -8
    tail -3 "$OUT/$name.log"
  fi
}

# GPU load every 2 s beside the runs: a stalled run at ~100% is a kernel still running; at 0% the host waits
command -v nvidia-smi > /dev/null && { nvidia-smi dmon -s u -d 2 -o T > "$OUT/dmon.txt" 2>&1 & }
noat=--xla_gpu_autotune_level=0  # compile-time autotuning off (window's program compiled > 65 s with it, > 40 s without)
for r in ${RUNS:-base window cublas rbg}; do
  case $r in
    base) run base 150 -- "--profile=$OUT/trace" ;;
    plain) run plain 110 -- ;;  # base without the trace
    window) run window 140 -- --impl=dense,paged:window ;;  # the XLA read that is CPU's default
    window0) run window0 110 XLA_FLAGS=$noat -- --impl=dense,paged:window ;;
    cublas) run cublas 90 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false -- ;;
    rbg) run rbg 90 JAX_DEFAULT_PRNG_IMPL=rbg -- ;;
    rbg0) run rbg0 80 JAX_DEFAULT_PRNG_IMPL=rbg XLA_FLAGS=$noat -- ;;
    splits) run splits 170 -- --impl=dense,paged:pallas,paged:pallas-s2,paged:pallas-s3 ;;
    fast) run fast 110 -- --impl=paged:pallas,paged:fast ;;
    bucketed) run bucketed 110 -- --impl=paged:pallas,paged:bucketed ;;
    check) timeout -s ABRT -k 20 $((70 * LIMIT / 150)) "$PYTHON" benchmarks/pallas_check.py --checks=kernel,read \
             --batches="$BATCH" --median_ctx=256 > "$OUT/check.jsonl" 2> "$OUT/check.log"
           echo "check: rc $?" ;;
    train) timeout -s ABRT -k 20 $((130 * LIMIT / 150)) "$PYTHON" benchmarks/train_step.py "--preset=$PRESET" \
             --seq_len=2048 --batch=16 --n_micro=4 "--dtype=$DTYPE" --remat --steps=5 ${TRAIN_ARGS:-} \
             > "$OUT/train.jsonl" 2> "$OUT/train.log"
           echo "train: rc $?" ;;
    tail) timeout -s ABRT -k 20 $((90 * LIMIT / 150)) "$PYTHON" benchmarks/pallas_check.py --checks=read \
            --batches=8,32 --median_ctx=2048 > "$OUT/tail.jsonl" 2> "$OUT/tail.log"  # split rows where few are live
          echo "tail: rc $?" ;;
    train512) timeout -s ABRT -k 20 $((130 * LIMIT / 150)) "$PYTHON" benchmarks/train_step.py "--preset=$PRESET" \
                --seq_len=2048 --batch=16 --n_micro=4 "--dtype=$DTYPE" --remat --steps=3 --warmup=1 \
                --model_overrides='{"attn_block": 512}' ${TRAIN_ARGS:-} > "$OUT/train512.jsonl" 2> "$OUT/train512.log"
              echo "train512: rc $?" ;;  # flash at 10 tiles a layer instead of 136 (RESULTS.md, "Train step: GPU")
    *) echo "RUNS: unknown run '$r' (base plain window window0 cublas rbg rbg0 splits fast bucketed check train tail"\
            "train512)"; exit 2 ;;
  esac
  tar czf "$OUT.tgz.part" -C "$OUT" --exclude=all.tgz . && mv "$OUT.tgz.part" "$ARCHIVE"
  [ -s "$OUT/dmon.txt" ] && echo "  GPU load (sm %) over the run's last 20 s: $(tail -10 "$OUT/dmon.txt" | awk '{printf "%s ", $3}')"
done
kill %1 2> /dev/null
# the table last (the device tool returns the output's tail): tokens/s, step ms, MBU and ratio to dense per run
"$PYTHON" - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.jsonl"))):
  for line in open(f):
    r = json.loads(line) if line.startswith("{") else {}
    name = os.path.basename(f)[:-6]
    if r.get("bench") == "decode":
      vs = f"{r['vs_dense']:.2f}" if "vs_dense" in r else "-"
      print(f"{name:8s} {r['impl']:16s} {r['tokens_per_s']:9.0f} tok/s  step {1e3 * r['step_s']:.2f} ms"
            f"  MBU {r['mbu']:.3f}  vs dense {vs}  copy {r['copy_gbps']:.0f} GB/s  {r['device']}")
    elif r.get("check") == "kernel":
      print(f"{name:8s} kernel N{r['N']} K{r['K']} H{r['H']} S{r['S']} {r['dtype']} splits {r['splits']}: "
            f"max err {r['max_abs_err']:.2g}, idle row zero {r['idle_row_zero']}")
    elif r.get("check") == "read":
      print(f"{name:8s} read {r['impl']:12s} {r['us']:7.1f} us  {r['useful_gbps']:6.0f} GB/s  "
            f"diff {r['max_abs_diff_vs_bucketed']:.2g}")
    elif "error" in r:
      print(f"{name:8s} error in {r.get('check')}: {r['error'][:300]}")
    elif "mfu" in r:
      print(f"{name:8s} train step {r['step_s']:.3f} s  {r['tokens_per_s']:.0f} tok/s  MFU {r['mfu']}  "
            f"compile {r['compile_s']:.0f} s  loss {r['loss']:.4f}  {r['device']}")
PY
