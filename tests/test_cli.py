"""What a user sees when things go wrong: launchers through subprocess, as a user runs them.

A failure in one process of a multi-process run ends every process promptly with the first error
shown; user-facing errors are one line without a traceback (`--traceback` shows it)."""

import os
import re
import subprocess
import sys

import pytest
from run_fixtures import load_config
from subproc import cpu_env

from launchers import local_multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(ROOT, "tests", "mp_failing_child.py")


def _env(**extra) -> dict:
  return cpu_env(PYTHONPATH=ROOT, **extra)  # one device


def test_local_multiprocess_stops_the_others_when_one_fails(capfd):
  """Process 1 exits 3 at once; process 0 would sleep 10 minutes. Before: the launcher waited on
  process 0 first, so it ran into the timeout (124)."""
  code = "import os, sys, time; sys.exit(3) if os.environ['JAXRL_PROCESS_ID'] == '1' else time.sleep(600)"
  rc = local_multiprocess.run([sys.executable, "-c", code], num_processes=2, devices_per_process=1, timeout_s=60)
  err = capfd.readouterr().err
  assert rc == 3, err
  assert "process 1 failed (exit code 3); stopped process 0" in err


def test_a_failing_process_ends_the_run_with_its_error(capfd, monkeypatch):
  """Under jax.distributed, process 1 raises; process 0 waits at a barrier. Before: process 1 hung in
  jax.distributed's shutdown barrier, so nothing ever exited (the launcher timed out)."""
  monkeypatch.setenv("PYTHONPATH", ROOT)
  rc = local_multiprocess.run([sys.executable, CHILD, "--mode=fail"], num_processes=2, devices_per_process=1,
                              timeout_s=120)
  out, err = capfd.readouterr()
  assert rc == 2, out + err
  assert "error: [process 1] process 1 gives up on purpose" in out
  assert "Traceback" not in out


def test_local_multiprocess_passes_bytes_that_are_not_utf8(capfd):
  """Before: the output thread died on the byte, nothing drained the pipe, and the child blocked until the timeout."""
  child = ("import sys; sys.stdout.buffer.write(b'caf\\xe9\\n'); sys.stdout.flush(); "
           "[print('x' * 100) for _ in range(3000)]")
  rc = local_multiprocess.run([sys.executable, "-c", child], num_processes=1, devices_per_process=1, timeout_s=60)
  out = capfd.readouterr().out
  assert rc == 0 and "caf\ufffd" in out and out.count("x" * 100) == 3000


def test_local_multiprocess_runs_python_as_itself_and_hints_its_own_device_flag(monkeypatch):
  assert local_multiprocess.with_this_python(["python", "x.py", "python"]) == [sys.executable, "x.py", "python"]
  assert local_multiprocess.with_this_python(["bash", "-c", "python x.py"]) == ["bash", "-c", "python x.py"]
  import jax  # noqa: F401  (device_hint speaks only once JAX is loaded)

  from jaxrl_topo.cli import device_hint
  msg = "disaggregated topology needs 8 devices (trainer 4 + rollout 4); only 4 exist"
  assert "xla_force_host_platform_device_count=8" in device_hint(msg)
  monkeypatch.setenv("JAXRL_NUM_PROCESSES", "2")  # what local_multiprocess gives its children
  assert device_hint(msg) == "\nhint: give local_multiprocess.py --devices_per_process=4 (or more)"


def test_a_missing_override_field_hints_at_giving_the_whole_dict():
  """--config.model.overrides.n_layers=3 on a config whose overrides lack n_layers: ml-collections adds no key, and
  the error named neither the section nor the way that works (the whole dict, which a run takes)."""
  from jaxrl_topo.cli import overrides_hint

  argv = ["train.py", "--config=configs/grpo_task.py", "--config.model.overrides.n_layers=3"]
  hint = overrides_hint("no config key 'n_layers'", argv)
  assert hint.startswith("\nhint: model.overrides holds only")
  assert "--config.model.overrides=\"{'n_layers': ...}\"" in hint
  assert overrides_hint("no config key 'stepz'. Did you mean \"steps\"", [*argv, "--config.run.stepz=1"]) == ""
  assert overrides_hint("no config key 'n_layers'", argv[:2]) == ""
  # A key of another section (a new user's trial): "no config key 'lr'" said nothing of where lr lives.
  assert overrides_hint("no config key 'lr'", ["train.py", "--config.run.lr=1e-3"]) == (
      "\nhint: lr is a key of optim: --config.optim.lr")
  assert overrides_hint("no config key 'group_size'", ["--config.optim.group_size=4"]) == (
      "\nhint: group_size is a key of rl: --config.rl.group_size")
  assert overrides_hint("no config key 'lr'", ["--config.optim.lr=1"]) == ""  # its own section: no hint


