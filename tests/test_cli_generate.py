"""launchers/generate.py and init_model.py as a user runs them (subprocess): checks before any work, --stop."""

import json
import os
import subprocess
import sys

import pytest
from subproc import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = os.path.join(ROOT, "launchers", "generate.py")


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


def test_a_bad_engine_option_is_refused_before_any_work(tmp_path):
  r = _run(GENERATE, f"--model={tmp_path / 'nope'}", f"--prompts={tmp_path / 'nope.jsonl'}",
           f"--out={tmp_path / 'o.jsonl'}", "--min_pack_rows=1")
  assert r.returncode == 2 and "min_pack_rows=1 must be >= 2" in r.stderr and "Traceback" not in r.stderr, r.stderr


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
  # --read=window in both runs: the stop cut is applied after generation, whatever the read
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
  r = _run(init, "--preset=tiny", f"--out={tmp_path / 'm'}", f"--tokenizer_from={model}")
  assert r.returncode == 0 and "with the tokenizer of" in r.stdout, r.stderr[-3000:]
  assert (tmp_path / "m" / "tokenizer.json").read_text() == (model / "tokenizer.json").read_text()
  r = _run(init, "--preset=tiny", f"--out={tmp_path / 'n'}", f"--tokenizer_from={tmp_path / 'nope'}")
  assert r.returncode == 2 and "no tokenizer.json there" in r.stderr and not (tmp_path / "n").exists(), r.stderr
