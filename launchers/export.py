"""Write a trained policy as a Hugging Face directory (safetensors + config + tokenizer).

  python launchers/export.py --workdir=/tmp/run --out=/tmp/run/hf [--step=N --dtype=bfloat16]

Reads the run's config.json and its newest (or the given) checkpoint; LoRA adapters are merged.
`transformers.AutoModelForCausalLM.from_pretrained(out)` loads the result. Checked before anything is loaded:
--out is new, empty or an earlier export (marked by its exported_from.json; replaced), and is neither the workdir, nor
anything the run owns inside it (config.json, init_model/, checkpoints/, ...), nor the model the run started from.
"""

from collections.abc import Sequence

from absl import app, flags

from jaxrl_topo import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory of launchers/train.py.", required=True)
_OUT = flags.DEFINE_string("out", None, "Output HF directory (new, empty, or an earlier export to replace).",
                           required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Saved dtype (default: the params' own).")
_DISTRIBUTED = cli.define_distributed_flags()


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from jaxrl_topo.runtime import distributed
  from jaxrl_topo.runtime.export import export
  from jaxrl_topo.runtime.workdir import check_export_out

  dist = _DISTRIBUTED()  # a partial explicit set-up fails here, first
  check_export_out(_WORKDIR.value, _OUT.value)  # before anything loads (export checks it again)
  distributed.initialize(dist)
  step = export(_WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value)
  print(f"wrote the policy of step {step} to {_OUT.value}")


if __name__ == "__main__":
  cli.launch(main)
