"""launchers/generate.py, init_model.py and export.py as a user runs them (subprocess): checks before any work,
--stop. The checks' tests are cheap: each fails before a model is loaded."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from subproc import cpu_env

from jaxrl_topo.models.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = os.path.join(ROOT, "launchers", "generate.py")
INIT = os.path.join(ROOT, "launchers", "init_model.py")
EXPORT = os.path.join(ROOT, "launchers", "export.py")


def _run(script, *args, timeout=180) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                        env=cpu_env())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  from jaxrl_topo.models.fresh import write_fresh_model
  from jaxrl_topo.models.presets import get_preset

  path = tmp_path_factory.mktemp("gen") / "tiny"
  write_fresh_model(str(path), get_preset("tiny"), seed=0)
  return path


def _prompts(path, texts):
  path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
  return path


def test_a_missing_model_dir_is_named(tmp_path):
  """Before: 'IN.jsonl:1: a text prompt needs tokenizer.json in the model directory'."""
  p = _prompts(tmp_path / "in.jsonl", ["abc"])
  r = _run(GENERATE, f"--model={tmp_path / 'nope'}", f"--prompts={p}", f"--out={tmp_path / 'o.jsonl'}")
  assert r.returncode == 2 and f"--model={tmp_path / 'nope'}: no config.json" in r.stderr, r.stderr
  assert "Traceback" not in r.stderr


def test_out_equal_to_prompts_is_refused(tmp_path, model):
  """Before: the prompts file was overwritten by the completions."""
  p = _prompts(tmp_path / "in.jsonl", ["abc"])
  before = p.read_text()
  r = _run(GENERATE, f"--model={model}", f"--prompts={p}", f"--out={p}")
  assert r.returncode == 2 and "is the --prompts file" in r.stderr, r.stderr
  assert p.read_text() == before


@pytest.mark.parametrize("flag, says", [("--min_pack_rows=1", "error: --min_pack_rows=1 must be >= 2"),
                                        ("--pallas_splits=-1", "error: --pallas_splits=-1 must be >= 0")])
def test_a_bad_engine_option_is_refused_before_any_work(tmp_path, flag, says):
  r = _run(GENERATE, f"--model={tmp_path / 'nope'}", f"--prompts={tmp_path / 'nope.jsonl'}",
           f"--out={tmp_path / 'o.jsonl'}", flag)
  assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_prompt_plus_new_tokens_over_the_position_limit(tmp_path, model):
  """Before: nothing checked it (the tiny model has 512 positions)."""
  p = _prompts(tmp_path / "in.jsonl", ["ab", "a" * 480])
  r = _run(GENERATE, f"--model={model}", f"--prompts={p}", f"--out={tmp_path / 'o.jsonl'}", "--max_new_tokens=64")
  assert r.returncode == 2, r.stderr
  assert f"{p}:2: the prompt's 480 tokens + --max_new_tokens=64 exceed the model's position limit 512" in r.stderr


def test_stop_strings_end_a_completion(tmp_path, model):
  """Before: there was no --stop flag (absl rejected it). The engine's log line names the read --read chose."""
  p = _prompts(tmp_path / "in.jsonl", ["abcabc", "hello"])
  out = tmp_path / "o.jsonl"
  # --read=window in both runs: the engine ends a completion at its stop string, whatever the read
  r = _run(GENERATE, f"--model={model}", f"--prompts={p}", f"--out={out}", "--greedy", "--max_new_tokens=12",
           "--read=window")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "decode read window" in r.stderr, r.stderr[-3000:]  # the flag reaches the engine
  full = [json.loads(line) for line in out.read_text().splitlines()]
  stop = full[0]["text"][3:5]
  r = _run(GENERATE, f"--model={model}", f"--prompts={p}", f"--out={out}", "--greedy", "--max_new_tokens=12",
           f"--stop={stop}", "--read=window")
  assert r.returncode == 0, r.stderr[-3000:]
  cut = [json.loads(line) for line in out.read_text().splitlines()]
  assert cut[0]["text"].endswith(stop) and full[0]["text"].startswith(cut[0]["text"])
  assert stop not in cut[0]["text"][:-1] and cut[0]["finish_reason"] == "stop"
  n = len(cut[0]["completion_ids"])
  assert cut[0]["completion_ids"] == full[0]["completion_ids"][:n] and len(cut[0]["logprobs"]) == n
  for a, b in zip(full[1:], cut[1:], strict=True):  # rows without the stop string are unchanged
    assert (stop in a["text"]) or a == b


