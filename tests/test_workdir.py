"""Tests for runtime/workdir.py: a workdir's run identity, the checks made before it is touched, --fresh.

Before: only launchers/train.py compared a workdir's config.json with the new config, so `run.train` from a
script resumed a workdir of another model or task (a 2-layer init_model under a 3-layer config), and --fresh
deleted the old run before the new config was checked (its checks against data, model and meshes:
tests/test_preflight.py)."""

import dataclasses
import json
import os
import re

import pytest
from test_rl_loop import load_config

from jaxrl_topo.runtime import run as run_lib
from jaxrl_topo.runtime import workdir
from jaxrl_topo.runtime.config import from_config_dict


def _config(**overrides):
  return load_config("grpo_task", "tiny", **overrides)


def _fake_run(work, recorded):
  """A workdir holding a preset's init_model/ and checkpoint 4 of the run `recorded` (a ConfigDict)."""
  (work / "checkpoints" / "4").mkdir(parents=True)
  (work / "init_model").mkdir()
  (work / "init_model" / "config.json").write_text("{}")
  workdir.write_identity(from_config_dict(recorded), str(work))


def test_a_script_cannot_resume_a_workdir_of_another_run(tmp_path):
  """run.train (no launcher) refuses a workdir recorded with another task and model, naming both, before it
  reads or writes anything there; the same identity passes."""
  work = tmp_path / "w"
  _fake_run(work, _config())
  before = sorted(p.name for p in work.rglob("*"))
  changed = from_config_dict(_config(**{"data.task.length": 5, "model.overrides": {"n_layers": 3}}))
  with pytest.raises(ValueError, match="holds another run") as err:
    run_lib.train(changed, str(work), progress=False)
  assert "data.task: {" in str(err.value) and "'length': 4" in str(err.value) and "'length': 5" in str(err.value)
  assert "model.overrides: {} -> {'n_layers': 3}" in str(err.value)
  assert "--fresh" not in str(err.value) and "empty this one to start over" in str(err.value)  # no such flag here
  assert sorted(p.name for p in work.rglob("*")) == before
  workdir.check_workdir(from_config_dict(_config(**{"run.steps": 7})), str(work))  # not identity: resumes


def test_an_unrecorded_run_is_refused_by_the_launcher_and_trusted_by_a_script(tmp_path):
  work = tmp_path / "w"
  (work / "checkpoints" / "4").mkdir(parents=True)
  cfg = from_config_dict(_config())
  with pytest.raises(ValueError, match="holds checkpoints but no config.json or identity.json"):
    workdir.check_workdir(cfg, str(work))
  workdir.check_workdir(cfg, str(work), need_record=False)


def test_a_launcher_runs_config_json_is_its_record(tmp_path):
  """Runs recorded before identity.json: the launcher's config.json (a ConfigDict) gives the identity."""
  work = tmp_path / "w"
  (work / "checkpoints" / "4").mkdir(parents=True)
  (work / "config.json").write_text(_config().to_json(indent=2))
  workdir.check_workdir(from_config_dict(_config()), str(work))
  with pytest.raises(ValueError, match=r"model.init_seed: 0 -> 7"):
    workdir.check_workdir(from_config_dict(_config(**{"model.init_seed": 7})), str(work))


def test_fresh_clears_only_the_runs_files(tmp_path):
  """start_over removes the run's files and keeps anything else in the workdir; after it the check passes."""
  work = tmp_path / "w"
  _fake_run(work, _config())
  (work / "config.json").write_text(_config().to_json(indent=2))
  (work / "notes.txt").write_text("mine")
  new = from_config_dict(_config(**{"model.init_seed": 7}))
  with pytest.raises(ValueError, match="model.init_seed: 0 -> 7"):
    workdir.check_workdir(new, str(work))
  assert sorted(workdir.start_over(str(work))) == ["checkpoints", "config.json", "identity.json", "init_model"]
  workdir.check_workdir(new, str(work))
  assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]


