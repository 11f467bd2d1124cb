"""PPO with a learned critic (GAE advantages, clipped value loss) on a built-in task.

  python launchers/train.py --config=configs/ppo_critic.py:tiny --workdir=/tmp/ppo

`critic=shared` puts a value head on the policy backbone; `--config.rl.critic=separate` trains a
second backbone. Same task and warm-up as configs/grpo_task.py; one completion per prompt.
"""

import os

import ml_collections

from jaxrl_topo.runtime.config import config_from_file


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = config_from_file(os.path.join(os.path.dirname(__file__), "grpo_task.py"), arg or "tiny")
  c.unlock()
  c.rl.advantage = "gae"
  c.rl.critic = "shared"
  c.rl.group_size = 1
  c.rl.gamma = 1.0
  c.rl.lam = 0.95
  c.rl.value_coef = 0.5
  c.data.batch_size = c.data.batch_size * 4  # a quarter of the GRPO config's sequences a step (64 against 256)
  c.lock()
  return c