def test_init_model_ships_another_models_tokenizer(tmp_path, model):
  """Before: there was no --tokenizer_from (a real preset shipped the char tokenizer alone, silently)."""
  init = os.path.join(ROOT, "launchers", "init_model.py")
  # The older layout: the template inside tokenizer_config.json, no generation_config.json. Before, the char
  # tokenizer's chat_template.jinja and EOS ids (5, 2) stayed and won over the source's.
  src = tmp_path / "src"
  src.mkdir()
  shutil.copy(model / "tokenizer.json", src / "tokenizer.json")
  template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
  (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<eos>"}))
  r = _run(init, "--preset=tiny", f"--out={tmp_path / 'm'}", f"--tokenizer_from={src}")
  assert r.returncode == 0 and "with the tokenizer of" in r.stdout, r.stderr[-3000:]
  assert (tmp_path / "m" / "tokenizer.json").read_text() == (model / "tokenizer.json").read_text()
  shipped = Tokenizer.from_dir(tmp_path / "m")
  assert shipped.chat_template == template and shipped.eos_token_ids == (2,)  # "<eos>" is id 2
  assert json.loads((tmp_path / "m" / "config.json").read_text())["eos_token_id"] == [2]
  r = _run(init, "--preset=tiny", f"--out={tmp_path / 'n'}", f"--tokenizer_from={tmp_path / 'nope'}")
  assert r.returncode == 2 and "no tokenizer.json there" in r.stderr and not (tmp_path / "n").exists(), r.stderr


def _one_line_error(r, text):
  """The launcher refused with one `error:` line holding `text` (status 2, no traceback)."""
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
  errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and text in errors[0], r.stderr[-3000:]


def _generate(model, prompts, out, *flags):
  return _run(GENERATE, f"--model={model}", f"--prompts={prompts}", f"--out={out}", *flags)


def test_non_positive_sizes_are_refused(tmp_path, model):
  """Before: --data=0 was a ZeroDivisionError, --data=-2 and --tensor=0 ran, --batch_size=0 named
  EngineConfig.n_slots. The launcher twice; the rest through the check it calls."""
  from jaxrl_topo.rollout import generate

  p, out = _prompts(tmp_path / "in.jsonl", ["abc"]), tmp_path / "o.jsonl"
  for flag in ("--data=0", "--max_new_tokens=0", "--page_size=0", "--decode_chunk=0"):
    _one_line_error(_generate(model, p, out, flag), f"{flag} must be >= 1")
  # Before: accepted, and every completion ended at its first token ("" is in every text).
  _one_line_error(_generate(model, p, out, "--stop="), "--stop='' is empty")
  assert not out.exists()
  for sizes, says in (((8, -2, 1), "--data=-2 must be >= 1"), ((8, 1, 0), "--tensor=0 must be >= 1"),
                      ((0, 1, 1), "--batch_size=0 must be >= 1"), ((3, 2, 1), "--batch_size=3 must be a multiple "
                                                                               "of --data=2")):
    with pytest.raises(ValueError, match=says):
      generate.check_sizes(*sizes, name=lambda n: f"--{n}")


def test_a_run_workdir_as_the_model_points_to_export(tmp_path):
  """Before: "config.json: no 'vocab_size' (a Hugging Face config.json needs it)"."""
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "config.json").write_text("{}")
  p = _prompts(tmp_path / "in.jsonl", ["abc"])
  _one_line_error(_generate(run, p, tmp_path / "o.jsonl"), f"--model={run} is a training run's workdir, not a "
                  f"model directory: export its policy first (python launchers/export.py --workdir={run}")