def test_fresh_refuses_a_folder_whose_checkpoints_or_tb_are_not_a_runs(tmp_path):
  """--fresh deletes checkpoints/ and tb/ whole: another tool's files there are named and nothing is deleted; a
  run's own (orbax step folders, a save in progress, tfevents) pass."""
  work = tmp_path / "w"
  (work / "checkpoints" / "3").mkdir(parents=True)
  (work / "checkpoints" / "4.orbax-checkpoint-tmp-17").mkdir()
  (work / "tb").mkdir()
  (work / "tb" / "events.out.tfevents.1796004646.vm").write_text("")
  workdir.check_fresh(str(work))
  (work / "checkpoints" / "model_epoch3.pt").write_text("mine")
  (work / "tb" / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match=r"checkpoints/model_epoch3.pt, tb/notes.txt, which no run writes"):
    workdir.start_over(str(work))
  assert (work / "checkpoints" / "model_epoch3.pt").read_text() == "mine" and (work / "tb" / "notes.txt").exists()


def test_a_group_larger_than_the_slots_is_a_config_error():
  with pytest.raises(ValueError, match=r"rl.group_size=16 > rollout.n_slots=8 / .*\(1\): a prompt.s samples are "):
    from_config_dict(_config(**{"rollout.n_slots": 8}))
  # 16 slots over 8 data shards hold 2 each: a group of 4 once passed here and failed after the warm-up, at the
  # first rollout ("request 0 does not fit the empty pool")
  shards = {"topology.rollout.data": 8, "topology.trainer.fsdp": 8, "rollout.n_slots": 16, "rollout.n_pages": 64}
  with pytest.raises(ValueError, match=r"rl.group_size=4 > rollout.n_slots=16 / .*\(8\): .* on one data shard"):
    from_config_dict(_config(**shards, **{"rl.group_size": 4}))
  from_config_dict(_config(**shards, **{"rl.group_size": 2}))


def test_a_bad_run_steps_is_reported_as_itself(tmp_path):
  """Before: configs/grpo_task.py:tiny copies run.steps into optim.total_steps, and the optim section, checked first,
  said "cosine schedule needs total_steps > warmup_steps" for --config.run.steps=-1."""
  with pytest.raises(ValueError, match=r"^run.steps=-1 must be >= 0"):
    from_config_dict(_config(**{"run.steps": -1}))
  # A model directory given where a run's workdir is expected (export.py, review.py --workdir)
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
  with pytest.raises(ValueError, match="is a model directory .*, not a run's workdir"):
    run_lib.load_config(str(tmp_path))


def test_topology_roles_other_than_the_reward_models_are_a_config_error():
  """Before: topology.roles = {"reference": "rollout"} was accepted and ignored (the reference stayed on the
  trainer); only the reward model's role moves in a run."""
  import ml_collections

  def with_roles(roles):
    d = _config().to_dict()
    d["topology"]["roles"] = roles
    return from_config_dict(ml_collections.ConfigDict(d))

  with pytest.raises(ValueError, match=r"topology.roles moves \{'reference': 'rollout'\}: a run keeps actor"):
    with_roles({"reference": "rollout"})
  assert dict(with_roles({"reward": "rollout", "actor": "trainer"}).topology.roles)["reward"] == "rollout"


def test_identity_is_what_json_reads_back(tmp_path):
  cfg = from_config_dict(_config(**{"lora.rank": 4}))
  workdir.write_identity(cfg, str(tmp_path))
  with open(tmp_path / "identity.json") as f:
    assert json.load(f) == workdir.identity(cfg)  # tuples (lora.targets) compare as the lists read back


def test_lora_settings_count_only_with_adapters():
  """A run without LoRA relaunched with another lora.alpha (or its targets reordered) was refused as another run."""
  plain = workdir.identity(from_config_dict(_config()))
  retuned = workdir.identity(from_config_dict(_config(**{"lora.alpha": 32.0})))
  assert workdir.identity_diff(plain, retuned) == []
  with_adapters = workdir.identity(from_config_dict(_config(**{"lora.rank": 4})))
  assert workdir.identity_diff(plain, with_adapters) == ["lora.rank: 0 -> 4"]
  assert workdir.identity_diff(with_adapters, workdir.identity(from_config_dict(
      _config(**{"lora.rank": 4, "lora.alpha": 32.0})))) == ["lora.alpha: 16.0 -> 32.0"]