def test_warm_up_dev_accuracy_on_every_process(capfd, monkeypatch, tmp_path):
  """The warm-up's accuracy check with params held by process 0 only (async / disaggregated across
  processes) and spanning both. Before: process 1 failed reading arrays it does not hold."""
  from jaxrl_topo.models.fresh import write_fresh_model
  from jaxrl_topo.models.presets import get_preset

  write_fresh_model(str(tmp_path / "m"), get_preset("tiny"), seed=0)
  monkeypatch.setenv("PYTHONPATH", ROOT)
  rc = local_multiprocess.run([sys.executable, CHILD, "--mode=dev_accuracy", f"--model_dir={tmp_path / 'm'}"],
                              num_processes=2,
                              devices_per_process=2, timeout_s=300)
  out = capfd.readouterr().out
  assert rc == 0, out[-4000:]
  rows = [line.split() for line in out.splitlines() if "DEV-ACCURACY" in line]
  got = {(r[0], r[2]): r[3] for r in rows}
  assert set(got) == {(p, n) for p in ("[p0]", "[p1]") for n in ("one_holder", "spanning")}, out[-3000:]
  assert got[("[p0]", "one_holder")] == got[("[p1]", "one_holder")] == got[("[p0]", "spanning")]


# ---------------------------------------------------------------- launchers/train.py's user-facing errors

TRAIN = os.path.join(ROOT, "launchers", "train.py")
TINY = f"--config={os.path.join(ROOT, 'configs', 'grpo_task.py')}:tiny"


def _train(*args, cwd=ROOT, timeout=120, devices=1) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                        env=cpu_env(devices, PYTHONPATH=ROOT))


def test_missing_config_is_a_usage_error(tmp_path):
  """Before: TypeError: 'NoneType' object is not iterable, with a traceback."""
  r = _train(f"--workdir={tmp_path / 'w'}")
  assert r.returncode != 0 and "--config is required" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_config_typo_is_one_plain_line(tmp_path):
  """Before: three chained tracebacks ending in an escaped repr ('\\'group_sze\\'\\nDid you mean...')."""
  r = _train(TINY, f"--workdir={tmp_path / 'w'}", "--config.rl.group_sze=3")
  assert r.returncode == 2, r.stderr
  assert "error: no config key 'group_sze'. Did you mean \"group_size\"" in r.stderr, r.stderr
  assert "Traceback" not in r.stderr and "\\n" not in r.stderr


def test_a_bad_config_argument_is_one_line(tmp_path):
  """The config file's get_config refusing its argument. Before: 'FATAL Flags parsing error' over ml-collections'
  whole traceback."""
  r = _train("--config=configs/grpo_task.py:tinny", f"--workdir={tmp_path / 'w'}")
  assert r.returncode == 2 and "Traceback" not in r.stderr and "FATAL" not in r.stderr, r.stderr
  assert r.stderr.startswith("error: --config=configs/grpo_task.py:tinny: ValueError: unknown preset 'tinny'")


def test_a_value_of_the_wrong_type_is_one_line(tmp_path):
  """Before: 'FATAL Flags parsing error: The flag 'config.run.steps' is defined twice', status 1: absl parsed the
  flags a second time to report the error, and ml-collections' override flags then clashed, hiding it."""
  r = _train(TINY, f"--workdir={tmp_path / 'w'}", "--config.run.sft_steps=5", "--config.run.steps=abc")
  assert r.returncode == 2 and "Traceback" not in r.stderr and "defined twice" not in r.stderr, r.stderr
  assert r.stderr.startswith("error: flag --config.run.steps=abc: invalid literal for int()"), r.stderr
  assert not (tmp_path / "w").exists()