def test_an_unwritable_out_is_refused_before_generating(tmp_path, model):
  """Before: everything was generated, then [Errno 17] / [Errno 21] and the completions were lost."""
  from jaxrl_topo.rollout import generate

  p = _prompts(tmp_path / "in.jsonl", ["abc"])
  afile = tmp_path / "afile"
  afile.write_text("mine\n")
  _one_line_error(_generate(model, p, afile / "o.jsonl"), f"{afile} is a file, not a directory")
  with pytest.raises(OSError, match=f"{afile} is a file, not a directory"):
    generate.check_out_file(str(afile / "sub" / "o.jsonl"))
  assert afile.read_text() == "mine\n"
  (tmp_path / "outdir").mkdir()
  with pytest.raises(OSError, match="is a directory"):
    generate.check_out_file(str(tmp_path / "outdir"))
  # Opened to be sure (before: os.access said yes, and these failed after generating); nothing is left behind.
  long = tmp_path / ("x" * 300 + ".jsonl")
  with pytest.raises(OSError, match="cannot be written: File name too long"):
    generate.check_out_file(str(long))
  with pytest.raises(OSError, match="a name in it is longer than 255 bytes"):
    generate.check_out_file(str(tmp_path / "new" / long.name))
  generate.check_out_file(str(tmp_path / "fine.jsonl"))
  assert not (tmp_path / "fine.jsonl").exists() and afile.read_text() == "mine\n"
  generate.check_out_file(str(afile))
  assert afile.read_text() == "mine\n"
  os.symlink(tmp_path / "gone.jsonl", tmp_path / "link.jsonl")  # dangling: the link stays, nothing is made
  generate.check_out_file(str(tmp_path / "link.jsonl"))
  assert os.path.islink(tmp_path / "link.jsonl") and not (tmp_path / "gone.jsonl").exists()


def test_out_never_writes_over_the_model_or_a_runs_files(tmp_path, model, workdir):
  """Before: --out=MODEL/config.json (or its weights, or a run's metrics.jsonl) was written over."""
  from jaxrl_topo.runtime.workdir import check_not_a_runs_file

  p = _prompts(tmp_path / "in.jsonl", ["abc"])
  before = (model / "config.json").read_bytes()
  _one_line_error(_generate(model, p, model / "config.json"), f"--out={model / 'config.json'} is a file of the "
                  "--model directory: writing it would destroy the model")
  assert (model / "config.json").read_bytes() == before
  os.symlink(model / "config.json", tmp_path / "cfg")  # a link to it, from elsewhere
  _one_line_error(_generate(model, p, tmp_path / "cfg"), "is a file of the --model directory")
  assert (model / "config.json").read_bytes() == before
  (workdir / "identity.json").write_text("{}")
  for name in ("metrics.jsonl", "summary.json", "checkpoints/7/x", "run.lock", "profile/plugins/x"):
    with pytest.raises(ValueError, match=f"is the run {workdir}'s own {name.split('/')[0]}: writing there would"):
      check_not_a_runs_file(str(workdir / name), "--out")
  check_not_a_runs_file(str(workdir / "completions.jsonl"), "--out")  # a new file beside the run's is fine
  (tmp_path / "group").mkdir()
  (tmp_path / "group" / "mux_spans.jsonl").write_text("")
  with pytest.raises(ValueError, match="is a multiplexed group's own file"):
    check_not_a_runs_file(str(tmp_path / "group" / "mux_summary.json"), "--out")


def test_bad_prompt_lines_name_file_and_line(tmp_path, model):
  """Before: {"prompt": 5} was a TypeError from the tokenizer; an id outside the vocabulary said 'prompt 0: ...'
  (after the model was loaded)."""
  from jaxrl_topo.rollout import generate

  p, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
  p.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [4]}\n{"prompt_ids": [3, 99999]}\n\n')  # a blank end is fine
  _one_line_error(_generate(model, p, out), f"{p}:3: prompt_ids holds 99999; token ids must lie in [0, ")
  assert not out.exists()
  p.write_text('{"prompt_ids": [-1]}\n')
  with pytest.raises(ValueError, match=f"{p}:1: prompt_ids holds -1"):
    generate.read_prompts(str(p), None, False, vocab_size=128)
  p.write_text('{"prompt": "ok"}\n{"prompt": 5}\n')  # (the launcher's run with this file is the next test's)


