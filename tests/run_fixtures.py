"""The tiny demo config as the loop tests run it: configs/<name>.py with overrides, on the 8-device topologies."""

from __future__ import annotations

import os

from jaxrl_topo.runtime.config import config_from_file, from_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str, arg: str, **overrides):
  """configs/<name>.py:<arg> with dotted overrides, as the launcher applies them."""
  c = config_from_file(os.path.join(ROOT, "configs", f"{name}.py"), arg)
  for dotted, value in overrides.items():
    node = c
    *path, last = dotted.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return c


TOPO = {"colocated": dict(mode="colocated", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2}),
        "disaggregated": dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2}),
        "async": dict(mode="async", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2})}

ETA = {"colocated": 0, "disaggregated": 1, "async": 2}  # the staleness bound each mode's loop tests run under


def tiny_cfg(mode: str, steps: int, **kw):
  """The tiny demo config, converted: a short run in `mode` on TOPO[mode], a 10-step warm-up, in-process rewards."""
  c = load_config("grpo_task", "tiny", **{"run.steps": steps, "run.eval_every": 0, "run.tensorboard": False,
                                          "run.plot": False, "reward.n_workers": 0, "run.sft_steps": 10,
                                          "run.sft_target_accuracy": 0.0,
                                          "data.batch_size": 4, "rl.group_size": 4, "rollout.n_slots": 16, **kw})
  c.topology = TOPO[mode]
  return from_config_dict(c)
