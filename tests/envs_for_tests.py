"""Environments for tests/test_envs*.py and tests/test_episodes_loop.py, named "envs_for_tests:Name" (the
tests directory is on sys.path, and the pool's workers get the parent's sys.path)."""

import time


class Chatty:
  """Replies "ok N" to turns 1 and 2 and ends at turn 3; reward 1.0 on turn 2 only."""

  def reset(self, example):
    self.n = 0
    return example["prompt"]

  def step(self, model_text):
    self.n += 1
    return f"ok {self.n}", float(self.n == 2), self.n >= 3, {"n": self.n}


class RaisesOnStep(Chatty):
  def step(self, model_text):
    raise RuntimeError("the environment broke")


class HangsOnStep(Chatty):
  def step(self, model_text):
    time.sleep(60)


class BadReset(Chatty):
  def reset(self, example):
    return 42


class CrashesWorker(Chatty):
  def step(self, model_text):
    import os
    os._exit(3)


class LongResetEmptyReply:
  """A 200-character reset observation; every step replies nothing and goes on."""

  def reset(self, example):
    return "y" * 200

  def step(self, model_text):
    return "", 0.0, False, {}
