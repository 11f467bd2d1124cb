"""Reward functions (answer extraction and matching, `resolve`) and the killable RewardPool.

The pool tests start real spawned workers (about a second each); the whole file takes a few seconds.
"""

import os
import time

import numpy as np
import pytest

from jaxrl_topo.envs import rewards
from jaxrl_topo.envs.reward_pool import RewardPool, RewardsFailing, score_inline
from jaxrl_topo.envs.rewards import answers_equal, extract_answer, format_reward, math_answer

M = "reward_fns_for_tests:"  # tests/reward_fns_for_tests.py, importable in the workers too


@pytest.mark.parametrize("text, want", [
    (r"First \boxed{3}, then finally \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{a_{1} + {b}} and an unclosed \boxed{7", "a_{1} + {b}"),
    ("Step 1 ... 40 + 32 = 72\n#### 72", "72"),
    ("#### $1,234.", "1234"),
    ("so 3 + 4 = 7. The answer is 7.", "7"),
    ("Answer: -2.5", "-2.5"),
    ("We get 12 apples and then 1,500 pears.", "1500"),
    ("no digits here", None),
    ("", None),
    ("The answer is **42**.", "42"),  # before: '42**' (bold stripped before the full stop)
    ("#### **42**.", "42"),
    (r"so 2 / 2 = \boxed{1", None),  # cut off inside the box: before, the last number (1) scored
    (r"\boxed{\frac{1}{2", None),
])
def test_extract_answer(text, want):
  assert extract_answer(text) == want


@pytest.mark.parametrize("pred, ref, want", [
    ("0.5", "1/2", True), ("1/2", r"\frac{1}{2}", True), (r"\frac{1}{2}", "0.50", True),
    (r"\dfrac{1}{2}", "0.5", True), (r"-\frac{3}{4}", "-0.75", True), ("1/3", "0.33", False),
    ("-3", "-3.0", True), ("1,000", "1000", True), ("50%", "0.5", False), (r"50\%", "50", True),
    (r"\text{ Yes }", "yes", True), ("x = 5", "5", True), ("2", "3", False), ("", "", False), (None, "1", False),
])
def test_answers_equal(pred, ref, want):
  assert answers_equal(pred, ref) is want
  assert pred is None or answers_equal(ref, pred) is want


def test_math_answer_and_format_reward():
  completions = [r"... so \boxed{0.5}", "... #### 72", "I think it is 8", r"\boxed{1} or \boxed{2}", "nothing"]
  metadata = [{"answer": "1/2"}, {"answer": 72}, {"answer": "9"}, {"answer": "2"}, {"answer": "0"}]
  prompts = [""] * len(completions)
  assert math_answer(prompts, completions, metadata) == [1.0, 1.0, 0.0, 1.0, 0.0]
  assert format_reward(prompts, completions, metadata) == [1.0, 1.0, 0.0, 0.0, 0.0]
  with pytest.raises(KeyError, match=r"metadata\[0\] has no 'answer'"):
    math_answer([""], ["1"], [{}])


def test_resolve_builtins_and_errors():
  assert rewards.resolve("math_answer") is math_answer
  assert rewards.resolve("format") is format_reward
  assert rewards.BUILTINS["task"] == "jaxrl_topo.data.tasks:task_reward"  # registered, imported only on resolve
  for path, match in [("nocolon", "import path"), ("a:b:c", "import path"), ("no_such_mod_xyz:f", "no module"),
                      (M + "missing", "no attribute 'missing'"), (M + "NOT_CALLABLE", "not a callable"),
                      (M + "two_args", r"two_args\(prompts, completions\) cannot be called as two_args\(prompts, "
                                       r"completions, metadata\): too many positional arguments")]:
    with pytest.raises(ValueError, match=match) as err:
      rewards.resolve(path)
    assert repr(path) in str(err.value)