def test_a_second_config_file_or_workdir_is_refused(tmp_path):
  """Before: absl kept the last --config, so `--config=grpo_task.py --config=dapo.py` trained DAPO without a word
  (and with an override after each, failed as "flag defined twice"); a second --workdir was taken as silently."""
  r = _train(TINY, "--config", "configs/dapo.py", f"--workdir={tmp_path / 'w'}")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert r.stderr.startswith(f"error: --config given 2 times ({TINY.split('=', 1)[1]}, configs/dapo.py): "), r.stderr
  assert not (tmp_path / "w").exists()
  r = _train(TINY, f"--workdir={tmp_path / 'a'}", "--workdir", str(tmp_path / "b"))  # before: b, without a word
  assert r.returncode == 2 and r.stderr.startswith(f"error: --workdir given 2 times ({tmp_path / 'a'}, "), r.stderr
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_model_directory_is_refused_as_a_workdir_untouched(tmp_path):
  """Before: the launch overwrote the model's config.json with the run's (and --fresh, or a launch that then
  failed, deleted it), leaving a model that no longer loads."""
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text('{"model_type": "llama"}')
  (model / "tokenizer.json").write_text("{}")
  for extra in ((), ("--fresh",)):
    r = _train(TINY, f"--workdir={model}", *extra)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "holds tokenizer.json: a model directory" in r.stderr, r.stderr
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "tokenizer.json"]
    assert (model / "config.json").read_text() == '{"model_type": "llama"}'


def test_fresh_refuses_a_checkpoints_folder_that_is_not_a_runs(tmp_path):
  """--fresh removes checkpoints/ whole: a folder holding another tool's checkpoints is refused, untouched."""
  (tmp_path / "w" / "checkpoints").mkdir(parents=True)
  (tmp_path / "w" / "checkpoints" / "model_epoch3.pt").write_text("mine")
  r = _train(TINY, f"--workdir={tmp_path / 'w'}", "--fresh")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert "holds checkpoints/model_epoch3.pt, which no run writes" in r.stderr, r.stderr
  assert [p.name for p in (tmp_path / "w").iterdir()] == ["checkpoints"]
  assert (tmp_path / "w" / "checkpoints" / "model_epoch3.pt").read_text() == "mine"


@pytest.mark.parametrize("script,args,says", [
    ("review.py", ["--n_devices=0"], "error: flag --n_devices=0: must be > 0"),  # before: accepted (-4 refused)
    ("review.py", ["--device_memory_gb=-3"], "error: flag --device_memory_gb=-3.0: must be > 0"),
    ("sync_check.py", ["--versions=0"], "error: flag --versions=0: 0 is not a positive integer"),  # checked nothing
    ("sync_check.py", ["--trainer=fsdp=1,fsdp=1"], "error: --trainer=fsdp=1,fsdp=1: an axis is named twice"),
    # before: absl's usage text (every flag) with the message last and no error: prefix
    ("sync_check.py", ["--rollout=data:2"], "error: --rollout=data:2: expected name=size[,name=size]"),
    # before: every flag's help (about 30 lines), then the message, status 1
    ("local_multiprocess.py", ["--num_processes=0", "--", "python", "-c", "1"], "error: --num_processes=0"),
    # before: "No such file or directory: ''", after the launch's checks and jax's start-up
    ("export.py", ["--workdir=", "--out=/nonexistent/hf"], "error: --workdir is empty: name a path"),
    ("review.py", ["--out= "], "error: --out is empty: name a path"),
])
def test_other_launchers_refuse_out_of_range_flags(tmp_path, script, args, says):
  out = tmp_path / "rv"
  review = [f"--out={out}", "--config=configs/grpo_task.py:tiny"] if script == "review.py" else []
  review = [r for r in review if r.split("=")[0] not in {a.split("=")[0] for a in args}]  # one --out: a 2nd is refused
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", script), *review, *args],
                     capture_output=True, text=True, cwd=ROOT, timeout=120, env=_env())
  assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert not any(line.lstrip().startswith("--") for line in r.stderr.splitlines()), r.stderr[-3000:]  # no flag help
  assert not out.exists()


@pytest.mark.parametrize("script,flag,own", [("train.py", "--help", "--coordinator"),
                                             ("generate.py", "-?", "--kv_dtype")])
def test_help_exits_0_and_lists_the_launchers_own_flags(script, flag, own):
  """Before: absl's --help printed the flags and exited 1, as if the launcher had failed (a script checking
  `train.py --help` saw an error). The flags cli.py defines for a launcher are listed as the launcher's."""
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", script), flag], capture_output=True, text=True,
                     cwd=ROOT, timeout=120, env=_env())
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"{script}:" in r.stdout and own in r.stdout.split(f"{script}:", 1)[1], r.stdout[-3000:]