def test_a_script_whose_run_cannot_start_leaves_nothing_behind(tmp_path):
  """run.train on a new workdir with bad data: build wrote init_model/ (and train identity.json) before the
  prompts failed. Those go again, so the corrected call is not refused as another run."""
  work = tmp_path / "w"
  with pytest.raises(ValueError, match="only 216 distinct prompts"):
    run_lib.train(from_config_dict(_config(**{"data.task.length": 3})), str(work), progress=False)
  assert not [p.name for p in work.iterdir() if p.name in workdir.RUN_FILES]
  workdir.check_workdir(from_config_dict(_config()), str(work))


@pytest.mark.parametrize("name", ["mux_spans.jsonl", "mux_summary.json"])
def test_a_groups_directory_is_no_workdir(tmp_path, name):
  """Before: train.py trained in a mux group's folder, and the group's own relaunch then refused it as a train.py
  run's ('holds a run of launchers/train.py, not a group')."""
  (tmp_path / name).write_text("")
  with pytest.raises(ValueError, match=f"--workdir {tmp_path} is a multiplexed group's directory \\(it holds {name}"):
    workdir.check_workdir(from_config_dict(_config()), str(tmp_path))
  assert [p.name for p in tmp_path.iterdir()] == [name]


def test_a_model_directory_is_no_workdir(tmp_path):
  """The model's own directory, or one holding a model's files or a config.json that is not a run's, is refused
  (a run writes config.json there; --fresh deletes it); a run's own config.json passes."""
  model = tmp_path / "m"
  model.mkdir()
  (model / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
  with pytest.raises(ValueError, match="is model.hf_dir"):
    workdir.check_not_a_model(from_config_dict(_config(**{"model.hf_dir": str(model)})), str(model))
  with pytest.raises(ValueError, match=r"holds config.json \(not a run's\)"):
    workdir.check_workdir(from_config_dict(_config()), str(model))
  (model / "model.safetensors").write_bytes(b"")
  with pytest.raises(ValueError, match="holds model.safetensors: a model directory"):
    workdir.check_workdir(from_config_dict(_config()), str(model))
  with pytest.raises(ValueError, match="is a file"):
    workdir.check_workdir(from_config_dict(_config()), str(model / "model.safetensors"))
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(_config().to_json(indent=2))
  workdir.check_workdir(from_config_dict(_config()), str(run))
  (run / "config.json").write_text('{"model": {')  # a torn run config is no model: --fresh can still mend it
  workdir.check_not_a_model(from_config_dict(_config()), str(run))


def test_a_checkpoint_past_run_steps_is_refused_before_anything_is_written(tmp_path):
  """Before: a relaunch with run.steps below the newest checkpoint built the run, evaluated, overwrote
  config.json, then failed with 'start_step must be in [0, total_steps=1], got 2'."""
  work = tmp_path / "w"
  _fake_run(work, _config())  # checkpoint 4
  with pytest.raises(ValueError, match=r"checkpoint at step 4, past run.steps=3: raise run.steps"):
    workdir.check_workdir(from_config_dict(_config(**{"run.steps": 3})), str(work))
  workdir.check_workdir(from_config_dict(_config(**{"run.steps": 4})), str(work))  # finished: resumes, trains none


def test_a_model_directory_is_named_as_the_caller_names_it(tmp_path):
  """run.train(cfg, workdir) on a model directory: the message said '--workdir', a flag a script has none of."""
  model = tmp_path / "m"
  model.mkdir()
  (model / "model.safetensors").write_bytes(b"")
  with pytest.raises(ValueError, match=rf"^workdir {re.escape(str(model))} holds model.safetensors: a model") as err:
    run_lib.train(from_config_dict(_config()), str(model), progress=False)
  assert "--workdir" not in str(err.value) and [p.name for p in model.iterdir()] == ["model.safetensors"]
  with pytest.raises(ValueError, match=rf"^--workdir {re.escape(str(model))} holds model.safetensors"):
    workdir.check_workdir(from_config_dict(_config()), str(model))  # train.py's flag


@pytest.mark.parametrize("topology, overrides, says", [
    (dict(mode="disaggregated", trainer={"fsdp": 8}, rollout={"data": 4}), {},
     "disaggregated topology needs 12 devices: trainer 8 + rollout 4; only 8 exist"),
    (dict(mode="colocated", trainer={"tensor": 3}, rollout={"tensor": 3}), {}, "does not divide over mesh axes tensor"),
    (None, {"rollout.max_new_tokens": 1000}, "data.max_prompt_len + rollout.max_new_tokens = 16 + 1000 = 1016 > the "
     "model's position limit 512 (max_position_embeddings): lower one of them"),
])
def test_a_script_whose_run_cannot_fit_writes_nothing(tmp_path, topology, overrides, says):
  """run.train with a topology the devices or the weights do not fit: before, identity.json was written first (the
  README promises these errors come before the workdir is touched). Prompt + response past the model's position
  limit: before, the run trained on positions past it (only launchers/train.py checked)."""
  c = _config(**overrides)
  if topology is not None:
    c.topology = topology
  work = tmp_path / "w"
  with pytest.raises(ValueError, match=re.escape(says)):
    run_lib.train(from_config_dict(c), str(work), progress=False)
  assert not work.exists()


def test_a_scripts_run_saves_its_config_for_export(tmp_path, monkeypatch):
  """run.train (the README's script path) writes config.json as the launcher did, before the build: before, only
  launchers/train.py saved it, and `export.export(workdir, out)` after a script's run failed with 'config.json not
  found: is ... a run directory of launchers/train.py?'. It reads back as the run's config, run.fresh=False."""
  from jaxrl_topo.runtime import experiment

  seen = {}

  def build(cfg, workdir, **kw):  # stands in for the (compiling) build: what is on disk by then
    seen["config"] = run_lib.load_config(workdir)
    raise RuntimeError("stop before compiling")

  monkeypatch.setattr(experiment, "build", build)
  cfg = from_config_dict(_config(**{"run.fresh": True, "lora.rank": 4, "model.overrides": {"n_layers": 3}}))
  with pytest.raises(RuntimeError, match="stop before compiling"):
    run_lib.train(cfg, str(tmp_path / "w"), progress=False)
  assert seen["config"] == dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, fresh=False))
  assert not (tmp_path / "w" / "config.json").exists()  # a run that never started leaves nothing behind
  # ... unless its folders hold another tool's files: the build's own error still comes out, and they stay
  (tmp_path / "v" / "checkpoints").mkdir(parents=True)
  (tmp_path / "v" / "checkpoints" / "theirs.pt").write_text("mine")
  with pytest.raises(RuntimeError, match="stop before compiling"):
    run_lib.train(cfg, str(tmp_path / "v"), progress=False)
  assert (tmp_path / "v" / "checkpoints" / "theirs.pt").read_text() == "mine"


