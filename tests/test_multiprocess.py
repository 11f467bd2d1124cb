"""Two real JAX processes (2 x 4 CPU devices, jax.distributed on localhost, gloo collectives).

launchers/sync_check.py, started through the user-facing local launcher, carves a disaggregated
topology (trainer on process 0's devices, rollout on process 1's) and a colocated one (both over
all 8 devices), syncs two weight versions in each, and checks every shard bit for bit.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_topo import cli
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
  # The launchers' flags: a partial explicit set-up is a one-line error before anything starts
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "train.py"), "--config=" + os.path.join(
      ROOT, "configs", "grpo_task.py") + ":tiny", f"--workdir={os.devnull}x", "--coordinator=localhost:1"],
      capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert "--coordinator/--num_processes/--process_id: explicit jax.distributed set-up needs" in r.stderr


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


RL_FLAGS = {"topology.trainer.fsdp": 4, "topology.rollout.data": 2, "topology.rollout.tensor": 2,
            "topology.mode": "async", "run.max_staleness": 2, "run.land_after_chunks": 1, "run.steps": 3,
            "run.deterministic": True,  # the one-process reference takes the counter schedule too
            "run.checkpoint_every": 2, "run.sft_steps": 80, "run.sft_target_accuracy": 0.0, "data.batch_size": 4,
            "rl.group_size": 4, "rollout.n_slots": 16, "run.eval_every": 0, "run.eval_size": 32,
            "reward.n_workers": 0, "run.tensorboard": False, "run.plot": False,
            "rollout.min_pack_rows": 8}  # one decode batch per shard (8 slots): fewer programs to compile


def _rl_launch(workdir, capfd) -> tuple[int, str]:
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "train.py"),
         f"--config={os.path.join(ROOT, 'configs', 'grpo_task.py')}:tiny", f"--workdir={workdir}", "--noprogress",
         *[f"--config.{k}={v}" for k, v in RL_FLAGS.items()]]
  rc = local_multiprocess.run(cmd, num_processes=2, devices_per_process=4, timeout_s=400)
  return rc, capfd.readouterr().out


@pytest.mark.slow
def test_async_rl_across_two_processes_takes_the_one_process_decisions(tmp_path, capfd, monkeypatch):
  """Async RL with the trainer on process 0's devices and the rollout on process 1's: every rollout
  token and reward equals the same run in one process; rollout overlaps training; the checkpoint
  (held by process 0 alone) restores on both processes."""
  from jaxrl_topo.runtime import spans as spans_lib
  from jaxrl_topo.runtime.export import export
  from jaxrl_topo.runtime.metrics import read_metrics

  for k, v in {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}.items():
    monkeypatch.setenv(k, v)  # the launches' processes share their compiles (the relaunch reuses them)
  rc, out = _rl_launch(tmp_path / "mp", capfd)
  assert rc == 0, f"a process failed (rc={rc}):\n{out[-5000:]}"
  ref = _one_process_run(tmp_path / "sp")
  got, want = read_metrics(str(tmp_path / "mp")), read_metrics(str(ref))
  assert [r["step"] for r in got] == [0, 1, 2]
  assert sum(r["reward_mean"] for r in want) > 0, "the reference must sample some rewarded answers"
  for g, w in zip(got, want, strict=True):  # the same tokens were sampled: same rewards, lengths, versions
    for k in ("reward_mean", "reward/correct", "response/length_mean", "staleness/max", "perf/tokens"):
      assert g[k] == w[k], f"step {g['step']}: {k} {g[k]} across processes, {w[k]} in one"
    # Train-side numbers differ in summation order only (gloo across processes, threads within one).
    np.testing.assert_allclose(g["grad_norm"], w["grad_norm"], rtol=2e-2)
  spans = spans_lib.read_spans(str(tmp_path / "mp"))
  train = {s["step"]: s for s in spans if s["phase"] == "train"}
  rollouts = {s["step"]: s for s in spans if s["phase"] == "rollout"}
  assert set(train[0]["devices"]) == {0, 1, 2, 3}  # process 1's devices are numbered from 2048 on CPU
  assert len(set(rollouts[0]["devices"])) == 4 and not set(rollouts[0]["devices"]) & {0, 1, 2, 3}
  assert any(min(train[k]["end"], rollouts[k + 1]["end"]) > max(train[k]["start"], rollouts[k + 1]["start"])
             for k in range(2)), "across processes, no rollout overlapped a train step"
  with open(tmp_path / "mp" / "summary.json") as f:
    first = json.load(f)
  # Relaunch with nothing left to train: both processes restore step 3 (process 1 learns it from
  # process 0), and the restored weights evaluate exactly as the run's final ones did.
  rc, out = _rl_launch(tmp_path / "mp", capfd)
  assert rc == 0, f"resume failed (rc={rc}):\n{out[-5000:]}"
  with open(tmp_path / "mp" / "summary.json") as f:
    second = json.load(f)
  assert second["resumed_from"] == 3 and second["accuracy_after"] == first["accuracy_after"]
  for k in ("final_reward_mean", "steps_per_hour", "tokens_per_s", "wall_s"):  # the run's figures survive
    assert second[k] == first[k] is not None, k
  # Exported under two processes: process 1 holds no trainer device, so it neither reads the checkpoint (before: it
  # tried, and failed) nor writes; the weights equal a one-process export's. Set up by the launcher's own flags
  # (--coordinator, --num_processes, --process_id; before, only environment variables could), not by
  # local_multiprocess's environment.
  port = cli.free_port()
  export_cmd = [sys.executable, os.path.join(ROOT, "launchers", "export.py"), f"--workdir={tmp_path / 'mp'}",
                f"--out={tmp_path / 'hf2'}", f"--coordinator=localhost:{port}", "--num_processes=2"]
  envs = [{k: v for k, v in local_multiprocess.child_env(i, 2, port, 4).items() if not k.startswith("JAXRL_")}
          for i in range(2)]
  logs = [tmp_path / f"export{i}.log" for i in range(2)]
  procs = [subprocess.Popen([*export_cmd, f"--process_id={i}"], env=envs[i], stdout=logs[i].open("w"),
                            stderr=subprocess.STDOUT) for i in range(2)]
  codes = [p.wait(timeout=300) for p in procs]
  assert codes == [0, 0], "the export failed:\n" + "\n".join(log.read_text()[-3000:] for log in logs)
  export(str(tmp_path / "mp"), str(tmp_path / "hf1"))
  assert (tmp_path / "hf2" / "model.safetensors").read_bytes() == (tmp_path / "hf1" / "model.safetensors").read_bytes()


def _one_process_run(workdir):
  from jaxrl_topo.runtime import run as run_lib
  from jaxrl_topo.runtime.config import config_from_file, from_config_dict

  c = config_from_file(os.path.join(ROOT, "configs", "grpo_task.py"), "tiny")
  for dotted, value in RL_FLAGS.items():
    node = c
    *path, last = dotted.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  run_lib.train(from_config_dict(c), str(workdir), progress=False)
  return workdir