def test_a_config_key_set_to_none_on_the_command_line(tmp_path):
  """`--config.rl.is_cap=None` switches the importance weight off. Before: "could not convert string to float:
  'None'" (ml-collections parses an override by the key's type), so no key with a number as its default could be
  set to None from the command line. A key that may not be None still says so."""
  review = [sys.executable, os.path.join(ROOT, "launchers", "review.py"), "--config=configs/grpo_task.py:tiny"]
  r = subprocess.run([*review, "--config.rl.is_cap=None", f"--out={tmp_path / 'rv'}"], capture_output=True, text=True,
                     cwd=ROOT, timeout=120, env=_env())
  assert r.returncode == 0, r.stderr[-3000:]
  assert "not corrected (rl.is_cap is None)" in (tmp_path / "rv" / "record.md").read_text()
  r = subprocess.run([*review, "--config.run.steps=none", f"--out={tmp_path / 'rv2'}"], capture_output=True, text=True,
                     cwd=ROOT, timeout=120, env=_env())
  assert r.returncode == 2 and "run.steps must be int, got NoneType None" in r.stderr, r.stderr[-3000:]


def test_a_review_with_nothing_to_review_and_a_missing_config_file_are_one_line(tmp_path):
  """Before: absl's usage text (every flag) above the message, status 1; and ml-collections' four lines about
  its own flag "config_config" for a config file that is not there."""
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "review.py"), f"--out={tmp_path / 'rv'}"],
                     capture_output=True, text=True, cwd=ROOT, timeout=120, env=_env())
  assert r.returncode == 2 and r.stderr.startswith("error: give --config, or --workdir"), r.stderr[-3000:]
  r = _train("--config=configs/nope.py:tiny", f"--workdir={tmp_path / 'w'}")
  assert r.returncode == 2 and r.stderr.startswith(
      "error: --config: [Errno 2] No such file or directory: 'configs/nope.py'"), r.stderr[-3000:]
  assert len(r.stderr.splitlines()) == 2 and not (tmp_path / "w").exists()


def test_an_environment_that_does_not_import_is_refused_before_the_workdir_is_made(tmp_path):
  """Before: "reward 'no_such_env:Env': ...", after the workdir was made and the model built."""
  r = _train(f"--config={os.path.join(ROOT, 'configs', 'tool_calc.py')}", f"--workdir={tmp_path / 'w'}",
             "--config.env.fn=no_such_env:Env")
  assert r.returncode == 2 and "error: env.fn 'no_such_env:Env': no module named 'no_such_env'" in r.stderr, r.stderr
  assert not (tmp_path / "w").exists()


def test_invalid_value_without_then_with_traceback(tmp_path):
  r = _train(TINY, f"--workdir={tmp_path / 'w'}", "--config.rl.group_size=1")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert "error: " in r.stderr and "group_size must be >= 2" in r.stderr and "--traceback" in r.stderr
  r = _train(TINY, f"--workdir={tmp_path / 'w'}", "--config.rl.group_size=1", "--traceback")
  assert r.returncode == 2 and "Traceback (most recent call last)" in r.stderr, r.stderr
  assert not (tmp_path / "w").exists(), "nothing is written for a config that does not validate"


def test_missing_model_dir_is_named_and_the_workdir_is_not_made(tmp_path):
  """Before: the FileNotFoundError came after the workdir and its checkpoints/ were made, followed by an
  unrelated orbax traceback."""
  r = _train(TINY, f"--workdir={tmp_path / 'w'}", f"--config.model.hf_dir={tmp_path / 'nope'}")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert f"model.hf_dir='{tmp_path / 'nope'}': no config.json" in r.stderr
  # A user who set model.preset beside a config's hf_dir (a new user's trial) learns how to switch it off.
  assert "--config.model.hf_dir=None trains model.preset 'tiny' from random weights instead" in r.stderr, r.stderr
  assert not (tmp_path / "w").exists()


def test_prompt_plus_response_over_the_position_limit(tmp_path):
  """Before: nothing checked it (the tiny preset's limit is 512 positions)."""
  r = _train(TINY, f"--workdir={tmp_path / 'w'}", "--config.data.max_prompt_len=500",
             "--config.rollout.max_new_tokens=100")
  assert r.returncode == 2 and "= 600 > the model's position limit 512" in r.stderr, r.stderr


