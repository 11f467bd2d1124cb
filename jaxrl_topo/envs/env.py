"""Environments for multi-turn episodes: the protocol, and the call a worker process runs.

An environment is user code, named by import path (`env.fn = "pkg.module:Env"`), a class (or any
callable) that makes a fresh environment with no arguments:

  reset(example: dict) -> str                                    the first observation (the user turn)
  step(model_text: str) -> (observation: str, reward: float, done: bool, info: dict)

`model_text` is the model's turn as text (decoded from the sampled tokens, special tokens dropped).
An episode's return is the sum of its steps' rewards. `info` may hold numbers the run logs as means
over episodes (`env/<key>`), e.g. the tool task's `tool_calls` and `tool_correct`.

Workers hold no episode state: every call makes a fresh environment, resets it with the example and
replays the model's turns so far, returning the last step's result (`replay`). So a call may go to
any worker, a worker killed on a timeout loses nothing, and an environment must be deterministic
given (example, model turns) (seed any randomness from the example). Replaying costs O(turns^2)
steps per episode, nothing next to decoding for tool-sized environments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from jaxrl_topo.envs import rewards


class Env(Protocol):

  def reset(self, example: dict) -> str:
    ...

  def step(self, model_text: str) -> tuple[str, float, bool, dict]:
    ...


BUILTINS = {"calc": "jaxrl_topo.data.tool_calc:CalcEnv"}  # built-in names -> import paths


def resolve(path: str):
  """The environment factory named by a built-in name or "pkg.module:Name" (rewards.resolve's rules)."""
  return rewards.resolve(path, what="env.fn", builtins=BUILTINS, args=())


def replay(make_env, example: Mapping[str, Any], model_texts: Sequence[str]) -> tuple[str, float, bool, dict]:
  """A fresh environment reset with `example`, stepped through `model_texts`: (observation, the last
  step's reward, done, info); with no texts, (reset's observation, 0, False, {})."""
  env = make_env()
  obs, reward, done, info = checked_reset(env, example), 0.0, False, {}
  for text in model_texts:
    obs, reward, done, info = checked_step(env, text)
    if done:
      break
  return obs, reward, done, info


def checked_reset(env: Env, example: Mapping[str, Any]) -> str:
  """env.reset(a copy of `example`), its observation checked to be a str."""
  obs = env.reset(dict(example))
  if not isinstance(obs, str):
    raise TypeError(f"reset returned {type(obs).__name__}, not str")
  return obs


def checked_step(env: Env, text: str) -> tuple[str, float, bool, dict]:
  """env.step(text) checked: (observation str, finite reward, done, the info's plain values)."""
  out = env.step(text)
  if not (isinstance(out, tuple) and len(out) == 4):
    raise TypeError(f"step must return (observation, reward, done, info), got {out!r:.80}")
  obs, reward, done, info = out
  reward = float(reward)
  if not isinstance(obs, str) or not math.isfinite(reward) or not isinstance(info, Mapping):
    raise TypeError(f"step returned observation {type(obs).__name__}, reward {reward}, info "
                    f"{type(info).__name__}: needs str, a finite number, a mapping")
  return obs, reward, bool(done), {k: v for k, v in dict(info).items() if isinstance(v, int | float | bool | str)}
