"""GRPO on multi-turn, tool-using episodes: 2-digit multiplication with a calculator (data/tool_calc.py).

  python launchers/train.py --config=configs/tool_calc.py --workdir=/tmp/calc

The tiny char-level model (random init) is warmed up on demonstrations in which a quarter of the
answers call the tool (`<calc>83*15</calc>` -> `<result>1245</result>` -> `1245`) and the rest
guess from the head; the environment's replies are masked in the warm-up loss as in RL. RL then
finds that the tool pays: held-out accuracy and the rate of correct tool calls (`eval/env/tool_correct`)
rise. Episodes: at most 3 model turns and 96 tokens after the prompt; a turn ends at EOS or at
"</calc>". The environment runs in 2 killable worker processes (env.timeout_s per call).
"""

import ml_collections

from jaxrl_topo.runtime.config import base_config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base_config_dict()
  c.data.source = "tool_calc"
  c.data.task = ml_collections.ConfigDict(dict(name="tool_calc", seed=0, n_train=4000, n_heldout=128, max_operand=99,
                                               ops="*"))
  c.data.chat_template = True
  c.data.max_prompt_len = 32
  c.data.batch_size = 16
  c.env.fn = "calc"
  c.env.max_turns = 3
  c.env.n_workers = 2
  c.reward.fn = "task"  # not used for episodes (the environment's return is the reward); the warm-up's verifier
  c.reward.n_workers = 0
  c.rollout.max_new_tokens = 96
  c.rollout.stop = ("</calc>",)
  c.rollout.n_slots = 128
  c.rl.advantage = "grpo"
  c.rl.group_size = 8
  c.model.preset = "tiny"
  c.optim.lr = 1e-3
  c.run.sft_steps = int(arg) if arg else 600  # fixed: its single-turn dev accuracy says nothing about episodes
  c.run.sft_target_accuracy = 0.0
  c.run.sft_batch = 64
  c.run.steps = 60
  c.run.eval_every = 20
  c.run.eval_size = 128
  c.lock()
  return c
