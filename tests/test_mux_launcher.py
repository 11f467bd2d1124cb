"""launchers/mux.py: job arguments (jaxrl_topo/mux/jobs.py) and a group run end to end with a failing job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from subproc import cpu_env

from jaxrl_topo.cli import UserError
from jaxrl_topo.mux.jobs import parse_job, split_overrides
from jaxrl_topo.mux.report import read_spans

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def test_common_overrides_are_split_from_the_flags():
  argv = ["mux.py", "--job=a.py", "--config.run.steps=3", "--workdir=/w", "--config.rl.group_size=8"]
  assert split_overrides(argv) == (["mux.py", "--job=a.py", "--workdir=/w"], ["run.steps=3", "rl.group_size=8"])
  with pytest.raises(UserError, match="key=value"):
    split_overrides(["--config.run.steps"])


def test_a_job_takes_the_common_overrides_then_its_own():
  jid, c = parse_job(f"{CONFIGS}/dapo.py:tiny,run.seed=3,run.steps=5", ["run.steps=2", "optim.lr=0.5"], 1)
  assert jid == "1-dapo"
  assert (c.run.seed, c.run.steps, c.optim.lr, c.reward.dynamic_sampling) == (3, 5, 0.5, True)
  jid, c = parse_job(f"{CONFIGS}/grpo_task.py:tiny", ["run.steps=2"], 0)
  assert (jid, c.run.seed, c.run.steps) == ("0-grpo_task", 0, 2)


def test_an_unknown_key_is_rejected_with_its_job_spec():
  with pytest.raises(UserError, match="rl.gruop_size"):
    parse_job(f"{CONFIGS}/grpo_task.py:tiny,rl.gruop_size=8", [], 0)


@pytest.mark.slow
def test_launcher_runs_a_group_and_isolates_a_failing_job(tmp_path):
  common = {"run.steps": 3, "run.sft_steps": 5, "run.sft_target_accuracy": 0.0, "data.batch_size": 4,
            "rl.group_size": 4, "rollout.n_slots": 16, "run.eval_every": 0, "reward.n_workers": 0,
            "run.tensorboard": False}
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "mux.py"), f"--job={CONFIGS}/grpo_task.py:tiny",
         f"--job={CONFIGS}/dapo.py:tiny,run.seed=3,reward.fn=reward_fns_for_tests:raises",
         f"--workdir={tmp_path}", *[f"--config.{k}={v}" for k, v in common.items()]]
  env = cpu_env(2, PYTHONPATH=os.path.join(ROOT, "tests"))
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "0-grpo_task: 3 steps" in out.stdout and "1-dapo: FAILED" in out.stdout, out.stdout
  with open(tmp_path / "mux_summary.json") as f:
    summary = json.load(f)
  assert summary["jobs"]["0-grpo_task"]["ok"] and "boom" in summary["jobs"]["1-dapo"]["error"]
  assert 0 < summary["busy_fraction"]["train"] <= 1 and 0 < summary["busy_fraction"]["rollout"] <= 1
  with open(tmp_path / "0-grpo_task" / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [0, 1, 2]
  spans = read_spans(str(tmp_path / "mux_spans.jsonl"))
  assert {s["job"] for s in spans} == {"0-grpo_task", "1-dapo"}
  assert (tmp_path / "mux_timeline.png").stat().st_size > 0
