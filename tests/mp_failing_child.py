"""A child for tests/test_cli.py under launchers/local_multiprocess.py (not a test module).

  mp_failing_child.py dev_accuracy   every process computes the warm-up's dev accuracy for params held
                                     by process 0 alone, then for params spanning both processes
  mp_failing_child.py fail           process 1 raises after jax.distributed started; process 0 waits
                                     at a barrier process 1 never reaches
"""

import os
import sys

from absl import flags

from jaxrl_topo import cli

_MODE = flags.DEFINE_string("mode", "fail", "dev_accuracy | fail")
_MODEL = flags.DEFINE_string("model_dir", None, "A tiny HF directory (dev_accuracy).")


def _dev_accuracy() -> None:
  import jax

  from jaxrl_topo.data import pipeline
  from jaxrl_topo.models import hf_io
  from jaxrl_topo.models.model import abstract_model
  from jaxrl_topo.models.tokenizer import Tokenizer
  from jaxrl_topo.runtime import experiment
  from jaxrl_topo.runtime.config import config_from_file, from_config_dict
  from jaxrl_topo.topology.rules import TRAIN_RULES, make_mesh

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cfg = from_config_dict(config_from_file(os.path.join(root, "configs", "grpo_task.py"), "tiny"))
  model_dir = _MODEL.value
  tokenizer = Tokenizer.from_dir(model_dir)
  graphdef, _ = abstract_model(hf_io.read_config(model_dir))  # the warm-up's (no sharding constraints)
  examples = pipeline.load_prompts(cfg.data, tokenizer, "heldout").examples[:8]
  first = [d for d in jax.devices() if d.process_index == 0]
  for name, devices in (("one_holder", first), ("spanning", jax.devices())):
    _, _, params = hf_io.load_model(model_dir, make_mesh({"fsdp": len(devices)}, devices), TRAIN_RULES)
    acc = experiment.dev_accuracy(cfg, graphdef, params, tokenizer, examples)
    print(f"DEV-ACCURACY {name} {acc:.4f}", flush=True)


def main(argv) -> None:
  del argv
  from jaxrl_topo.runtime import distributed

  distributed.initialize()
  import jax

  if _MODE.value == "dev_accuracy":
    _dev_accuracy()
    return
  if jax.process_index() == 1:
    raise ValueError("process 1 gives up on purpose")
  from jax._src import distributed as jd
  jd.global_state.client.wait_at_barrier("never", 600_000)


if __name__ == "__main__":
  sys.exit(cli.launch(main))
