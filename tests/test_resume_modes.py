"""Exact resume when batches are in flight (runtime/inflight.py): a disaggregated run killed mid-step
resumes from its checkpoint, trains the batch that was produced under the older weights as it was, and
repeats the uninterrupted run's metrics (run.deterministic=True; 1 trainer + 1 rollout device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from subproc import cpu_env

from jaxrl_topo.runtime.metrics import comparable, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = {"run.steps": 6, "run.checkpoint_every": 2, "run.eval_every": 0, "run.tensorboard": False, "run.plot": False,
         "reward.n_workers": 0, "run.sft_steps": 10, "run.sft_target_accuracy": 0.0, "data.batch_size": 4,
         "rl.group_size": 4, "rollout.n_slots": 16, "topology.mode": "disaggregated", "run.max_staleness": 1,
         "run.deterministic": True}


def _launch(workdir, cache_dir, kill_at=None, **flags):
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "train.py"), "--config",
         os.path.join(ROOT, "configs", "grpo_task.py") + ":tiny", f"--workdir={workdir}", "--noprogress",
         *[f"--config.{k}={v}" for k, v in {**FLAGS, **flags}.items()]]
  env = cpu_env(2, JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  env.pop("JAXRL_KILL_AT", None)
  if kill_at:
    env["JAXRL_KILL_AT"] = kill_at
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_disaggregated_resume_trains_the_in_flight_batch_as_it_was(tmp_path):
  ref = _launch(tmp_path / "ref", tmp_path / "cache")
  assert ref.returncode == 0, ref.stderr[-3000:]
  run = tmp_path / "killed"
  killed = _launch(run, tmp_path / "cache", kill_at="rollout:3")  # after the step-2 checkpoint, batch 3 produced
  assert killed.returncode == 137, f"the kill point was not reached:\n{killed.stderr[-3000:]}"
  # Relaunched colocated (eta 0), the saved one-version-old batch cannot be trained: refused before anything is
  # built or written (before: an AssertionError from the loop a step later, config.json already replaced).
  config = (run / "config.json").read_text()
  refused = _launch(run, tmp_path / "cache", **{"topology.mode": "colocated"})
  assert refused.returncode == 2 and "sampled up to 1 weight versions before" in refused.stderr, refused.stderr[-3000:]
  assert (run / "config.json").read_text() == config
  resumed = _launch(run, tmp_path / "cache")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  with open(run / "summary.json") as f:
    assert json.load(f)["resumed_from"] == 2
  want, got = comparable(read_metrics(str(tmp_path / "ref"))), comparable(read_metrics(str(run)))
  assert [r["step"] for r in got] == list(range(6))
  assert [r["staleness/max"] for r in got][2:] == [1, 1, 1, 1], "batches 2-5 were sampled one version behind"
  assert got == want, "a resumed run must repeat the uninterrupted run's metrics"
  # Its timeline holds every phase of every step: the restored in-flight batch's rollout and reward spans are kept
  # (before: dropped, as if redone).
  from jaxrl_topo.runtime.spans import read_spans
  phases = lambda d: sorted((s["phase"], s["step"]) for s in read_spans(str(d)))  # noqa: E731
  assert phases(run) == phases(tmp_path / "ref")


def test_in_flight_examples_round_trip_whatever_their_values():
  """A Parquet row's dates, bytes and decimals are not JSON: the first checkpoint of an off-policy run raised
  "meta is not JSON-serialisable" (after checkpoint_every steps), and the run died with no checkpoint."""
  import datetime
  import decimal

  import numpy as np

  from jaxrl_topo.rollout.engine import Sample
  from jaxrl_topo.runtime import inflight
  from jaxrl_topo.runtime.loop import Trajectories

  examples = [{"prompt": "2+2=", "answer": "4", "added": datetime.date(2026, 11, 29), "raw": b"\x00\xff",
               "price": decimal.Decimal("1.10"), "tags": [datetime.datetime(2026, 1, 2, 3, 4)], "n": np.int64(3),
               "nested": {"ids": np.arange(3, dtype=np.int32)}}]
  sample = Sample(request=0, index=0, tokens=[5, 6], logprobs=[-0.5, -1.0], gen_ids=[2, 3], finish_reason="length")
  traj = Trajectories(step=3, examples=examples, samples=[sample], rewards_N=np.ones(1, np.float32),
                      correct_N=np.zeros(1, np.float32), info={}, data_state={"epoch": 0})
  back = inflight.from_json(json.loads(json.dumps(inflight.to_json(traj))))
  assert back.examples == [{**examples[0], "n": 3, "nested": {"ids": [0, 1, 2]}}]
  assert type(back.examples[0]["added"]) is datetime.date and inflight.max_lag([inflight.to_json(traj)]) == 1
