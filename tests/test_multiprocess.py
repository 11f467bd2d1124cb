"""Two real JAX processes (2 x 4 CPU devices, jax.distributed on localhost, gloo collectives).

launchers/sync_check.py, started through the user-facing local launcher, carves a disaggregated
topology (trainer on process 0's devices, rollout on process 1's) and a colocated one (both over
all 8 devices), syncs two weight versions in each, and checks every shard bit for bit.
"""

import json
import os
import sys

import pytest

from launchers import local_multiprocess

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_weight_sync_across_two_processes(capfd):
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "sync_check.py"), "--mode=disaggregated,colocated",
         "--trainer=fsdp=4", "--rollout=data=2,tensor=2", "--colocated_trainer=fsdp=8",
         "--colocated_rollout=data=2,tensor=4", "--n_kv_heads=4", "--bucket_mb=0.0625"]
  rc = local_multiprocess.run(cmd, num_processes=2, devices_per_process=4, timeout_s=300)
  out = capfd.readouterr().out
  assert rc == 0, f"a process failed (rc={rc}):\n{out[-4000:]}"
  rows = [(line[:4], json.loads(line.split("SYNC-OK ", 1)[1])) for line in out.splitlines() if "SYNC-OK " in line]
  for p in ("[p0]", "[p1]"):
    mine = {(r["mode"], r["gen_id"]): r for who, r in rows if who == p}
    assert set(mine) == {(m, g) for m in ("disaggregated", "colocated") for g in (1, 2)}, f"{p}: {sorted(mine)}"
    # Across processes the disjoint sides can only be bridged by collectives; colocated reshards locally.
    assert mine[("disaggregated", 1)]["routes"] == ["collective"]
    assert mine[("colocated", 1)]["routes"] == ["local"]
    assert mine[("disaggregated", 2)]["buckets"] > 1, "a 64 KiB bucket limit must split the tiny model"


def test_child_env_sets_the_distributed_contract():
  env = local_multiprocess.child_env(1, 2, 1234, 4, base={"PATH": "/bin"})
  assert env["JAXRL_COORDINATOR"] == "localhost:1234" and env["JAXRL_PROCESS_ID"] == "1"
  assert env["JAXRL_NUM_PROCESSES"] == "2" and env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


def test_distributed_config_errors_name_what_is_missing():
  from jaxrl_topo.runtime.distributed import DistributedConfig, initialize
  with pytest.raises(ValueError, match=r"missing \['num_processes', 'process_id'\]"):
    DistributedConfig(coordinator="localhost:1")
  with pytest.raises(ValueError, match="outside"):
    DistributedConfig(coordinator="localhost:1", num_processes=2, process_id=2)
  with pytest.raises(ValueError, match=r"partial multi-process environment: \['JAXRL_PROCESS_ID'\]"):
    DistributedConfig.from_env({"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "2"})
  assert DistributedConfig.from_env({}) == DistributedConfig()
  assert initialize(None, environ={}) == "single"  # no cluster, no flags: nothing to start


def test_sync_check_single_process_disaggregated():
  """The same check on the 8 fake devices of this one process (device_put routes, no collectives)."""
  from jaxrl_topo.models.presets import get_preset
  from jaxrl_topo.topology.carve import TopologyConfig
  from jaxrl_topo.topology.sync_check import run_sync_check
  rows = run_sync_check(TopologyConfig.from_dict({"mode": "disaggregated", "trainer": {"fsdp": 4},
                                                  "rollout": {"data": 2, "tensor": 2}}),
                        get_preset("tiny"), bucket_bytes=1 << 16, versions=2)
  assert [r["gen_id"] for r in rows] == [1, 2]
  assert rows[0]["bytes_total"] == 2 * 82304  # every tiny parameter once, in bf16