def test_greedy_ignores_the_sampling_flags(tmp_path, model):
  """Before: --greedy --temperature=-5 said 'temperature must be > 0 unless greedy'. Here it gets past the flag
  checks to the (bad) prompt line; without --greedy the flag is named."""
  p = tmp_path / "in.jsonl"
  p.write_text('{"prompt": 5}\n')
  r = _generate(model, p, tmp_path / "o.jsonl", "--greedy", "--temperature=-5", "--top_p=7")
  _one_line_error(r, f"{p}:1: 'prompt' must be a string")
  r = _generate(model, p, tmp_path / "o.jsonl", "--temperature=-5")
  _one_line_error(r, "--temperature must be > 0 unless greedy, got temperature=-5")


def _model_copy(model, tmp_path):
  path = tmp_path / "copy"
  shutil.copytree(model, path)
  return path


def test_a_truncated_weights_file_is_named(tmp_path, model):
  """Before: safetensors' 'invalid header length' traceback."""
  m, out = _model_copy(model, tmp_path), tmp_path / "o.jsonl"
  weights = m / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:50])
  _one_line_error(_generate(m, _prompts(tmp_path / "in.jsonl", ["abc"]), out),
                  f"{weights}: not a readable safetensors file")
  assert not out.exists()


@pytest.mark.parametrize("change,text", [
    (lambda t: "{model_type: 1}", "not valid JSON (Expecting property name"),
    (lambda t: json.dumps({**json.loads(t), "num_hidden_layers": "two"}), 'num_hidden_layers="two" must be a positive'),
    (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "vocab_size"}), "no 'vocab_size'"),
    (lambda t: "[1, 2]", "expected a JSON object, got list")])
def test_a_broken_config_json_is_named(tmp_path, model, change, text):
  """Before: 'Expecting property name ...' or "invalid literal for int() ... 'two'" naming neither file nor key.
  (hf_io.read_config, which generate.py calls first: the launcher's run is the truncated-weights test's.)"""
  from jaxrl_topo.models import hf_io

  m = _model_copy(model, tmp_path)
  cfg = m / "config.json"
  cfg.write_text(change(cfg.read_text()))
  with pytest.raises(ValueError) as err:
    hf_io.read_config(str(m))
  assert str(err.value).startswith(f"{cfg}: {text}"), err.value


def test_init_model_never_overwrites(tmp_path, model):
  """Before: an existing model directory was silently overwritten; a file was '[Errno 17] File exists' after the
  model was built."""
  m = _model_copy(model, tmp_path)
  before = {f: (m / f).read_bytes() for f in os.listdir(m)}
  _one_line_error(_run(INIT, "--preset=tiny", f"--out={m}", "--seed=1"), f"--out={m} already exists and is not empty")
  assert {f: (m / f).read_bytes() for f in os.listdir(m)} == before
  from jaxrl_topo.models import hf_io

  afile = tmp_path / "afile"
  afile.write_text("mine\n")
  for out, says in ((afile, f"--out={afile} is a file, not a directory"), (afile / "m", f"{afile} is a file")):
    with pytest.raises(OSError, match=says):
      hf_io.check_out_dir(str(out))
  assert afile.read_text() == "mine\n"
  # Made to be sure, then removed (before, as root: export to --out=/proc/e1 passed the checks, then failed with
  # "/proc/e1: No such file or directory", naming no flag).
  with pytest.raises(OSError, match=f"^--out={tmp_path}/{'x' * 300}/m cannot be written: File name too long$"):
    hf_io.check_out_dir(str(tmp_path / ("x" * 300) / "m"))
  hf_io.check_out_dir(str(tmp_path / "new" / "m"))
  assert not (tmp_path / "new").exists()


