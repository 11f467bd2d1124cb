"""One process of the 2-process test (tests/test_multiprocess.py): jax.distributed on localhost, gloo.

Process 0 owns devices 0-3, process 1 devices 4-7. Checks, on every process, for its own shards:
  disaggregated  trainer fsdp=4 on process 0 -> rollout data=2 x tensor=2 on process 1, bf16;
  colocated      trainer fsdp=8 over both processes -> rollout data=2 x tensor=4 over both, bf16.
Prints "MP-OK <check>" per passed check; any mismatch raises (non-zero exit).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_topo.models.model import abstract_model, init_params, param_shardings
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.runtime import distributed
from jaxrl_topo.topology import crossproc
from jaxrl_topo.topology.rules import ROLLOUT_RULES, TRAIN_RULES, make_mesh


def _check_equal(dst, full_src, what):
  for s in dst.addressable_shards:
    want = np.asarray(full_src[s.index]).astype(jnp.bfloat16)
    if not np.array_equal(np.asarray(s.data), want):
      raise AssertionError(f"{what}: shard {s.index} on device {s.device.id} differs")


def main():
  assert distributed.initialize() == "explicit"
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  cfg = get_preset("tiny", n_kv_heads=4)  # 4 kv heads: tensor=4 divides them
  _, abstract = abstract_model(cfg)
  # The expected values: the same init on this process's first device (init values do not depend on
  # the mesh), so every process can check its own shards without gathering anything.
  local = lambda seed: jax.tree.leaves(jax.device_get(init_params(cfg, jax.random.key(seed))[1]))

  # Disaggregated: disjoint device sets owned by different processes.
  trainer = make_mesh({"fsdp": 4}, devices[:4])
  rollout = make_mesh({"data": 2, "tensor": 2}, devices[4:])
  _, params = init_params(cfg, jax.random.key(0), trainer, TRAIN_RULES)
  dst_shardings = param_shardings(abstract, rollout, ROLLOUT_RULES)
  leaves, treedef = jax.tree.flatten(params)
  dsts = treedef.flatten_up_to(dst_shardings)
  moved = crossproc.transfer_bucket(leaves, dsts, jnp.bfloat16)
  for want, y, d in zip(local(0), moved, dsts, strict=True):
    assert y.sharding == d and y.dtype == jnp.bfloat16
    _check_equal(y, want, "disaggregated")
  print("MP-OK disaggregated", len(moved), "leaves", flush=True)

  # Colocated: both sides over all 8 devices (both processes); the sync is one resharding program.
  trainer8 = make_mesh({"fsdp": 8}, devices)
  rollout8 = make_mesh({"data": 2, "tensor": 4}, devices)
  _, params8 = init_params(cfg, jax.random.key(1), trainer8, TRAIN_RULES)
  dst8 = param_shardings(abstract, rollout8, ROLLOUT_RULES)
  synced = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), out_shardings=dst8)(params8)
  for want, y in zip(local(1), jax.tree.leaves(synced), strict=True):
    _check_equal(y, want, "colocated")
  print("MP-OK colocated", flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
