#!/usr/bin/env bash
# The GPU decode runs of issue 12 in one go, each in its own process with its own time limit, every output under
# OUT (default /tmp/gpu_decode_out; the device machine sets OUT): the fixed-length batch-256 run with a per-step
# kernel trace (decode.py --profile), then the leads RESULTS.md names (all GEMMs through cuBLAS; rbg random bits),
# each beside dense in the same process.
# JAX_LOG_COMPILES=1 logs every compile, so a run that stalls shows where (an engine warm-up once stalled > 110 s);
# a run past its LIMIT gets SIGABRT first, and PYTHONFAULTHANDLER=1 then writes every thread's Python stack to its log.
#
#   bash benchmarks/gpu_decode.sh                                      # on the GPU machine (its python3)
#   PYTHON=.venv/bin/python JAX_PLATFORMS=cpu PRESET=tiny DTYPE=float32 BATCH=8 PROMPT=16 NEW=16 IMPL=dense,paged \
#       bash benchmarks/gpu_decode.sh                                  # a smoke run on CPU (about a minute)
set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_decode_out}
PRESET=${PRESET:-qwen2.5-0.5b} DTYPE=${DTYPE:-bfloat16} BATCH=${BATCH:-256} PROMPT=${PROMPT:-128} NEW=${NEW:-256}
IMPL=${IMPL:-dense,paged:pallas} LIMIT=${LIMIT:-150}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_LOG_COMPILES=1 PYTHONFAULTHANDLER=1
"$PYTHON" -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" > "$OUT/versions.txt" 2>&1
args=(--workload=fixed "--preset=$PRESET" "--dtype=$DTYPE" "--batches=$BATCH" "--prompt_len=$PROMPT"
      "--new_tokens=$NEW" --repeats=3 "--impl=$IMPL")

run() {  # run NAME [ENV=VALUE ...] -- [extra decode.py flags]: one process, its JSON lines and its log
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local t0=$SECONDS
  env "${envs[@]}" timeout -s ABRT -k 20 "$LIMIT" "$PYTHON" benchmarks/decode.py "${args[@]}" "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.log"
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - t0)) s; $(grep -c '"bench": "decode"' "$OUT/$name.jsonl") result lines"
  grep -E '^\[decode\]' "$OUT/$name.log" | tail -4
  if [ $rc -ne 0 ]; then  # a stall: the innermost frames and ours (the whole dump is in the log)
    sed -n '/^Current thread/,/^$/p' "$OUT/$name.log" | grep -m4 'File' | grep -v '/benchmarks/\|/jaxrl_topo/'
    sed -n '/^Current thread/,/^$/p' "$OUT/$name.log" | grep '/benchmarks/\|/jaxrl_topo/' | head -8
    tail -3 "$OUT/$name.log"
  fi
}

run base -- "--profile=$OUT/trace"
run cublas XLA_FLAGS=--xla_gpu_enable_triton_gemm=false --
run rbg JAX_DEFAULT_PRNG_IMPL=rbg --
