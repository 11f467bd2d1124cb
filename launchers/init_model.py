"""Write a randomly initialised model of a preset as a local HF directory (char tokenizer included).

  python launchers/init_model.py --preset=tiny --out=runs/tiny_model [--seed=0]
  python launchers/init_model.py --preset=tiny --set=n_layers=4 --set=d_model=128 --out=runs/tiny4
  python launchers/init_model.py --preset=qwen2.5-0.5b --out=runs/q05 --tokenizer_from=/models/Qwen2.5-0.5B

The directory loads with `launchers/generate.py --model=...` and with `transformers`. The built-in
char tokenizer covers a few hundred ids; for a preset with a real vocabulary, `--tokenizer_from=DIR`
copies that model's tokenizer (tokenizer*.json, special tokens, chat template, generation_config.json
for its EOS ids) instead, and without it a note says how much of the vocabulary the tokenizer covers.
--out must be a new or empty directory: an existing model (or anything else) there is refused, not overwritten.
"""

import json
import os
import shutil
from collections.abc import Sequence

from absl import app, flags

from jaxrl_topo import cli
from jaxrl_topo.models import hf_io
from jaxrl_topo.models.fresh import write_fresh_model
from jaxrl_topo.models.presets import PRESETS, get_preset

_PRESET = flags.DEFINE_enum("preset", "tiny", sorted(PRESETS), "Model shape.")
_OUT = flags.DEFINE_string("out", None, "Directory to write (new or empty: an existing one is never "
                           "overwritten).", required=True)
_SEED = flags.DEFINE_integer("seed", 0, "Initialisation seed.")
_TOKENIZER_FROM = flags.DEFINE_string("tokenizer_from", None, "A local HF directory whose tokenizer to ship instead "
                                      "of the char tokenizer (its vocabulary must fit the preset's).")
_SET = flags.DEFINE_multi_string("set", [], "A field of the preset's shape, name=value (repeatable), e.g. "
                                 "--set=n_layers=4 --set=d_model=128: as a run's model.overrides.")


def preset_with(preset: str, items: Sequence[str]):
  """The preset's ModelConfig with `--set` items (field=value) over it; raises naming the item at fault."""
  from jaxrl_topo.runtime.sections import NOT_ARCHITECTURE

  overrides = {}
  for item in items:
    name, eq, text = item.partition("=")
    if not eq:
      raise cli.UserError(f"--set={item}: expected field=value")
    if name in NOT_ARCHITECTURE:
      raise cli.UserError(f"--set={item}: not part of the model's config.json (a run sets it: "
                          f"{NOT_ARCHITECTURE[name]})")
    if name in overrides:  # before: the last one won, and the printed shape named both
      raise cli.UserError(f"--set: {name} given twice ({name}={overrides[name]!r}, {item}): give it once")
    overrides[name] = cli.value_of(text)
  try:  # a field that does not exist is named with the nearest; then ModelConfig's own checks
    return get_preset(preset, **overrides)
  except (TypeError, ValueError) as e:
    raise cli.UserError(f"--set: {e}") from None


def check_tokenizer(src: str, vocab_size: int) -> None:
  """Raises, before anything is written, unless `src` has a tokenizer whose vocabulary fits `vocab_size`."""
  from jaxrl_topo.models.tokenizer import Tokenizer

  if not os.path.isfile(os.path.join(src, "tokenizer.json")):
    raise FileNotFoundError(f"--tokenizer_from={src}: no tokenizer.json there")
  n = Tokenizer.from_dir(src).tok.get_vocab_size(with_added_tokens=True)
  if n > vocab_size:
    raise ValueError(f"--tokenizer_from={src}: its {n} tokens do not fit the preset's vocab_size {vocab_size}")


def copy_tokenizer(src: str, out: str, vocab_size: int) -> list[str]:
  """Replaces the char tokenizer's files with `src`'s (hf_io.TOKENIZER_PREFIXES) and takes its BOS / EOS ids into
  config.json; returns the names copied. None of the char tokenizer's files stay behind: its chat template or
  generation_config.json would otherwise win over a source that keeps its template in tokenizer_config.json or
  has no generation config."""
  from jaxrl_topo.models.tokenizer import Tokenizer

  check_tokenizer(src, vocab_size)
  for name in hf_io.tokenizer_files(out):
    os.remove(os.path.join(out, name))
  copied = [f for f in hf_io.tokenizer_files(src) if os.path.isfile(os.path.join(src, f))]
  for name in copied:
    shutil.copy(os.path.join(src, name), os.path.join(out, name))
  tok = Tokenizer.from_dir(src)  # its EOS ids: src's generation_config.json, else its config.json, else its tokenizer
  ids = {"bos_token_id": None if tok.bos_token is None else tok.token_to_id(tok.bos_token),
         "eos_token_id": list(tok.eos_token_ids) or None}
  with open(os.path.join(out, "config.json")) as f:
    config = json.load(f)
  config = {k: v for k, v in config.items() if k not in ids} | {k: v for k, v in ids.items() if v is not None}
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return copied


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  cfg = preset_with(_PRESET.value, _SET.value)
  hf_io.check_out_dir(_OUT.value)  # never over a model (or anything else) the user already has
  if _TOKENIZER_FROM.value:
    check_tokenizer(_TOKENIZER_FROM.value, cfg.vocab_size)
  write_fresh_model(_OUT.value, cfg, _SEED.value)
  shape = _PRESET.value + (f" ({', '.join(_SET.value)})" if _SET.value else "")
  if _TOKENIZER_FROM.value:
    copied = copy_tokenizer(_TOKENIZER_FROM.value, _OUT.value, cfg.vocab_size)
    print(f"wrote a fresh {shape} model to {_OUT.value} with the tokenizer of {_TOKENIZER_FROM.value} "
          f"({', '.join(copied)})")
    return
  from jaxrl_topo.models.tokenizer import Tokenizer

  covered = Tokenizer.from_dir(_OUT.value).tok.get_vocab_size(with_added_tokens=True)
  print(f"wrote a fresh {shape} model to {_OUT.value}")
  if covered < cfg.vocab_size // 2:
    print(f"note: its char tokenizer covers {covered} of the model's {cfg.vocab_size:,} token ids, so text in and out "
          "is limited to those characters; --tokenizer_from=DIR ships a real model's tokenizer instead")


if __name__ == "__main__":
  cli.launch(main)