def test_a_relaunch_whose_state_does_not_fit_the_checkpoint_keeps_the_runs_record(tmp_path, monkeypatch):
  """Before: a PPO-with-critic relaunch on a GRPO run's workdir (same model and data, so the same identity)
  replaced config.json, then failed restoring (the checkpoint has no value head); export and review then read
  the PPO config for GRPO checkpoints. Now a resumed run's record is replaced only after its checkpoint restored,
  and the error names what the launch changed against it."""
  import jax.numpy as jnp

  from jaxrl_topo.runtime import experiment
  from jaxrl_topo.runtime.checkpoint import Checkpointer

  work = tmp_path / "w"
  old = from_config_dict(_config(**{"run.steps": 8}))
  ckpt = Checkpointer(str(work / "checkpoints"))
  ckpt.save(4, {"params": {"w": jnp.zeros(2)}}, meta={"step": 4})
  ckpt.close()
  run_lib._record(old, str(work))
  before = {p: (work / p).read_bytes() for p in ("config.json", "identity.json")}

  class Fake:  # stands in for the (compiling) build: a state with a critic's leaf the checkpoint lacks
    state = {"params": {"w": jnp.zeros(2), "value_head": jnp.zeros(3)}}

    def close(self):
      pass

  monkeypatch.setattr(experiment, "build", lambda cfg, workdir, **kw: Fake())
  critic = from_config_dict(_config(**{"run.steps": 8, "rl.advantage": "gae", "rl.critic": "shared",
                                       "rl.group_size": 1}))
  with pytest.raises(ValueError, match=re.escape("checkpoints were saved under its config.json (kept as it was); "
                                                 "this launch changes rl.advantage: 'grpo' -> 'gae'; rl.critic: 'none'"
                                                 " -> 'shared'; rl.group_size: 16 -> 1. Relaunch")) as err:
    run_lib.train(critic, str(work), progress=False)
  assert "value_head" in str(err.value)  # the checkpoint's own complaint comes first
  assert {p: (work / p).read_bytes() for p in before} == before


