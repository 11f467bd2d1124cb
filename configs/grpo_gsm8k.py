"""GRPO on a local GSM8K-style JSONL with a local Qwen2.5 / Qwen3 HF directory.

  python launchers/train.py --config=configs/grpo_gsm8k.py:/models/Qwen2.5-0.5B-Instruct \
      --workdir=/tmp/gsm8k --config.data.source=/data/gsm8k_train.jsonl \
      --config.data.eval_source=/data/gsm8k_test.jsonl [--config.topology.mode=disaggregated ...]

The argument after ':' is the model directory (config.json, *.safetensors, tokenizer.json; nothing is
downloaded). Rows are {"question": ..., "answer": "... #### 72"} (GSM8K's own format); the reward is
`math_answer` (the completion's \\boxed{} / "####" / last number against the number after "####")
plus 0.1 x `format`. Prompts go through the model's chat template with an instruction to box the
answer. Defaults fit one 8-GPU host: trainer fsdp=4, rollout data=4, disaggregated.
"""

import ml_collections

from jaxrl_topo.runtime.config import base_config_dict

INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base_config_dict()
  c.model.hf_dir = arg or "/models/Qwen2.5-0.5B-Instruct"
  c.model.dtype = "bfloat16"
  c.data.source = "gsm8k_train.jsonl"
  c.data.eval_source = "gsm8k_test.jsonl"
  c.data.prompt_field = "question"
  c.data.answer_field = "answer"
  c.data.chat_template = True
  c.data.instruction = INSTRUCTION
  c.data.max_prompt_len = 256
  c.data.batch_size = 32
  c.rollout.max_new_tokens = 512
  c.rollout.n_slots = 256
  c.rollout.temperature = 1.0
  c.rl.temperature = 1.0
  c.rl.group_size = 8
  c.rl.advantage = "grpo"
  c.rl.kl_coef = 0.0
  c.optim.lr = 1e-6
  c.optim.warmup_steps = 10
  c.reward.fn = "math_answer"
  c.reward.extra = {"format": 0.1}
  c.reward.n_workers = 4
  c.run.steps = 200
  c.run.eval_every = 20
  c.run.eval_size = 256
  c.run.n_micro = 8
  # 256 completions (~300-770 tokens each) packed into rows of <= 4,096 tokens, groups spread over the
  # 8 microbatches: a few percent padding instead of one 768-token row each (benchmarks/packing.py).
  c.train.max_tokens_per_row = 4096
  c.train.remat = "block"  # recompute each block in the backward pass: activations of one block at a time
  c.run.checkpoint_every = 20
  c.topology = dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 4}, reward_devices=0)
  c.lock()
  return c
