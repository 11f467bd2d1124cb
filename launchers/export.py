"""Write a trained policy as a Hugging Face directory (safetensors + config + tokenizer).

  python launchers/export.py --workdir=/tmp/run --out=/tmp/run/hf [--step=N --dtype=bfloat16]

Reads the run's config.json and its newest (or the given) checkpoint; LoRA adapters are merged.
`transformers.AutoModelForCausalLM.from_pretrained(out)` loads the result. Checked before anything is loaded:
--out is new, empty or an earlier export (a model directory, replaced), and is neither the workdir, nor
anything the run owns inside it (config.json, init_model/, checkpoints/, ...), nor the model the run started from.
"""

import json
import os
from collections.abc import Sequence

from absl import app, flags

from jaxrl_topo import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory of launchers/train.py.", required=True)
_OUT = flags.DEFINE_string("out", None, "Output HF directory (new, empty, or an earlier export to replace).",
                           required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Saved dtype (default: the params' own).")

_ALSO_OWNED = ("profile",)  # written by a run with profiling on (runtime/run.py), besides workdir.RUN_FILES


def _base_model(workdir: str) -> str | None:
  """The HF directory the run started from (its config's model.hf_dir), when config.json names one."""
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      hf_dir = json.load(f).get("model", {}).get("hf_dir")
  except (OSError, ValueError, AttributeError):
    return None  # run.export names what is wrong with the config
  return hf_dir if isinstance(hf_dir, str) and hf_dir else None


def check_out(workdir: str, out: str) -> None:
  """Raises, writing nothing, when `out` would overwrite the run (or its base model) or cannot be written."""
  from jaxrl_topo.models import hf_io
  from jaxrl_topo.runtime.workdir import RUN_FILES

  work, dest = os.path.realpath(workdir), os.path.realpath(out)
  if dest == work:
    raise ValueError(f"--out={out} is the --workdir: the export would overwrite the run's config.json; "
                     f"write it to a new directory, e.g. --out={os.path.join(workdir, 'hf')}")
  inside = os.path.relpath(dest, work).split(os.sep)[0] if dest.startswith(work + os.sep) else None
  if inside in RUN_FILES + _ALSO_OWNED:
    raise ValueError(f"--out={out} is the run's own {inside} (in --workdir={workdir}): writing there would "
                     f"damage the run; use e.g. --out={os.path.join(workdir, 'hf')}")
  base = _base_model(workdir)
  if base and os.path.realpath(base) == dest:
    raise ValueError(f"--out={out} is the model the run started from (model.hf_dir): choose a new directory")
  hf_io.check_out_dir(out, replace_model=True)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  check_out(_WORKDIR.value, _OUT.value)
  from jaxrl_topo.runtime import distributed, run

  distributed.initialize()
  step = run.export(_WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value)
  print(f"wrote the policy of step {step} to {_OUT.value}")


if __name__ == "__main__":
  cli.launch(main)
