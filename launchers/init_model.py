"""Write a randomly initialised model of a preset as a local HF directory (char tokenizer included).

  python launchers/init_model.py --preset=tiny --out=runs/tiny_model [--seed=0]

The directory loads with `launchers/generate.py --model=...` and with `transformers`.
"""

from collections.abc import Sequence

from absl import app, flags

from jaxrl_topo import cli
from jaxrl_topo.models.fresh import write_fresh_model
from jaxrl_topo.models.presets import PRESETS, get_preset

_PRESET = flags.DEFINE_enum("preset", "tiny", sorted(PRESETS), "Model shape.")
_OUT = flags.DEFINE_string("out", None, "Directory to write.", required=True)
_SEED = flags.DEFINE_integer("seed", 0, "Initialisation seed.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  write_fresh_model(_OUT.value, get_preset(_PRESET.value), _SEED.value)
  print(f"wrote a fresh {_PRESET.value} model to {_OUT.value}")


if __name__ == "__main__":
  cli.launch(main)