def test_a_workdir_of_another_run_is_refused_untouched(tmp_path):
  """A changed identity key (here the preset's init seed) is named and config.json is left as it was.
  Before: config.json was overwritten first and the old checkpoint silently resumed under the new config."""
  from jaxrl_topo.runtime.config import config_from_file

  work = tmp_path / "w"
  (work / "checkpoints" / "4").mkdir(parents=True)  # a run of the tiny preset with seed 0 saved step 4
  old = config_from_file(os.path.join(ROOT, "configs", "grpo_task.py"), "tiny").to_json(indent=2)
  (work / "config.json").write_text(old)
  r = _train(TINY, f"--workdir={work}", "--config.model.init_seed=7")
  assert r.returncode == 2, r.stderr[-3000:]
  assert "holds another run" in r.stderr and "model.init_seed: 0 -> 7" in r.stderr and "--fresh" in r.stderr
  assert (work / "config.json").read_text() == old and (work / "checkpoints" / "4").is_dir()
  # --fresh deletes the old run only once the launch's checks have passed. Before: this launch (an async
  # topology on one CPU device) removed checkpoints and config.json, then failed its device check.
  r = _train(TINY, f"--workdir={work}", "--config.model.init_seed=7", "--fresh", "--config.topology.mode=async")
  assert r.returncode == 2 and "removed" not in r.stdout, r.stdout + r.stderr[-3000:]
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=2" in r.stderr, r.stderr[-3000:]
  assert (work / "config.json").read_text() == old and (work / "checkpoints" / "4").is_dir()


def test_bad_data_fails_before_the_workdir_is_made(tmp_path):
  """Before: 'only 216 distinct prompts' came from inside the run, after config.json, init_model/ and
  checkpoints/ were written, and the corrected relaunch was then refused as another run."""
  r = _train(TINY, f"--workdir={tmp_path / 'w'}", "--config.data.task.length=3")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert "Task 'reversal' has only 216 distinct prompts" in r.stderr and not (tmp_path / "w").exists()


@pytest.mark.slow
def test_a_reward_that_always_fails_stops_the_run_with_its_checkpoints(tmp_path):
  """The circuit breaker through the launcher: reward.max_error_steps=3 consecutive scoring calls
  (the evaluation before RL, steps 0 and 1) fail on every item; the run stops with one error line,
  exit code 2, and step 1's checkpoint kept. No library INFO line on the way (--library_logs keeps them).
  Before: the run trained on error_score to the end and exited 0."""
  work = tmp_path / "w"
  r = _train(TINY, f"--workdir={work}", "--noprogress", "--config.run.sft_steps=0", "--config.run.steps=6",
             "--config.reward.fn=reward_fns_for_tests:raises", "--config.reward.n_workers=0",
             "--config.run.checkpoint_every=1", "--config.run.eval_every=0", "--config.data.batch_size=4",
             "--config.rl.group_size=4", "--config.rollout.n_slots=16", "--config.run.eval_size=16",
             "--config.run.tensorboard=False", "--config.run.plot=False", cwd=os.path.join(ROOT, "tests"), timeout=300)
  assert r.returncode == 2, r.stderr[-3000:]
  assert "error: reward 'reward_fns_for_tests:raises' failed on 16 of 16 items in each of the last 3" in r.stderr
  assert "Traceback" not in r.stderr and (work / "checkpoints" / "1").is_dir()
  info = [line for line in r.stderr.splitlines() if re.match(r"I\d{4} ", line)]
  assert info and all(re.search(r" (distributed|carve|experiment|run|loop|sft|metrics)\.py:\d+\]", line)
                      for line in info), "\n".join(info)


def test_too_few_devices_hints_at_fake_cpu_devices(tmp_path):
  """The README's async example on a plain CPU. Before: 'async topology needs 2 devices ... only 1 exist'
  with a traceback, no hint, and config.json already written."""
  r = _train(TINY, f"--workdir={tmp_path / 'w'}", "--config.topology.mode=async")
  assert r.returncode == 2 and "XLA_FLAGS=--xla_force_host_platform_device_count=2" in r.stderr, r.stderr
  assert "Traceback" not in r.stderr and not (tmp_path / "w").exists()


def test_meshes_the_model_does_not_divide_over_are_refused_before_the_workdir_is_made(tmp_path):
  """tensor=3 does not divide the tiny model's 128-token vocabulary. Before: experiment.build found it, after
  config.json, identity.json and init_model/ were written (then deleted again, leaving the workdir behind)."""
  r = _train(TINY, f"--workdir={tmp_path / 'w'}", "--config.topology.trainer.tensor=3",
             "--config.topology.rollout.tensor=3", devices=3)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert ("\nerror: role 'actor' (trainer mesh {'data': 1, 'fsdp': 1, 'tensor': 3}): ['embed_tokens']: dim 0 "
          "(vocab=128) does not divide over mesh axes tensor (3 ways)") in r.stderr, r.stderr
  assert not (tmp_path / "w").exists()