def test_score_inline_counts_errors():
  res = score_inline([(M + "length", 0.5), (M + "raises_on_bad", 2.0), (M + "wrong_length", 1.0), (M + "nan", 1.0)],
                     ["p"] * 4, ["ab", "bad", "abcd", "x"], chunk_size=2, error_score=-1.0)
  np.testing.assert_array_equal(res.per_fn[M + "length"], [2, 3, 4, 1])
  np.testing.assert_array_equal(res.per_fn[M + "raises_on_bad"], [-1, -1, 1, 1])
  np.testing.assert_array_equal(res.total_N, 0.5 * np.array([2, 3, 4, 1]) + 2 * np.array([-1, -1, 1, 1]) - 2)
  assert (res.errors, res.timeouts) == (2 + 4 + 4, 0)
  assert res.total_N.dtype == np.float32
  res = score_inline([(M + "strings", 1.0)], ["p"] * 2, ["a", "b"], error_score=-1.0)
  assert res.errors == 2 and res.why == "returned an unusable value (returned a str score '1.0'; scores are numbers)"


def test_pool_weighted_totals_without_jax_in_workers():
  completions = [r"\boxed{4}", "#### 5", "7"]
  metadata = [{"answer": "4"}, {"answer": "6"}, {"answer": "7"}]
  with RewardPool([(M + "length", 0.5), ("math_answer", 2.0), (M + "imported_jax", 100.0)], n_workers=2) as pool:
    res = pool.score(["q"] * 3, completions, metadata)
    empty = pool.score([], [], [])
  np.testing.assert_array_equal(res.per_fn["math_answer"], [1, 0, 1])
  np.testing.assert_array_equal(res.per_fn[M + "imported_jax"], [0, 0, 0])
  np.testing.assert_allclose(res.total_N, [0.5 * 9 + 2, 0.5 * 6, 0.5 * 1 + 2])
  assert (res.errors, res.timeouts) == (0, 0)
  assert empty.total_N.shape == (0,)


def test_pool_errors_cost_only_their_chunk():
  fns = [(M + "raises_on_bad", 1.0), (M + "wrong_length", 1.0), (M + "dies", 1.0), (M + "one", 1.0),
         (M + "strings", 1.0)]
  with RewardPool(fns, n_workers=2, chunk_size=2, error_score=-1.0) as pool:
    res = pool.score([""] * 4, ["a", "bad", "c", "d"])
    again = pool.score([""] * 2, ["e", "f"])
    victim = next(w.proc for w in pool._workers if w.ready)  # killed from outside while idle: its call is retried
    victim.kill()
    victim.join()
    after_kill = pool.score([""] * 2, ["g", "h"])
  np.testing.assert_array_equal(res.per_fn[M + "raises_on_bad"], [-1, -1, 1, 1])
  np.testing.assert_array_equal(res.per_fn[M + "wrong_length"], [-1] * 4)
  np.testing.assert_array_equal(res.per_fn[M + "dies"], [-1] * 4)
  np.testing.assert_array_equal(res.per_fn[M + "one"], [1] * 4)
  np.testing.assert_array_equal(res.per_fn[M + "strings"], [-1] * 4)  # not "did not raise": refused in the worker
  assert (res.errors, res.timeouts) == (2 + 4 + 4 + 4, 0)
  assert res.failed[M + "strings"] == 4
  np.testing.assert_array_equal(again.per_fn[M + "one"], [1, 1])  # workers killed by `dies` were replaced
  np.testing.assert_array_equal(after_kill.per_fn[M + "one"], [1, 1])
  assert after_kill.errors == 2 + 2 + 2  # wrong_length, dies and strings; nothing lost to the killed worker


def test_pool_kills_a_hanging_call_and_goes_on():
  pool = RewardPool([(M + "hangs_on_slow", 1.0)], n_workers=2, timeout_s=1.0, chunk_size=2)
  pids = set(pool.worker_pids)
  t0 = time.monotonic()
  res = pool.score([""] * 4, ["a", "slow", "b", "c"])  # the chunk holding "slow" sleeps 60 s
  elapsed = time.monotonic() - t0
  np.testing.assert_array_equal(res.total_N, [0, 0, 2, 2])
  assert (res.errors, res.timeouts) == (0, 2)
  assert elapsed < 8.0, elapsed
  killed = pids - set(pool.worker_pids)
  assert len(killed) == 1 and not any(os.path.exists(f"/proc/{pid}") for pid in killed)  # killed and reaped
  res = pool.score([""] * 3, ["x", "y", "z"])
  np.testing.assert_array_equal(res.total_N, [2, 2, 2])
  assert (res.errors, res.timeouts) == (0, 0)
  pids = pool.worker_pids
  pool.close()
  pool.close()
  assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)  # no zombies
  with pytest.raises(RuntimeError, match="closed"):
    pool.score([""], ["x"])


