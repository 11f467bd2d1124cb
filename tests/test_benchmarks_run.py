"""Every CPU benchmark script runs, at its smallest setting, and prints the JSON lines RESULTS.md reads.

Nothing else runs the scripts in benchmarks/, and two of them stopped running unseen (tunix_compare lost
flags the runners read; mux.py divided by zero at few steps). These runs check that each script starts,
does its work and writes its rows with the fields its RESULTS section quotes; they time nothing.
`make test-benchmarks` (CI, after `make test`); not part of `make test` (about 3.5 minutes of subprocesses).
Not here: tunix_compare.py (needs google-tunix, which the project does not install), serve.py (the
JetStream extra: tests_jetstream/test_serve_benchmark.py), gpu_decode.sh (a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from subproc import cpu_env

pytestmark = pytest.mark.benchmarks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (argv after the script, fake CPU devices, fields every JSON row of the script's main kind carries)
CASES = {
    "decode_fixed": ("decode.py", ["--workload=fixed", "--batches=2", "--prompt_len=8", "--new_tokens=8",
                                   "--repeats=1", "--impl=dense,paged"], 8, {"impl", "tokens_per_s"}),
    "decode_longtail": ("decode.py", ["--batches=2", "--median_len=4", "--repeats=1"], 8,
                        {"impl", "tokens_per_s"}),
    "decode_pool": ("decode.py", ["--workload=pool", "--pools=64,128", "--contexts=16", "--repeats=1",
                                  "--impl=paged"], 8, {"impl", "n_pages", "step_s"}),
    "packing": ("packing.py", ["--seqs=64", "--steps=2", "--median_len=16", "--budgets=256"], 1,
                {"layout", "row_tokens"}),
    "train_step": ("train_step.py", ["--seq_len=32", "--batch=8", "--n_micro=1", "--steps=1", "--warmup=0"], 8,
                   {"preset", "seq_len"}),
    # one device: the op-by-op init; --profile: the traced step's summary line
    "train_step_profile": ("train_step.py", ["--seq_len=32", "--batch=8", "--n_micro=1", "--steps=1", "--warmup=0",
                                             "--profile={tmp}/trace"], 1, {"bench", "planes"}),
    "weight_sync": ("weight_sync.py", ["--n_params=1e5", "--buckets_mib=1", "--repeats=1"], 8, {"mode"}),
    "logprob_memory": ("logprob_memory.py", ["--tokens=256", "--chunks=64"], 1, {"impl", "chunk", "tokens"}),
    "pallas_check": ("pallas_check.py", ["--checks=kernel"], 1, {"bench", "check"}),
    "train_memory": ("train_memory.py", ["--presets=tiny", "--seq_lens=64,128", "--variants=flash",
                                         "--batch=8", "--dtype=float32", "--block=32"], 8, {"bench", "preset"}),
    "mux_trace": ("mux_trace.py", ["--jobs=5"], 1, {"cost", "vs_disaggregated"}),
    "modes": ("modes.py", ["--steps=2", "--modes=colocated,async", "--median=8", "--out={tmp}"], 8,
              {"mode", "steps_per_hour", "predicted_steps_per_hour"}),
    "mux": ("mux.py", ["--jobs=2", "--steps=3", "--out={tmp}"], 8, {"group_busy", "group_steps_per_s"}),
    "kill_resume": ("kill_resume.py", ["--trials=1", "--modes=disaggregated", "--out={tmp}"], 8, {"bench", "mode"}),
    "tool_calc": ("tool_calc.py", ["--workdir={tmp}/calc", "--steps=2", "--sft_steps=2", "--eval_every=1"], 8,
                  {"bench", "step"}),
}


def run_script(script: str, args: list[str], devices: int, tmp: str) -> list[dict]:
  cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), *(a.format(tmp=tmp) for a in args)]
  proc = subprocess.run(cmd, cwd=ROOT, env=cpu_env(devices, PYTHONPATH=ROOT), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, f"{' '.join(cmd[1:])} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert rows, f"{script} printed no JSON line:\n{proc.stdout[-2000:]}"
  return rows


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_benchmark_runs_and_prints_its_rows(name, tmp_path):
  script, args, devices, fields = CASES[name]
  rows = run_script(script, args, devices, str(tmp_path))
  assert [r for r in rows if fields <= set(r)], f"{script}: no row carries {sorted(fields)}; rows: {rows[:3]}"
