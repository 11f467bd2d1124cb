"""launchers/mux.py: job arguments (jaxrl_topo/mux/jobs.py) and a group run end to end with a failing job."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from subproc import cpu_env

from jaxrl_topo.cli import UserError
from jaxrl_topo.mux.jobs import check_job, mode_notice, parse_job, split_overrides
from jaxrl_topo.mux.report import read_spans
from jaxrl_topo.runtime.metrics import comparable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def test_common_overrides_are_split_from_the_flags():
  argv = ["mux.py", "--job=a.py", "--config.run.steps=3", "--workdir=/w", "--config.rl.group_size=8"]
  assert split_overrides(argv) == (["mux.py", "--job=a.py", "--workdir=/w"], ["run.steps=3", "rl.group_size=8"])
  with pytest.raises(UserError, match="key=value"):
    split_overrides(["--config.run.steps"])


def test_a_job_takes_the_common_overrides_then_its_own():
  jid, c = parse_job(f"{CONFIGS}/dapo.py:tiny,run.seed=3,run.steps=5", ["run.steps=2", "optim.lr=0.5"], 1)
  assert jid == "1-dapo"
  assert (c.run.seed, c.run.steps, c.optim.lr, c.reward.dynamic_sampling) == (3, 5, 0.5, True)
  jid, c = parse_job(f"{CONFIGS}/grpo_task.py:tiny", ["run.steps=2"], 0)
  assert (jid, c.run.seed, c.run.steps) == ("0-grpo_task", 0, 2)


def test_job_folders_the_group_does_not_run_are_named(tmp_path):
  """Jobs given in another order get other folders (<i>-<config>): the launcher refuses to leave any unused
  (test_a_runs_workdir_is_refused_as_a_groups runs it)."""
  from launchers.mux import other_job_folders

  for d in ("0-grpo_task", "1-dapo", "2-notes"):
    (tmp_path / d).mkdir()
  for d in ("0-grpo_task", "1-dapo"):
    (tmp_path / d / "config.json").write_text("{}")
  assert other_job_folders(str(tmp_path), ["0-dapo", "1-grpo_task"]) == ["0-grpo_task", "1-dapo"]
  assert other_job_folders(str(tmp_path), ["0-grpo_task", "1-dapo"]) == []
  assert other_job_folders(str(tmp_path / "new"), ["0-dapo"]) == []


def test_a_finished_job_keeps_the_figures_of_the_session_that_finished_it():
  """A relaunch with nothing left to train reports the last mux_summary.json's figures for the job, but only where
  that session trained it to its end: a group killed after the job's last checkpoint wrote no summary, and the one on
  disk is an older session's (before: its figures were taken as the finished run's)."""
  from launchers.mux import kept_results

  now = lambda: {"a": {"ok": True, "steps": 0, "resumed_from": 4, "wall_s": 1.0},  # noqa: E731
                 "b": {"ok": True, "steps": 2, "resumed_from": 2, "wall_s": 9.0}}
  whole = {"ok": True, "steps": 2, "resumed_from": 2, "wall_s": 50.0}  # steps 2-3 trained then: that run's end
  results = now()
  assert kept_results(results, {"a": whole, "b": whole}, {"a": 4, "b": 4}) == {"a"}
  assert results == {**now(), "a": {**whole, "resumed_from": 4}}  # b trained this session: its own figures
  for older in ({**whole, "steps": 1}, {**whole, "ok": False}):  # killed before step 4, or failed: not its figures
    results = now()
    assert kept_results(results, {"a": older}, {"a": 4, "b": 4}) == {"a"} and results == now()
  # Kept once (nothing to do at 4), then run.steps raised to 8 and that session killed before its summary: the kept
  # figures say they trained to 4, not 4 + 4
  kept = {**whole, "resumed_from": 4, "trained_to": 4}
  results = {"a": {"ok": True, "steps": 0, "resumed_from": 8}}
  assert kept_results(results, {"a": kept}, {"a": 8}) == {"a"} and results["a"]["steps"] == 0


def test_a_job_resumed_under_a_changed_config_is_noted(tmp_path):
  """As train.py warns on a resume that changes the config (before: mux.py went on with only 'resumed at step')."""
  from jaxrl_topo.mux.spec import JobSpec, on_policy
  from jaxrl_topo.runtime import run as run_lib
  from jaxrl_topo.runtime.config import config_from_file, from_config_dict
  from launchers.mux import changed_configs

  def spec(**overrides):
    c = config_from_file(os.path.join(CONFIGS, "grpo_task.py"), "tiny")
    c.update_from_flattened_dict(overrides)
    return JobSpec("0-grpo_task", on_policy(from_config_dict(c)), str(tmp_path / "0-grpo_task"))

  run_lib.save_config(run_lib.config_dict(spec().cfg), spec().workdir)
  assert changed_configs([spec(**{"rl.advantage": "rloo"})]) == []  # no checkpoint: a fresh start, nothing goes on
  (tmp_path / "0-grpo_task" / "checkpoints" / "2").mkdir(parents=True)
  assert changed_configs([spec()]) == []
  assert changed_configs([spec(**{"rl.advantage": "rloo"})]) == [
      "note: 0-grpo_task goes on from step 2 under a changed config (its config.json is replaced): rl.advantage: "
      "'grpo' -> 'rloo'"]


def test_a_ctrl_c_lets_the_checkpoint_being_written_commit():
  """Group.run on a Ctrl-C calls resume.finish_saves before it re-raises: a job thread inside resume.save commits its
  checkpoint first (before: the process ended under it, and the relaunch went on from the one before), and no
  new save starts after. Here with a checkpointer whose commit takes 0.3 s."""
  import threading
  import time
  from types import SimpleNamespace

  from jaxrl_topo.mux import resume
  from jaxrl_topo.mux.group import _Job

  class SlowCheckpointer:
    def __init__(self):
      self.entered, self.committed = threading.Event(), []

    def save(self, step, state, meta):
      self.entered.set()

    def wait(self):
      time.sleep(0.3)
      self.committed.append(True)

  run = SimpleNamespace(checkpoint_every=2, steps=4, seed=0)
  job = _Job(spec=SimpleNamespace(job_id="a", cfg=SimpleNamespace(run=run, topology=SimpleNamespace(
      mode="disaggregated"))))
  job.exp, job.ckpt = SimpleNamespace(state=None), SlowCheckpointer()
  saver = threading.Thread(target=resume.save, args=(job, 2, {}, None), daemon=True)
  saver.start()
  assert job.ckpt.entered.wait(10)
  resume.finish_saves([job])
  assert job.ckpt.committed == [True]
  assert not job.saving.acquire(blocking=False)  # held: a later save would wait for the process to end


def test_a_ctrl_c_while_the_jobs_run_waits_for_their_saves_then_stops_the_run(tmp_path, monkeypatch):
  """Group.run, interrupted (SIGINT's handler, as a Ctrl-C reaches it) while its job threads run: it calls
  resume.finish_saves before the KeyboardInterrupt leaves it (before: the process ended under a save in progress)."""
  import _thread
  import threading

  from jaxrl_topo.mux import resume
  from jaxrl_topo.mux.group import Group
  from jaxrl_topo.mux.spec import JobSpec, MuxConfig
  from jaxrl_topo.runtime.config import config_from_file, from_config_dict

  assert threading.current_thread() is threading.main_thread()  # where a signal handler can be set, as in mux.py
  cfg = from_config_dict(config_from_file(os.path.join(CONFIGS, "grpo_task.py"), "tiny"))
  group = Group([JobSpec("a", cfg, str(tmp_path / "a"))], MuxConfig(), str(tmp_path))
  group.built, group.jobs["a"].exp = True, object()  # nothing built: the job thread below stands in for its loop
  release = threading.Event()
  # The job's thread interrupts the main one, as a Ctrl-C would (through the group's SIGINT handler), then runs on.
  monkeypatch.setattr(group, "_run_job", lambda job, hooks: (_thread.interrupt_main(), release.wait(30)))
  waited = []
  monkeypatch.setattr(resume, "finish_saves", lambda jobs: waited.extend(j.spec.job_id for j in jobs))
  with pytest.raises(KeyboardInterrupt):
    group.run()
  release.set()
  group._spans_file.close()
  assert waited == ["a"] and group.interrupted.is_set()


def test_an_unknown_key_is_rejected_with_its_job_spec():
  with pytest.raises(UserError, match="rl.gruop_size"):
    parse_job(f"{CONFIGS}/grpo_task.py:tiny,rl.gruop_size=8", [], 0)


def test_a_jobs_bad_value_missing_file_or_override_field_is_one_clear_line():
  """Before: ml-collections' "Could not override field 'seed' (reference). abc is of original type <class 'str'> and
  cannot be casted ..."; a missing config file that named no job; a missing overrides field without train.py's hint."""
  with pytest.raises(UserError, match=r"^job 0-grpo_task: override 'run.seed=abc': 'abc' is not a valid int$"):
    parse_job(f"{CONFIGS}/grpo_task.py:tiny,run.seed=abc", [], 0)
  with pytest.raises(UserError, match=r"^job 1-nope \(--job=configs/nope.py:tiny\): no config file at configs/nope"):
    parse_job("configs/nope.py:tiny", [], 1)
  with pytest.raises(UserError, match="no config key 'n_layers'\nhint: model.overrides holds only.*--config.model"):
    parse_job(f"{CONFIGS}/grpo_task.py", ["model.overrides.n_layers=3"], 0)
  with pytest.raises(UserError, match=r"e.g. model.overrides=\{'n_layers': ...\} in the --job \(one field"):
    parse_job(f"{CONFIGS}/grpo_task.py,model.overrides.n_layers=3", [], 0)
  # A value with a comma, split at it (before: "'[q_proj' is not a valid tuple").
  with pytest.raises(UserError, match=r"^job 0-grpo_task: override 'lora.targets=\[q_proj': a job's own overrides are "
                     r"split at commas, so a value cannot hold one; give it to every job as --config.lora.targets="):
    parse_job(f"{CONFIGS}/grpo_task.py:tiny,lora.targets=[q_proj,v_proj]", [], 0)


def test_each_job_is_checked_before_anything_is_written(tmp_path):
  """A job with bad data, or whose workdir holds another run, is refused by its id before the launcher writes any
  job's files (it checks every job first); a good job passes and its workdir stays empty."""
  from jaxrl_topo.runtime import workdir

  _, good = parse_job(f"{CONFIGS}/grpo_task.py:tiny", [], 0)
  _, few = parse_job(f"{CONFIGS}/dapo.py:tiny,data.task.length=3", [], 1)
  with pytest.raises(UserError, match="^job 1-dapo: .*only 216 distinct prompts"):
    check_job("1-dapo", few, str(tmp_path / "1-dapo"))
  assert check_job("0-grpo_task", good, str(tmp_path / "0-grpo_task")).data.task.length == 4
  _, fresh = parse_job(f"{CONFIGS}/grpo_task.py:tiny", ["run.fresh=True"], 0)  # before: accepted, and ignored
  with pytest.raises(UserError, match="^job 0-grpo_task: run.fresh=True: a group does not start its jobs over"):
    check_job("0-grpo_task", fresh, str(tmp_path / "0-grpo_task"))
  assert not list(tmp_path.iterdir())
  other = tmp_path / "0-grpo_task"  # a relaunch on a workdir that ran a 3-layer model
  (other / "checkpoints" / "2").mkdir(parents=True)
  _, three = parse_job(f"{CONFIGS}/grpo_task.py:tiny,model.overrides={{'n_layers': 3}}", [], 0)
  workdir.write_identity(check_job("0-grpo_task", three, str(tmp_path / "fresh")), str(other))
  diff = r"model.overrides: \{'n_layers': 3\} -> \{\}"
  with pytest.raises(UserError, match=rf"^job 0-grpo_task: .*holds another run.*{diff}") as err:
    check_job("0-grpo_task", good, str(other))
  assert "--fresh" not in str(err.value)  # the mux launcher has no such flag


def test_the_launcher_writes_nothing_when_a_later_job_fails_its_checks(tmp_path):
  """The launcher as a user runs it: job 0 is good, job 1 has too few prompts; job 1 is named and nothing is
  written, not even job 0's config (before: job 0's config.json and identity.json were written first)."""
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "mux.py"), f"--job={CONFIGS}/grpo_task.py:tiny",
         f"--job={CONFIGS}/dapo.py:tiny,data.task.length=3", f"--workdir={tmp_path / 'group'}"]
  out = subprocess.run(cmd, env=cpu_env(2, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and "job 1-dapo: " in out.stderr and "only 216 distinct prompts" in out.stderr, out.stderr
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  assert not (tmp_path / "group").exists() or not any((tmp_path / "group").rglob("*")), list(tmp_path.rglob("*"))


def _launch(tmp_path, *args, devices=2):
  """The launcher as a user runs it, on `devices` CPU devices; its workdir is `tmp_path/group`."""
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "mux.py"), *args, f"--workdir={tmp_path / 'group'}"]
  return subprocess.run(cmd, env=cpu_env(devices, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)


def _refused(out, tmp_path, line: str) -> None:
  """A one-line user error (status 2, no traceback) and nothing written."""
  assert out.returncode == 2 and f"error: {line}\n" in out.stderr, out.stderr[-3000:]
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  assert not (tmp_path / "group").exists(), list(tmp_path.rglob("*"))


def test_too_few_devices_are_refused_with_the_xla_flags_hint_before_anything_is_written(tmp_path):
  """One CPU device, a group that runs each job disaggregated (1 + 1 devices): train.py's one line and hint (cli.
  device_hint), before any file is written (before: the job folder, mux_spans.jsonl and mux_summary.json were
  written, the ValueError traceback printed twice, then an orbax traceback at interpreter shutdown)."""
  out = _launch(tmp_path, f"--job={CONFIGS}/grpo_task.py:tiny", devices=1)
  _refused(out, tmp_path, "mux: job 0-grpo_task: disaggregated topology needs 2 devices: trainer 1 + rollout 1; "
           "only 1 exists")
  assert "hint: on a CPU" in out.stderr and "XLA_FLAGS=--xla_force_host_platform_device_count=2" in out.stderr
  assert len(out.stderr.strip().splitlines()) == 3, out.stderr  # the error, the hint, --traceback's line


def test_a_runs_workdir_is_refused_as_a_groups(tmp_path):
  """Before: mux.py wrote its job folder, mux_spans.jsonl, mux_summary.json and timeline beside a train.py run's
  own files."""
  group = tmp_path / "group"
  group.mkdir()
  (group / "identity.json").write_text("{}")
  out = _launch(tmp_path, f"--job={CONFIGS}/grpo_task.py:tiny")
  assert out.returncode == 2 and f"error: --workdir {group} holds a run of launchers/train.py, not a group" in (
      out.stderr), out.stderr[-3000:]
  assert [p.name for p in group.iterdir()] == ["identity.json"]
  (group / "identity.json").unlink()
  (group / "config.json").write_text('{"model_type": "llama"}')  # a model's (before: called a train.py run's)
  out = _launch(tmp_path, f"--job={CONFIGS}/grpo_task.py:tiny")
  assert out.returncode == 2 and f"error: --workdir {group} holds config.json (not a run's): a model directory" in (
      out.stderr), out.stderr[-3000:]
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "mux.py"), f"--plan={tmp_path / 'no.jsonl'}"],
                       env=cpu_env(1, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
  assert out.returncode == 2 and f"error: --plan={tmp_path / 'no.jsonl'}: no such file" in out.stderr, out.stderr
  # A group that leaves out (or reorders) the jobs its folder holds. Before: a note, then mux_spans.jsonl and
  # mux_summary.json were rewritten without the other jobs.
  (group / "config.json").unlink()
  (group / "1-dapo").mkdir()
  (group / "1-dapo" / "config.json").write_text("{}")
  out = _launch(tmp_path, f"--job={CONFIGS}/grpo_task.py:tiny")
  assert out.returncode == 2 and f"error: --workdir {group} holds jobs this group does not run: 1-dapo. " in (
      out.stderr), out.stderr[-3000:]
  assert sorted(p.name for p in group.rglob("*")) == ["1-dapo", "config.json"]
  # A file where the group's folder would be (before: "File exists", from the lock, after every job's checks);
  # a --config.key without a value exits 2 as the other usage errors do (before: 1).
  shutil.rmtree(group)
  group.write_text("")
  for workdir, says in ((group, f"--workdir {group} is a file: name a directory (made if missing)"),
                        (group / "sub", f"--workdir={group / 'sub'}: {group} is a file, not a directory")):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "mux.py"), f"--job={CONFIGS}/grpo_task.py",
                          f"--workdir={workdir}"], env=cpu_env(1, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and f"error: {says}\n" in out.stderr, out.stderr
  out = _launch(tmp_path, "--config.topology.mode", f"--job={CONFIGS}/grpo_task.py:tiny")
  assert (out.returncode, out.stderr) == (2, "error: --config.topology.mode: write --config.key=value\n")


@pytest.mark.parametrize("holder", ["group", "group/0-grpo_task"])
def test_a_group_or_job_folder_in_use_is_refused(holder, tmp_path):
  """Another process holds run.lock in the group's folder (a second mux.py) or in a job's (a train.py run on it):
  refused, naming the holder, before anything is built. Before, both wrote the same checkpoints and metrics."""
  from jaxrl_topo.runtime.workdir import held

  with held(str(tmp_path / holder)):
    out = _launch(tmp_path, f"--job={CONFIGS}/grpo_task.py:tiny")
  assert out.returncode == 2 and f"is in use by another run (process {os.getpid()} holds run.lock)" in out.stderr, (
      out.stderr[-3000:])
  assert "Traceback" not in out.stderr and not list((tmp_path / "group").rglob("*.json")), list(tmp_path.rglob("*"))


def test_jobs_that_carve_different_pools_are_refused_before_anything_is_written(tmp_path):
  out = _launch(tmp_path, f"--job={CONFIGS}/grpo_task.py:tiny",
                f"--job={CONFIGS}/grpo_task.py:tiny,topology.mode=disaggregated,topology.rollout.data=2", devices=4)
  _refused(out, tmp_path, "mux: job 1-grpo_task uses pools {'train': [0], 'rollout': [1, 2]}, job 0-grpo_task "
           "{'train': [0], 'rollout': [1]}: every job of a group needs the same topology (set --config.topology.* "
           "for all jobs)")


def test_a_job_that_fails_its_build_is_reported_once_and_its_checkpointer_closed(tmp_path):
  """A failure only the build finds (a reward model with the warm-up's accuracy target: experiment.build refuses
  it): its traceback once (the group was built twice when every job failed), and no orbax 'cannot schedule new
  futures after interpreter shutdown' traceback (its Checkpointer was left open). (Until the meshes were checked
  before anything is written, a rollout mesh that does not divide the vocabulary was this failure.)"""
  from jaxrl_topo.models.presets import get_preset
  from jaxrl_topo.rl.reward_model import write_reward_model

  write_reward_model(str(tmp_path / "rm"), get_preset("tiny"))  # a missing one is refused before anything runs
  out = _launch(tmp_path / "g", f"--job={CONFIGS}/grpo_task.py:tiny", "--config.reward.fn=model",
                f"--config.reward.model_dir={tmp_path / 'rm'}")
  assert out.returncode == 2 and out.stderr.rstrip().endswith(
      "error: every job failed\n(run with --traceback to see where it was raised)"), out.stderr[-3000:]
  assert out.stderr.count("mux: job 0-grpo_task failed") == 1, out.stderr
  assert "cannot schedule new futures" not in out.stderr and "run.sft_target_accuracy stops" in out.stdout


def test_meshes_the_model_does_not_divide_over_are_refused_before_anything_is_written(tmp_path):
  """Group.admit (the launcher's last check before it writes job folders) now checks each job's model and batch
  against its meshes (preflight.check_shapes). Before: the job folders, config.json and identity.json were
  written, then the job failed its build (a rollout mesh of tensor=3 does not divide the vocabulary)."""
  from jaxrl_topo.mux.group import Group
  from jaxrl_topo.mux.spec import JobSpec, MuxConfig

  _, c = parse_job(f"{CONFIGS}/grpo_task.py:tiny", ["topology.mode='disaggregated'", "topology.rollout.tensor=3"], 0)
  spec = JobSpec("0-grpo_task", check_job("0-grpo_task", c, str(tmp_path / "group" / "0-grpo_task")),
                 str(tmp_path / "group" / "0-grpo_task"))
  with pytest.raises(ValueError, match=re.escape(
      "mux: job 0-grpo_task: role 'rollout' (rollout mesh {'data': 1, 'tensor': 3}): ['embed_tokens']: dim 0 "
      "(vocab=128) does not divide over mesh axes tensor (3 ways)")):
    Group([spec], MuxConfig(), str(tmp_path / "group"), checkpoints=True).admit()
  assert not list(tmp_path.iterdir())


def test_a_job_is_refused_in_words_of_its_own(tmp_path):
  """A job's folder that is a model directory was called '--workdir' (the group's flag, a different path); a
  job's LoRA targets naming no projection were found after its warm-up."""
  model = tmp_path / "0-grpo_task"
  model.mkdir()
  (model / "model.safetensors").write_bytes(b"")
  _, c = parse_job(f"{CONFIGS}/grpo_task.py:tiny", [], 0)
  with pytest.raises(UserError, match=rf"^job 0-grpo_task: its folder {re.escape(str(model))} holds model") as err:
    check_job("0-grpo_task", c, str(model))
  assert "--workdir" not in str(err.value)
  _, c = parse_job(f"{CONFIGS}/grpo_task.py:tiny", ["lora.rank=8", "lora.targets=('qproj',)"], 0)
  with pytest.raises(UserError, match=r"^job 0-grpo_task: lora.targets \('qproj',\): 'qproj' names no projection"):
    check_job("0-grpo_task", c, str(tmp_path / "x"))
  _, c = parse_job(f"{CONFIGS}/grpo_task.py:tiny", ["rollout.max_new_tokens=600"], 0)  # the build found it
  with pytest.raises(UserError, match=r"^job 0-grpo_task: .* = \d+ > the model's position limit 512"):
    check_job("0-grpo_task", c, str(tmp_path / "x"))
  assert [p.name for p in tmp_path.iterdir()] == ["0-grpo_task"]
  # Checked as the group runs it, disaggregated: a trainer mesh of its own is no colocated-mode error (before:
  # "colocated mode time-shares one device set"), and the config given is left as it was.
  _, c = parse_job(f"{CONFIGS}/grpo_task.py:tiny", ["topology.trainer.fsdp=2"], 0)
  assert check_job("0-grpo_task", c, str(tmp_path / "x")).topology.mode == "disaggregated"
  assert c.topology.mode == "colocated"


def test_an_async_job_is_run_disaggregated_with_a_note(tmp_path):
  """The group runs every job disaggregated and on-policy (README); a job that asked for async says so in a
  line of its own (before: silently). Job 1 then fails its checks: nothing is written."""
  out = _launch(tmp_path, f"--job={CONFIGS}/grpo_task.py:tiny,topology.mode=async",
                f"--job={CONFIGS}/dapo.py:tiny,data.task.length=3")
  assert ("note: job 0-grpo_task: topology.mode=async runs disaggregated in a mux group, strictly on-policy "
          "(run.max_staleness=1 -> 0)\n") in out.stderr, out.stderr
  _refused(out, tmp_path, "job 1-dapo: " + out.stderr.split("error: job 1-dapo: ", 1)[-1].split("\n", 1)[0])
  assert "only 216 distinct prompts" in out.stderr
  _, c = parse_job(f"{CONFIGS}/grpo_task.py:tiny", [], 0)
  assert mode_notice("0-grpo_task", check_job("0-grpo_task", c, str(tmp_path / "x"))) is None  # colocated: quiet


def test_a_misspelt_key_is_named_with_the_nearest_one_as_train_py_does(tmp_path):
  """`--config.run.stpes=3` or a job's `,run.stpes=3`: train.py's words, not ml-collections' repr of the section
  (FieldReference addresses and all)."""
  hint = "no config key 'stpes'. Did you mean \"steps\" instead of \"stpes\"?"
  out = _launch(tmp_path, f"--job={CONFIGS}/grpo_task.py:tiny", "--config.run.stpes=3")
  _refused(out, tmp_path, f"--config.run.stpes=3: {hint}")
  out = _launch(tmp_path, f"--job={CONFIGS}/grpo_task.py:tiny", f"--job={CONFIGS}/dapo.py:tiny,run.stpes=3")
  _refused(out, tmp_path, f"job 1-dapo: override 'run.stpes=3': {hint}")
  assert "FieldReference" not in out.stderr


@pytest.mark.slow
def test_launcher_runs_a_group_and_isolates_a_failing_job(tmp_path):
  common = {"run.steps": 3, "run.sft_steps": 5, "run.sft_target_accuracy": 0.0, "data.batch_size": 4,
            "rl.group_size": 4, "rollout.n_slots": 16, "run.eval_every": 0, "reward.n_workers": 0,
            "run.tensorboard": False}
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "mux.py"), f"--job={CONFIGS}/grpo_task.py:tiny",
         # One sampling round a step: the breaker (3 failing scoring calls in a row) stops job 1 at its step 2, after
         # two steps in the timeline (with DAPO's 4 rounds of all-error scores it stops within step 0's rollout).
         f"--job={CONFIGS}/dapo.py:tiny,run.seed=3,reward.fn=reward_fns_for_tests:raises,reward.max_sampling_rounds=1",
         f"--workdir={tmp_path}", *[f"--config.{k}={v}" for k, v in common.items()]]
  env = cpu_env(2, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))  # this checkout's package
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  failed = "error: 1 of 2 jobs failed (1-dapo); the others finished."  # status 1 (before: 0, unseen by a script)
  assert out.returncode == 1 and failed in out.stderr, out.stderr[-3000:]
  assert "0-grpo_task: 3 steps" in out.stdout and "1-dapo: FAILED" in out.stdout, out.stdout
  # Progress while the group runs (before: nothing between the builds and the summary).
  assert all(f"mux: 0-grpo_task step {k}/3, reward " in out.stderr for k in (1, 2, 3)), out.stderr[-3000:]
  with open(tmp_path / "mux_summary.json") as f:
    summary = json.load(f)
  assert summary["jobs"]["0-grpo_task"]["ok"] and "boom" in summary["jobs"]["1-dapo"]["error"]
  assert 0 < summary["busy_fraction"]["train"] <= 1 and 0 < summary["busy_fraction"]["rollout"] <= 1
  with open(tmp_path / "0-grpo_task" / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [0, 1, 2]
  with open(tmp_path / "0-grpo_task" / "config.json") as f:  # the job as it ran (before: the config's colocated)
    saved = json.load(f)
  assert (saved["topology"]["mode"], saved["run"]["max_staleness"]) == ("disaggregated", 0)
  # Exported in a one-device process: the trainer's mesh alone (a disaggregated carve would need both devices).
  export = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "export.py"),
                           f"--workdir={tmp_path / '0-grpo_task'}", f"--out={tmp_path / 'hf'}"],
                          env=cpu_env(1, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
  assert export.returncode == 0 and (tmp_path / "hf" / "exported_from.json").is_file(), export.stderr[-3000:]
  spans = read_spans(str(tmp_path / "mux_spans.jsonl"))
  assert {s["job"] for s in spans} == {"0-grpo_task", "1-dapo"}
  first = min((s for s in spans if s["job"] == "0-grpo_task" and s["pool"] == "train"), key=lambda s: s["step"])
  assert first["compile_s"] > 0  # the launcher's CompileLog reaches the group's spans
  assert (tmp_path / "mux_timeline.png").stat().st_size > 0
  # The same command again: the finished job keeps its figures (before: mux_summary.json said 0 steps, this
  # session's wall time); the failed one runs again (and fails again). Its last line dropped, as a kill after the
  # last checkpoint would leave the file: the job logs it again from that checkpoint, as it was.
  lines = (tmp_path / "0-grpo_task" / "metrics.jsonl").read_text().splitlines(keepends=True)
  (tmp_path / "0-grpo_task" / "metrics.jsonl").write_text("".join(lines[:-1]))
  again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  relogged = (tmp_path / "0-grpo_task" / "metrics.jsonl").read_text().splitlines(keepends=True)
  assert comparable(map(json.loads, relogged)) == comparable(map(json.loads, lines)), relogged
  assert again.returncode == 1 and "0-grpo_task: already trained to step 3; nothing to do" in again.stdout, (
      again.stdout + again.stderr[-3000:])
  with open(tmp_path / "mux_summary.json") as f:
    kept = json.load(f)["jobs"]["0-grpo_task"]
  assert kept == {**summary["jobs"]["0-grpo_task"], "resumed_from": 3}