def test_submitted_batches_score_in_the_background_and_collect_as_one_call():
  """submit returns at once while the workers score; collect concatenates the tickets in order and
  the circuit breaker counts the collect as one call (three tickets, one failing streak step)."""
  with RewardPool([(M + "slow_length", 1.0)], n_workers=3) as pool:  # one worker per call
    t0 = time.monotonic()
    tickets = [pool.submit([""] * 2, ["ab", "abc"]), pool.submit([""], ["abcd"])]
    assert time.monotonic() - t0 < 0.3, "submit waited for the scores"
    time.sleep(0.7)  # the caller's own work; the workers score meanwhile
    pool.poll()
    t1 = time.monotonic()
    res = pool.collect(tickets)
    assert time.monotonic() - t1 < 0.3, "the scores were not computed in the background"
    np.testing.assert_array_equal(res.total_N, [2, 3, 4])
  with RewardPool([(M + "raises", 1.0)], n_workers=1, max_error_calls=2) as pool:
    pool.collect([pool.submit([""], ["a"]) for _ in range(3)])  # one call: the streak is 1
    with pytest.raises(RewardsFailing):
      pool.collect([pool.submit([""], ["a"])])


def test_pool_fails_early_on_bad_arguments():
  with pytest.raises(ValueError, match="no_such_mod_xyz"):
    RewardPool([("math_answer", 1.0), ("no_such_mod_xyz:f", 1.0)])
  with pytest.raises(ValueError, match="unique"):
    RewardPool([("format", 1.0), ("format", 2.0)], n_workers=0)
  with pytest.raises(ValueError, match="finite"):
    RewardPool([("format", float("nan"))], n_workers=0)
  with pytest.raises(ValueError, match="batch lengths"), RewardPool([("format", 1.0)], n_workers=0) as pool:
    pool.score(["a"], ["b", "c"])


def test_pool_inline_mode():
  with RewardPool([(M + "length", 2.0), (M + "raises", 1.0)], n_workers=0, error_score=0.5) as pool:
    res = pool.score(["", ""], ["ab", "c"])
  np.testing.assert_array_equal(res.total_N, [4.5, 2.5])
  assert res.errors == 2


def test_the_old_rl_names_still_import():
  """The README promises `jaxrl_topo.rl.rewards`, `.reward_pool` and `.reward_worker` still import (aliases of the
  envs/ modules they moved to); nothing else imports them, so this is what keeps that true."""
  import importlib

  for name in ("rewards", "reward_pool", "reward_worker"):
    assert importlib.import_module(f"jaxrl_topo.rl.{name}") is importlib.import_module(f"jaxrl_topo.envs.{name}")


def test_the_reward_configs_pool_keys_reach_the_pool():
  """reward.chunk_size: a failing item costs its own chunk (1 item), not the whole batch (one worker's even share);
  reward.start_timeout_s: a worker not ready by then stops the run, naming the key."""
  from jaxrl_topo.runtime.sections import RewardSpec

  for chunk_size, want in ((1, [1, -1, 1, 1]), (0, [-1] * 4)):
    spec = RewardSpec(fn=M + "raises_on_bad", n_workers=1, chunk_size=chunk_size, error_score=-1.0)
    with RewardPool(spec.fns, **spec.pool_options) as pool:
      res = pool.score([""] * 4, ["a", "bad", "c", "d"])
    np.testing.assert_array_equal(res.total_N, want, err_msg=f"chunk_size={chunk_size}")
  spec = RewardSpec(fn=M + "one", n_workers=1, start_timeout_s=0.01)  # no spawned process is ready in 10 ms
  with pytest.raises(RuntimeError, match=r"did not start within 0.01 s.*raise reward.start_timeout_s"):
    RewardPool(spec.fns, **spec.pool_options)
  with pytest.raises(ValueError, match="chunk_size"):
    RewardSpec(chunk_size=-1)