def test_one_run_at_a_time_in_a_workdir(tmp_path):
  """A run holds <workdir>/run.lock (an flock) while it runs: another run there is refused, naming the process, and
  --fresh's check refuses to delete under it. Before: two launches on one workdir both ran, writing over each
  other's checkpoints and metrics. The kernel drops the lock with its process, a kill -9 included, so the file left
  behind never blocks a relaunch."""
  import signal
  import subprocess
  import sys

  from subproc import cpu_env

  work = tmp_path / "w"
  cfg = from_config_dict(_config())
  with workdir.held(str(work)):
    with pytest.raises(ValueError, match=re.escape(f"{work} is in use by another run (process {os.getpid()} holds")):
      run_lib.train(cfg, str(work), progress=False)
    with pytest.raises(ValueError, match="is in use by another run"):
      workdir.check_not_in_use(str(work))
  workdir.check_not_in_use(str(work))  # released
  code = ("import sys, time; from jaxrl_topo.runtime import workdir\n"
          "with workdir.held(sys.argv[1]):\n  print('held', flush=True); time.sleep(600)")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = subprocess.Popen([sys.executable, "-c", code, str(work)], stdout=subprocess.PIPE, text=True,
                       env=cpu_env(PYTHONPATH=root))
  try:
    assert p.stdout.readline().strip() == "held"
    with pytest.raises(ValueError, match=f"process {p.pid} holds"):
      workdir.check_not_in_use(str(work))
  finally:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
  with workdir.held(str(work)):  # the killed holder's file is still there; its lock is not
    assert (work / workdir.LOCK_FILE).read_text() == f"{os.getpid()}\n"


def test_a_folder_of_a_run_is_refused_as_a_workdir(tmp_path):
  """A workdir inside a run's own checkpoints/ (or tb/, init_model/) is refused: before, a run there wrote its
  config.json, metrics and checkpoints/ into the other run's orbax folder, whose --fresh then refused to delete
  them. A directory of one's own beside the run's files is fine."""
  work = tmp_path / "w"
  _fake_run(work, _config())
  cfg = from_config_dict(_config())
  for inside in ("checkpoints", "checkpoints/sub", "tb"):
    with pytest.raises(ValueError, match=re.escape(f"is inside the run {work}'s own {inside.split('/')[0]}/")):
      workdir.check_not_a_model(cfg, str(work / inside))
  workdir.check_not_a_model(cfg, str(work / "mine"))
  model = tmp_path / "model"  # a model directory (an HF config.json) with a checkpoints/ folder of its own
  (model / "checkpoints").mkdir(parents=True)
  (model / "config.json").write_text('{"model_type": "llama"}')
  workdir.check_not_a_model(cfg, str(model / "checkpoints" / "run"))  # before: "inside the run ...'s own"


def test_a_resume_names_what_its_config_changes(tmp_path):
  """run.train resuming a run under another config (e.g. configs/dapo.py on a GRPO run) warns with this list
  before config.json is replaced; before, it went on silently and the run's record changed under it."""
  run_lib._record(from_config_dict(_config()), str(tmp_path))
  changed = from_config_dict(_config(**{"rl.advantage": "dr_grpo", "run.steps": 400, "run.fresh": True}))
  assert run_lib.changed_keys(changed, str(tmp_path)) == [  # the schedule's length follows run.steps
      "optim.total_steps: 300 -> 400", "rl.advantage: 'grpo' -> 'dr_grpo'", "run.steps: 300 -> 400"]
  assert run_lib.changed_keys(changed, str(tmp_path / "none")) is None