def test_child_env_keeps_the_users_xla_flags_and_accelerators(monkeypatch):
  """Before: JAX_PLATFORMS=cpu was forced whenever it was unset (a GPU host silently ran on CPU) and
  XLA_FLAGS was replaced by the fake-device flag."""
  env = local_multiprocess.child_env(0, 2, 1, 4, base={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/d "
                                                       "--xla_force_host_platform_device_count=8"})
  assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4"
  assert local_multiprocess.child_env(0, 2, 1, 4, base={"JAX_PLATFORMS": "cuda"}).get("XLA_FLAGS") is None
  monkeypatch.setattr(local_multiprocess.os.path, "exists", lambda p: p == "/dev/nvidia0")  # a GPU host
  env = local_multiprocess.child_env(0, 2, 1, 4, base={"XLA_FLAGS": "--xla_dump_to=/tmp/d"})
  assert "JAX_PLATFORMS" not in env and env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"


def test_ctrl_c_says_it_was_interrupted_and_how_to_go_on():
  """Before: a Ctrl-C ended train.py with exit code 130 and nothing printed."""
  code = ("from jaxrl_topo import cli\n"
          "def main(argv):\n"
          "  raise KeyboardInterrupt\n"
          "cli.launch(main, interrupted='run the same command again to resume')\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert r.returncode == 130 and "interrupted; run the same command again to resume" in r.stderr, r.stderr
  # Said when it happens (train.py: a resume only once a checkpoint exists; before, it was promised during the
  # warm-up too, when a rerun starts over)
  code = code.replace("interrupted='run the same command again to resume'", "interrupted=lambda: 'nothing saved yet'")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert r.returncode == 130 and "interrupted; nothing saved yet" in r.stderr, r.stderr


def test_unescape_reads_a_shells_backslash_escapes():
  r"""generate.py --stop='\n' arrives as a backslash and an n (before: that two-character string was the stop string,
  which no completion held, so the README's generate command never stopped at the newline)."""
  from jaxrl_topo import cli

  assert cli.unescape(r"\n") == "\n" and cli.unescape(r"</a>\t") == "</a>\t"
  assert cli.unescape(r"a\\nb") == "a\\nb" and cli.unescape("答案\n") == "答案\n" and cli.unescape(r"\x") == r"\x"
  # train.py's --config.rollout.stop='\n' and a mux job's rollout.stop (before: config.json held ['\\n'], never met)
  from jaxrl_topo.mux.jobs import parse_job

  config = load_config("grpo_task", "tiny", **{"rollout.stop": (r"\n", r"</a>\t", 5)})
  cli.unescape_stops(config)
  assert config.rollout.stop == ("\n", "</a>\t", 5)  # (a non-string is left for the config's own check)
  _, job = parse_job(os.path.join(ROOT, "configs", "grpo_task.py") + ":tiny", [r"rollout.stop=('\n',)"], 0)
  assert job.rollout.stop == ("\n",)


def test_a_ctrl_c_while_xla_compiles_in_another_thread_exits_130():
  """Before: the interpreter's shutdown ran around a thread still inside an XLA compile and crashed after the
  'interrupted' line (train.py's warm-up: status 139, a segfault, 7 runs in 8 by hand; here SIGABRT). Now
  cli.exit_now leaves at once."""
  code = ("import threading, time\n"
          "from jaxrl_topo import cli\n"
          "def compile_long():\n"
          "  import jax, jax.numpy as jnp\n"
          "  def f(x):\n"
          "    for i in range(3000):\n"
          "      x = jnp.sin(x) * (i + 1) + jnp.cos(x[::-1])\n"
          "    return x\n"
          "  jax.jit(f).lower(jnp.ones(64)).compile()\n"
          "def main(argv):\n"
          "  t = threading.Thread(target=compile_long, daemon=True)\n"
          "  t.start()\n"
          "  time.sleep(3)\n"
          "  print('still compiling' if t.is_alive() else 'compiled', flush=True)\n"
          "  raise KeyboardInterrupt\n"
          "cli.launch(main, interrupted='resume')\n")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     env={**env, "JAX_PLATFORMS": "cpu"})  # a compile of its own, not the cache's, at XLA's usual -O
  if "compiled" in r.stdout.split():
    pytest.skip("the compile ended before the interrupt: nothing here tests the exit around it")
  assert "still compiling" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
  assert r.returncode == 130 and r.stderr.strip().endswith("interrupted; resume"), (r.returncode, r.stderr[-2000:])