def test_init_model_sets_fields_of_the_preset(tmp_path):
  """--set=field=value over the preset's shape (as a run's model.overrides); a misspelt field, a field a run sets
  itself, and a shape the model config refuses are one-line errors with nothing written."""
  out = tmp_path / "m"
  r = _run(INIT, "--preset=tiny", "--set=n_layers=3", "--set=d_model=96", "--set=tie_embeddings=True", f"--out={out}")
  assert r.returncode == 0 and "wrote a fresh tiny (n_layers=3, d_model=96, tie_embeddings=True) model" in r.stdout, (
      r.stderr[-2000:])
  config = json.loads((out / "config.json").read_text())
  assert (config["num_hidden_layers"], config["hidden_size"], config["tie_word_embeddings"]) == (3, 96, True)
  _one_line_error(_run(INIT, "--preset=tiny", "--set=n_layer=3", f"--out={tmp_path / 'x'}"),
                  "--set: 'n_layer' is not a model config field; did you mean 'n_layers'?")  # the rest: preset_with
  assert not (tmp_path / "x").exists()
  # Before (a new user's trial): the last --set of a field won, and the printed shape named both.
  _one_line_error(_run(INIT, "--preset=tiny", "--set=n_layers=3", "--set=n_layers=1", f"--out={tmp_path / 'x'}"),
                  "--set: n_layers given twice (n_layers=3, n_layers=1): give it once")
  assert not (tmp_path / "x").exists()


def test_a_flag_given_twice_is_refused(tmp_path, model):
  """Before (a new user's trial): absl kept the last one, so --model=a --model=b generated from b without a word.
  Repeatable flags (--stop) stay repeatable; a boolean's --noX counts as --X."""
  p = _prompts(tmp_path / "in.jsonl", ["abc"])
  out = tmp_path / "o.jsonl"
  _one_line_error(_generate(model, p, out, f"--model={tmp_path}"), f"--model given 2 times ({model}, {tmp_path}): "
                                                                   "give one")
  _one_line_error(_generate(model, p, out, "--greedy", "--nogreedy"), "--greedy given 2 times (--greedy, --nogreedy)")
  _one_line_error(_generate(model, p, out, "--stop=a", "--stop=b", "--top_p=0"), "--top_p")  # the next check's error
  assert not out.exists()


@pytest.fixture
def workdir(tmp_path):
  """A run directory as far as export's checks look (config.json, init_model/, checkpoints/)."""
  work = tmp_path / "run"
  (work / "init_model").mkdir(parents=True)
  (work / "init_model" / "config.json").write_text('{"init": 1}')
  (work / "checkpoints").mkdir()
  (work / "config.json").write_text('{"model": {"hf_dir": null}}')
  return work


@pytest.mark.parametrize("sub,text", [("", "is the --workdir"), ("init_model", "is the run's own init_model"),
                                      ("checkpoints/x", "is the run's own checkpoints"),
                                      ("config.json", "is the run's own config.json"), ("tb", "is the run's own tb")])
def test_export_never_writes_over_the_run(workdir, sub, text):
  """Before: --out=R overwrote the run's config.json; --out=R/init_model replaced the run's initial model.
  The launcher for --out=R; the others through the check it (and export.export) calls."""
  from jaxrl_topo.runtime.workdir import check_export_out

  owned = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
  out = workdir / sub if sub else workdir
  if not sub:
    _one_line_error(_run(EXPORT, f"--workdir={workdir}", f"--out={out}"), f"--out={out} {text}")
  with pytest.raises(ValueError, match=f"--out={out} {text}"):
    check_export_out(str(workdir), str(out))
  assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == owned
  assert not (workdir / "checkpoints" / "x").exists() and not (workdir / "tb").exists()


def test_export_to_hf_inside_the_run_passes_the_checks(workdir, tmp_path, model):
  """--out=R/hf (the README's) is allowed, and so is an earlier export (a model directory with exported_from.json);
  a model no export wrote, the run's base model and a directory holding something else are refused. Before: any
  model directory was replaced without a word."""
  from jaxrl_topo.runtime.workdir import EXPORT_RECORD, check_export_out

  check_export_out(str(workdir), str(workdir / "hf"))
  base = _model_copy(model, tmp_path)
  with pytest.raises(OSError, match=f"holds a model that no export wrote \\(no {EXPORT_RECORD}\\)"):
    check_export_out(str(workdir), str(base))
  (base / EXPORT_RECORD).write_text("{}")
  check_export_out(str(workdir), str(base))
  (workdir / "config.json").write_text(json.dumps({"model": {"hf_dir": str(base)}}))
  with pytest.raises(ValueError, match="is the model the run started from"):
    check_export_out(str(workdir), str(base))
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("mine")
  with pytest.raises(OSError, match="already exists and is not empty and holds no model to replace"):
    check_export_out(str(workdir), str(tmp_path / "other"))
