"""Nothing lost silently: over-long prompts are counted aloud, errors name the file at fault, a custom
reward beside the user imports, and a reward function that keeps failing stops the run."""

import json
import logging
import os
import sys

import numpy as np
import pytest

from jaxrl_topo.data import pipeline
from jaxrl_topo.envs import rewards
from jaxrl_topo.envs.reward_pool import CircuitBreaker, RewardPool, RewardResult, RewardsFailing
from jaxrl_topo.models import tokenizer as tk

M = "reward_fns_for_tests:"


@pytest.fixture(scope="module")
def tok():
  return tk.Tokenizer(tok=tk.build_char_tokenizer(), chat_template=tk.CHATML_TEMPLATE)


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_overlong_prompts_are_counted_in_a_warning(tmp_path, tok, caplog):
  """Before: `overlong=skip` dropped rows without a word."""
  src = _jsonl(tmp_path / "p.jsonl", [{"prompt": "ab" * (1 + 10 * (i % 2)), "answer": "x"} for i in range(8)])
  cfg = pipeline.PromptDataConfig(source=src, max_prompt_len=8)
  with caplog.at_level(logging.WARNING):
    got = pipeline.load_prompts(cfg, tok)
  assert got.stats.n_skipped == 4 and len(got.examples) == 4
  assert any(f"4 of 8 prompts in {src} are over data.max_prompt_len=8 tokens and were skipped" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_an_empty_eval_file_is_named(tmp_path, tok):
  """Before: the error named the training file."""
  train = _jsonl(tmp_path / "train.jsonl", [{"prompt": "ab", "answer": "x"}])
  (tmp_path / "eval.jsonl").write_text("")
  cfg = pipeline.PromptDataConfig(source=train, eval_source=str(tmp_path / "eval.jsonl"))
  with pytest.raises(ValueError, match=r"No rows in .*eval\.jsonl"):
    pipeline.load_prompts(cfg, tok, "heldout")


def test_a_reward_module_in_the_working_directory_imports(tmp_path, monkeypatch):
  """Before: `my_reward:fn` beside the user needed PYTHONPATH=. (the launcher's directory is on sys.path,
  not the working directory)."""
  (tmp_path / "my_cwd_reward.py").write_text("def fn(prompts, completions, metadata):\n"
                                             "  return [1.0] * len(completions)\n")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
  monkeypatch.delitem(sys.modules, "my_cwd_reward", raising=False)
  assert rewards.resolve("my_cwd_reward:fn")([""], ["a"], [{}]) == [1.0]


def _result(failed: dict, n: int) -> RewardResult:
  return RewardResult(total_N=np.zeros(n, np.float32), per_fn={}, errors=sum(failed.values()), timeouts=0,
                      failed=failed, why="raised RuntimeError: boom")


def test_circuit_breaker_counts_consecutive_calls_over_the_fraction():
  b = CircuitBreaker(max_error_frac=0.5, max_calls=3)
  for failed in ({"f": 8}, {"f": 8}, {}, {"f": 5}, {"f": 4}, {"f": 8}, {"f": 8}):  # 4 of 8 is not over 0.5
    b.check(_result(failed, 8), 8)
  with pytest.raises(RewardsFailing, match=r"reward 'f' failed on 8 of 8 items in each of the last 3 scoring calls"):
    b.check(_result({"f": 8}, 8), 8)
  off = CircuitBreaker(max_error_frac=0.0, max_calls=0)
  for _ in range(5):
    off.check(_result({"f": 8}, 8), 8)


def test_pool_with_a_breaker_stops_an_always_failing_reward():
  """Before: a reward failing on every item was scored error_score to the end of the run."""
  with RewardPool([(M + "raises", 1.0), (M + "one", 1.0)], n_workers=0, max_error_calls=2) as pool:
    pool.score([""] * 4, list("abcd"))
    with pytest.raises(RewardsFailing, match=r"reward 'reward_fns_for_tests:raises'.*last failure: raised "
                                              r"RuntimeError: boom"):
      pool.score([""] * 4, list("abcd"))
  with RewardPool([(M + "raises_on_bad", 1.0)], n_workers=0, max_error_calls=2, chunk_size=1) as pool:
    for _ in range(3):  # one bad item of four is under the fraction
      pool.score([""] * 4, ["a", "bad", "c", "d"])


def test_a_running_loop_logs_reward_errors_then_the_breaker_stops_it_keeping_its_checkpoints(tmp_path):
  """The loop end to end (run.train, colocated, no warm-up): a reward raising on every item. Scoring calls: the
  evaluation before RL, step 0's rollout, step 1's: the third in a row over max_error_frac stops the run. Step 0
  trained on error scores and says so in metrics.jsonl (all 16 items failed); its checkpoint is kept."""
  from run_fixtures import tiny_cfg

  from jaxrl_topo.runtime import run as run_lib

  cfg = tiny_cfg("colocated", steps=4, **{"reward.fn": M + "raises", "reward.max_error_steps": 3, "run.sft_steps": 0,
                                      "run.checkpoint_every": 1, "run.tensorboard": False})
  with pytest.raises(RewardsFailing, match=r"failed on 16 of 16 items in each of the last 3 scoring calls .* "
                                           r"Stopped; the checkpoints saved so far are kept"):
    run_lib.train(cfg, str(tmp_path), progress=False)
  logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [(m["step"], m["reward/errors"], m["reward_mean"]) for m in logged] == [(0, 16, 0.0)]
  assert os.listdir(tmp_path / "checkpoints") == ["1"]


def test_user_errors_are_one_line():
  from jaxrl_topo import cli
  assert cli.is_user_error(RewardsFailing("x")) and cli.is_user_error(FileNotFoundError("x"))
  assert not cli.is_user_error(TypeError("x"))


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_task_presets_warm_up_before_rl(preset):
  """A random-init model on the reversal task is never right, so GRPO has no signal without the
  supervised warm-up. Before: `grpo_task.py:small` had none and its reward stayed 0."""
  from jaxrl_topo.runtime.config import config_from_file
  c = config_from_file(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "grpo_task.py"), preset)
  assert c.run.sft_steps > 0 and c.run.sft_target_accuracy > 0
