r"""Generate completions for a JSONL file of prompts with a local Hugging Face model directory.

  python launchers/generate.py --model=DIR --prompts=IN.jsonl --out=OUT.jsonl \
      [--max_new_tokens=64 --temperature=1.0 --top_p=1.0 --top_k=0 --min_p=0 --seed=0 --greedy --chat]
      [--stop="</answer>" --stop="\n\n"] [--read=window --kv_dtype=bfloat16 --min_pack_rows=2 --min_window_tokens=64]
      [--pallas_splits=0 --page_size=16 --decode_chunk=8]

Input lines: {"prompt": "text"} (chat template applied with --chat) or {"prompt_ids": [ints]}.
Output lines, in input order: completion_ids, text, logprobs, finish_reason ("stop" | "length").
A completion that contains a --stop string ends right after it: the engine stops decoding it there, its
tokens and log-probs cut to the shortest prefix whose text holds the stop string (finish_reason "stop").
Checked before any work: the flag values (--greedy ignores the sampling flags), the model directory
(config.json, the weights' headers), --out (a writable file, not --prompts), every prompt line, and every
prompt + max_new_tokens against the model's position limit (max_position_embeddings).
"""

import os
from collections.abc import Sequence

import jax
from absl import app, flags, logging

from jaxrl_topo import cli
from jaxrl_topo.rollout import generate
from jaxrl_topo.rollout.paged import READ_HELP, READS
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
_STOP = flags.DEFINE_multi_string("stop", [], r"Stop string (repeatable): a completion ends right after it. "
                                  r"\n, \t and \\ in it are a newline, a tab and a backslash (--stop='\n').")
_READ = flags.DEFINE_enum("read", "auto", list(READS), READ_HELP)
_PAGE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page: the engine's pool is allocated in pages of this "
                             "many (larger pages: fewer gathers a step, more tokens unused at each sequence's end).")
_CHUNK = flags.DEFINE_integer("decode_chunk", 8, "Decode steps per device call (between host reads of the tokens).")
_ENGINE = cli.define_engine_flags()


def _stops() -> list[str]:
  r"""--stop's strings, \n, \t and \\ read as a newline, a tab and a backslash (cli.unescape)."""
  return [cli.unescape(s) for s in _STOP.value]


def check_flags() -> SamplingConfig:
  """The sampling config, after the checks of flag values alone; raises naming the flag at fault."""
  if _MAX_NEW.value < 1:
    raise ValueError(f"--max_new_tokens={_MAX_NEW.value} must be >= 1")
  generate.check_sizes(_BATCH.value, _DATA.value, _TENSOR.value, name=lambda n: f"--{n}")
  for flag in (_PAGE, _CHUNK):
    if flag.value < 1:
      raise ValueError(f"--{flag.name}={flag.value} must be >= 1")
  if "" in _stops():  # the empty string is in every text: each completion would end at its first token
    raise ValueError("--stop='' is empty: a stop string must be non-empty (an unset shell variable?)")
  if _GREEDY.value:  # as --help says: the sampling flags are ignored
    return SamplingConfig(greedy=True)
  try:
    return SamplingConfig(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value, min_p=_MIN_P.value)
  except ValueError as e:  # "temperature must be > 0 unless greedy, got temperature=-5": name the flag
    raise ValueError(f"--{e}") from None


def check_inputs(model_dir: str, prompts_path: str, out_path: str, max_new_tokens: int, chat: bool):
  """The tokenizer (or None), after the checks that need no devices; raises with the flag at fault."""
  from jaxrl_topo.data.pipeline import read_jsonl
  from jaxrl_topo.models import hf_io
  from jaxrl_topo.models.tokenizer import Tokenizer
  from jaxrl_topo.runtime.workdir import check_not_a_runs_file

  if os.path.isdir(os.path.join(model_dir, "checkpoints")) or os.path.isfile(os.path.join(model_dir, "identity.json")):
    raise ValueError(f"--model={model_dir} is a training run's workdir, not a model directory: export its policy "
                     f"first (python launchers/export.py --workdir={model_dir} --out={os.path.join(model_dir, 'hf')}) "
                     f"and pass --model={os.path.join(model_dir, 'hf')}")
  if not os.path.isfile(os.path.join(model_dir, "config.json")):
    raise FileNotFoundError(f"--model={model_dir}: no config.json there (expected a local Hugging Face model "
                            "directory, e.g. from launchers/init_model.py or launchers/export.py)")
  if not os.path.isfile(prompts_path):
    raise FileNotFoundError(f"--prompts={prompts_path}: no such file")
  if os.path.realpath(out_path) == os.path.realpath(prompts_path):
    raise ValueError(f"--out={out_path} is the --prompts file: writing it would destroy the input")
  model_real = os.path.realpath(model_dir)
  in_model = any(os.path.realpath(os.path.dirname(p)) == model_real for p in (os.path.abspath(out_path),
                                                                                os.path.realpath(out_path)))
  if in_model and os.path.isfile(out_path) and not os.path.realpath(out_path).endswith(
      ".jsonl"):  # before: written over, e.g. the model's config.json or weights (a link to one too)
    raise ValueError(f"--out={out_path} is a file of the --model directory: writing it would destroy the model; "
                     "nothing was written. Name a new file (e.g. completions.jsonl)")
  check_not_a_runs_file(out_path, "--out")
  generate.check_out_file(out_path)
  cfg = hf_io.read_config(model_dir)
  hf_io.tensor_files(model_dir)  # the weights' headers: a truncated file fails here, not after the tokenizer
  tokenizer = Tokenizer.from_dir(model_dir) if os.path.isfile(os.path.join(model_dir, "tokenizer.json")) else None
  if _STOP.value and tokenizer is None:
    raise ValueError(f"--stop needs the text of completions: {model_dir} has no tokenizer.json")
  prompts = generate.read_prompts(prompts_path, tokenizer, chat, cfg.vocab_size)
  wheres = [where for where, _ in read_jsonl(prompts_path)]
  for where, ids in zip(wheres, prompts, strict=True):
    if len(ids) + max_new_tokens > cfg.max_position:
      raise ValueError(f"{where}: the prompt's {len(ids)} tokens + --max_new_tokens={max_new_tokens} exceed the "
                       f"model's position limit {cfg.max_position} (max_position_embeddings)")
  return tokenizer


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  sampling = check_flags()  # flag values alone, first: a bad one is named as the flag
  engine = generate.engine_knobs({**_ENGINE(), "decode_chunk": _CHUNK.value})
  check_inputs(_MODEL.value, _PROMPTS.value, _OUT.value, _MAX_NEW.value, _CHAT.value)
  logging.info("process %d/%d devices=%s", jax.process_index(), jax.process_count(), jax.devices())
  rows = generate.run(_MODEL.value, _PROMPTS.value, _OUT.value, max_new_tokens=_MAX_NEW.value, sampling=sampling,
                      seed=_SEED.value, chat=_CHAT.value, batch_size=_BATCH.value, dtype=_DTYPE.value,
                      data=_DATA.value, tensor=_TENSOR.value, read=_READ.value, engine=engine, stop=_stops(),
                      page_size=_PAGE.value)
  stops = sum(r["finish_reason"] == "stop" for r in rows)
  print(f"wrote {len(rows)} completion{'' if len(rows) == 1 else 's'} to {_OUT.value} ({stops} stopped, "
        f"{len(rows) - stops} hit the length limit)")


if __name__ == "__main__":
  cli.launch(main)
