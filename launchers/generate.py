"""Generate completions for a JSONL file of prompts with a local Hugging Face model directory.

  python launchers/generate.py --model=DIR --prompts=IN.jsonl --out=OUT.jsonl \
      [--max_new_tokens=64 --temperature=1.0 --top_p=1.0 --top_k=0 --min_p=0 --seed=0 --greedy --chat]

Input lines: {"prompt": "text"} (chat template applied with --chat) or {"prompt_ids": [ints]}.
Output lines, in input order: completion_ids, text, logprobs, finish_reason ("stop" | "length").
"""

from collections.abc import Sequence

import jax
from absl import app, flags, logging

from jaxrl_topo import cli
from jaxrl_topo.rollout import generate
from jaxrl_topo.rollout.sampling import SamplingConfig

_MODEL = flags.DEFINE_string("model", None, "Local HF directory (config.json, *.safetensors, tokenizer.json).",
                             required=True)
_PROMPTS = flags.DEFINE_string("prompts", None, "Input JSONL, one prompt per line.", required=True)
_OUT = flags.DEFINE_string("out", None, "Output JSONL, one completion per input line.", required=True)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Most tokens generated per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Softmax temperature (> 0) when sampling.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus mass in (0, 1]; 1 = off.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 = off.")
_MIN_P = flags.DEFINE_float("min_p", 0.0, "Keep tokens with p >= min_p * max p; 0 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed; prompt i uses keys from (seed, i, position).")
_GREEDY = flags.DEFINE_bool("greedy", False, "Arg-max decoding (ignores temperature/top_p/top_k/min_p).")
_CHAT = flags.DEFINE_bool("chat", False, "Wrap text prompts in the model's chat template as a user turn.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences decoded together.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_DATA = flags.DEFINE_integer("data", 1, "Data-parallel width of the rollout mesh (splits the batch).")
_TENSOR = flags.DEFINE_integer("tensor", 1, "Tensor-parallel width of the rollout mesh (splits heads/mlp).")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.info("process %d/%d devices=%s", jax.process_index(), jax.process_count(), jax.devices())
  sampling = SamplingConfig(greedy=_GREEDY.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                            top_p=_TOP_P.value, min_p=_MIN_P.value)
  rows = generate.run(_MODEL.value, _PROMPTS.value, _OUT.value, max_new_tokens=_MAX_NEW.value, sampling=sampling,
                      seed=_SEED.value, chat=_CHAT.value, batch_size=_BATCH.value, dtype=_DTYPE.value,
                      data=_DATA.value, tensor=_TENSOR.value)
  stops = sum(r["finish_reason"] == "stop" for r in rows)
  print(f"wrote {len(rows)} completions to {_OUT.value} ({stops} stopped, {len(rows) - stops} hit the length limit)")


if __name__ == "__main__":
  cli.launch(main)
