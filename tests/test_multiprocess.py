"""Two real JAX processes (2 x 4 CPU devices, jax.distributed on localhost, gloo collectives).

The worker (tests/mp_worker.py) syncs weights across process boundaries in both topologies and
checks every shard bit for bit; this test runs it through the user-facing local launcher.
"""

import os
import sys

from launchers import local_multiprocess

WORKER = os.path.join(os.path.dirname(__file__), "mp_worker.py")


def test_weight_sync_across_two_processes(capfd):
  rc = local_multiprocess.run([sys.executable, WORKER], num_processes=2, devices_per_process=4, timeout_s=300)
  out = capfd.readouterr().out
  assert rc == 0, f"a worker failed (rc={rc}):\n{out[-4000:]}"
  for p in (0, 1):
    for check in ("disaggregated", "colocated"):
      assert f"[p{p}] MP-OK {check}" in out, f"process {p} did not confirm the {check} sync:\n{out[-4000:]}"


def test_child_env_sets_the_distributed_contract():
  env = local_multiprocess.child_env(1, 2, 1234, 4, base={"PATH": "/bin"})
  assert env["JAXRL_COORDINATOR"] == "localhost:1234" and env["JAXRL_PROCESS_ID"] == "1"
  assert env["JAXRL_NUM_PROCESSES"] == "2" and env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


def test_distributed_config_errors_name_what_is_missing():
  import pytest

  from jaxrl_topo.runtime.distributed import DistributedConfig, initialize
  with pytest.raises(ValueError, match=r"missing \['num_processes', 'process_id'\]"):
    DistributedConfig(coordinator="localhost:1")
  with pytest.raises(ValueError, match="outside"):
    DistributedConfig(coordinator="localhost:1", num_processes=2, process_id=2)
  with pytest.raises(ValueError, match=r"partial multi-process environment: \['JAXRL_PROCESS_ID'\]"):
    DistributedConfig.from_env({"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "2"})
  assert DistributedConfig.from_env({}) == DistributedConfig()
  assert initialize(None, environ={}) == "single"  # no cluster, no flags: nothing to start
