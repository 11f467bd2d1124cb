"""DAPO: clip-higher, token-mean loss, dynamic sampling and soft overlong punishment, no KL.

Each step makes two optimizer updates, one per half of the batch (rl.minibatches = run.n_micro = 2): with a
single update every ratio is 1 and clip-higher would never bind (the paper makes 16 per rollout batch).

  python launchers/train.py --config=configs/dapo.py:tiny --workdir=/tmp/dapo

Dynamic sampling drops prompt groups whose completions all got the same reward (no signal) and
draws more prompts, up to `reward.max_sampling_rounds` rollouts per step; overlong shaping costs
up to `overlong_penalty` over the last `overlong_buffer` tokens before the length limit.
"""

import os

import ml_collections

from jaxrl_topo.runtime.config import config_from_file


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = config_from_file(os.path.join(os.path.dirname(__file__), "grpo_task.py"), arg or "tiny")
  c.unlock()
  c.rl.clip_low = 0.2
  c.rl.clip_high = 0.28
  c.rl.minibatches = c.run.n_micro = 2
  c.rl.agg = "token-mean"
  c.rl.kl_coef = 0.0
  c.reward.dynamic_sampling = True
  c.reward.max_sampling_rounds = 3
  c.reward.overlong_buffer = 2
  c.reward.overlong_penalty = 0.5
  c.lock()
  return c
