"""Prompt data: synthetic tasks (determinism, disjoint splits, verifiers on hand-worked completions) and
the grain pipeline (JSONL/Parquet with file:line errors, overlong handling, shards, resumable state)."""

import builtins
import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl_topo.data import pipeline as pl
from jaxrl_topo.data import tasks
from jaxrl_topo.models import tokenizer as tk


@pytest.fixture(scope="module")
def tok():
  return tk.Tokenizer(tok=tk.build_char_tokenizer(), chat_template=tk.CHATML_TEMPLATE)


def _write_jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def _rows(batches):
  return [item["source_row"] for batch in batches for item in batch]


def _take(it, n):
  return [next(it) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------
# Tasks


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_splits_are_deterministic_disjoint_and_stable(name):
  cfg = tasks.TaskConfig(name=name, seed=3, n_train=40, n_heldout=10)
  train, heldout = tasks.make_split(cfg, "train"), tasks.make_split(cfg, "heldout")
  assert (len(train), len(heldout)) == (40, 10)
  assert train == tasks.make_split(cfg, "train") and heldout == tasks.make_split(cfg, "heldout")
  assert not {e["prompt"] for e in train} & {e["prompt"] for e in heldout}
  assert len({e["prompt"] for e in train}) == 40
  assert all(e["task"] == name for e in train + heldout)
  # Held-out comes first in the stream: changing n_train must not move the evaluation set.
  assert tasks.make_split(tasks.TaskConfig(name=name, seed=3, n_train=20, n_heldout=10), "heldout") == heldout
  assert tasks.make_split(tasks.TaskConfig(name=name, seed=4, n_train=40, n_heldout=10), "train") != train


@pytest.mark.parametrize("cfg", [
  tasks.TaskConfig(name="arithmetic"),
  tasks.TaskConfig(name="arithmetic", ops="+-*", max_operand=12, n_train=300),
  tasks.TaskConfig(name="countdown", max_operand=20, n_numbers=4, n_train=500),
  tasks.TaskConfig(name="reversal", length=3, alphabet="ab1", n_train=20, n_heldout=7),  # the whole space
])
def test_reference_answers_score_one(cfg):
  examples = tasks.make_split(cfg, "train") + tasks.make_split(cfg, "heldout")
  assert [tasks.verify(cfg.name, e["answer"], e) for e in examples] == [1.0] * len(examples)


def test_default_formats_are_short():
  """The demo's char model reads a few characters and writes 1-2 for arithmetic."""
  arithmetic = tasks.make_split(tasks.TaskConfig(name="arithmetic"), "train")
  assert all(len(e["prompt"]) == 4 and e["prompt"][1] == "+" and e["prompt"][3] == "=" for e in arithmetic)
  assert all(1 <= len(e["answer"]) <= 2 for e in arithmetic)
  e = tasks.make_split(tasks.TaskConfig(name="countdown"), "train")[0]
  assert e["prompt"] == f"{' '.join(map(str, e['numbers']))} -> {e['target']}=" and e["numbers"] == sorted(e["numbers"])
  e = tasks.make_split(tasks.TaskConfig(name="reversal"), "train")[0]
  assert e["prompt"] == f"reverse {e['answer'][::-1]}=" and len(e["answer"]) == 4


def test_task_space_too_small_raises():
  # 0..1 op + : four prompts. Asking for five must say so before drawing.
  with pytest.raises(ValueError, match="only 4 distinct prompts"):
    tasks.make_split(tasks.TaskConfig(name="arithmetic", max_operand=1, n_train=4, n_heldout=1), "train")
  assert len(tasks.make_split(tasks.TaskConfig(name="arithmetic", max_operand=1, n_train=3, n_heldout=1), "train")) == 3
  # Countdown with numbers {1, 1}: only targets 1 (1*1, 1/1) and 2 (1+1) exist.
  with pytest.raises(ValueError, match="task space is too small"):
    tasks.make_split(tasks.TaskConfig(name="countdown", max_operand=1, n_numbers=2, n_train=2, n_heldout=1), "train")


@pytest.mark.parametrize("kwargs", [dict(name="sudoku"), dict(name="arithmetic", ops="/"), dict(name="arithmetic",
                                    n_train=0, n_heldout=0), dict(name="reversal", alphabet="a b")])
def test_task_config_rejects_bad_values(kwargs):
  with pytest.raises(ValueError):
    tasks.TaskConfig(**kwargs)


@pytest.mark.parametrize("completion,want", [
  ("8", 1.0), ("8\n", 1.0), (" 8 \nand more", 1.0), ("8 ", 1.0),  # text before the first newline, stripped
  ("9", 0.0), ("88", 0.0), ("08", 0.0), ("", 0.0), ("\n8", 0.0), ("8.0", 0.0),
])
def test_exact_answer_rule(completion, want):
  assert tasks.verify("arithmetic", completion, {"prompt": "3+5=", "answer": "8"}) == want


def test_reversal_verifier():
  example = {"prompt": "reverse abcd=", "answer": "dcba"}
  assert [tasks.verify("reversal", c, example) for c in ("dcba", "dcba\n", "abcd", "dcb", "d c b a")] == [1, 1, 0, 0, 0]


COUNTDOWN = {"numbers": [3, 5, 7], "target": 22, "task": "countdown"}


@pytest.mark.parametrize("completion,numbers,target,want", [
  ("3*5+7", [3, 5, 7], 22, 1.0),
  ("7+5*3\n", [3, 5, 7], 22, 1.0),
  ("(3*5)+7", [3, 5, 7], 22, 1.0),
  ("3+5+7", [3, 5, 7], 22, 0.0),  # valid, but 15
  ("7+7+5+3", [3, 5, 7], 22, 0.0),  # right value, 7 used twice
  ("22", [3, 5, 7], 22, 0.0),  # 22 is not a given number
  ("6/2+7", [2, 6, 7], 10, 1.0),  # exact division is fine
  ("7/2*2", [2, 2, 7], 7, 0.0),  # 7/2 is not an integer, even though the value would come back to 7
  ("5/(3-3)", [3, 3, 5], 1, 0.0),  # division by zero
  ("-3+5+7", [3, 5, 7], 9, 0.0),  # unary minus is outside the grammar
  ("3.0*5+7", [3, 5, 7], 22, 0.0),  # floats too
  ("True*22", [3, 5, 7], 22, 0.0),  # bools are ints to Python, not to us
  ("3*5+7=22", [3, 5, 7], 22, 0.0),  # the answer is the expression alone
  ("3*5+7; 1", [3, 5, 7], 22, 0.0),
  ("__import__('os')", [3, 5, 7], 22, 0.0),
  ("__import__('os').system('true') or 22", [3, 5, 7], 22, 0.0),
  ("(lambda: 22)()", [3, 5, 7], 22, 0.0),
  ("3" + "+3" * 400, [3], 1203, 0.0),  # over the length guard
  ("(" * 100 + "3" + ")" * 100, [3], 3, 1.0),  # deep but short and valid
  ("(" * 130 + "3" + ")" * 130, [3], 3, 0.0),  # over 256 characters
])
def test_countdown_verifier(completion, numbers, target, want):
  assert tasks.verify("countdown", completion, {"numbers": numbers, "target": target}) == want


def test_countdown_never_evaluates_completion(monkeypatch):
  calls = []
  monkeypatch.setattr(builtins, "pwn", lambda: calls.append(1) or 22, raising=False)
  assert tasks.verify("countdown", "pwn()", COUNTDOWN) == 0.0
  assert tasks.verify("countdown", "[pwn() for _ in 'x'][0]", COUNTDOWN) == 0.0
  assert calls == [], "the verifier executed part of a completion"


def test_task_reward_batch():
  metadata = [dict(COUNTDOWN), {"task": "arithmetic", "answer": "8"}, {"task": "reversal", "answer": "ba"},
              {"task": "exact", "answer": "yes"}]
  completions = ["3*5+7", "8\n", "ab", " yes"]
  assert tasks.task_reward(["p"] * 4, completions, metadata) == [1.0, 1.0, 0.0, 1.0]
  with pytest.raises(ValueError, match="Length mismatch"):
    tasks.task_reward(["p"], completions, metadata)
  with pytest.raises(ValueError, match=r"metadata\[0\] has no 'task'"):
    tasks.task_reward(["p"], ["8"], [{"answer": "8"}])
  with pytest.raises(ValueError, match="No verifier for task 'sudoku'"):
    tasks.task_reward(["p"], ["8"], [{"task": "sudoku"}])


def test_tasks_module_does_not_import_jax():
  import subprocess
  import sys
  code = "import sys, jaxrl_topo.data.tasks; assert 'jax' not in sys.modules, 'tasks imported jax'"
  subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------------
# Reading files


def test_jsonl_rows_become_items_with_metadata(tmp_path, tok):
  path = _write_jsonl(tmp_path / "p.jsonl", [{"question": "2+2=", "solution": 4, "level": "easy"}, "",
                                            {"question": "hi", "solution": "x", "level": "hard"}])
  cfg = pl.PromptDataConfig(source=path, prompt_field="question", answer_field="solution")
  got = pl.load_prompts(cfg, tok)
  assert got.examples == [
    {"prompt_ids": tok.encode("2+2="), "prompt": "2+2=", "answer": "4", "level": "easy", "source_row": 0},
    {"prompt_ids": tok.encode("hi"), "prompt": "hi", "answer": "x", "level": "hard", "source_row": 1}]
  assert got.stats == pl.PromptStats(n_rows=2, n_kept=2, n_skipped=0, n_truncated=0)


@pytest.mark.parametrize("lines,where,match", [
  (['{"prompt": "a", "answer": "b"}', '{"prompt": "a", "answer": "b"', ], 2, "not valid JSON"),
  (['{"prompt": "a", "answer": "b"}', "", '["a", "b"]'], 3, "expected a JSON object"),
  (['{"text": "a", "answer": "b"}'], 1, "'prompt' must be a non-empty string"),
  (['{"prompt": "a"}'], 1, "'answer' must be a string or an int"),
  (['{"prompt": "a", "answer": ["b"]}'], 1, "'answer' must be a string or an int"),
  (['{"prompt": "a", "answer": "b", "source_row": 3}'], 1, "reserved"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, tok, lines, where, match):
  path = _write_jsonl(tmp_path / "bad.jsonl", lines)
  with pytest.raises(ValueError, match=rf"bad\.jsonl:{where}: .*{match}"):
    pl.load_prompts(pl.PromptDataConfig(source=path), tok)


def test_parquet_matches_jsonl_and_names_rows(tmp_path, tok):
  rows = [{"prompt": "1+2=", "answer": "3", "task": "arithmetic"},
          {"prompt": "4+4=", "answer": "8", "task": "arithmetic"}]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
  from_parquet = pl.load_prompts(pl.PromptDataConfig(source=str(tmp_path / "p.parquet")), tok)
  from_jsonl = pl.load_prompts(pl.PromptDataConfig(source=_write_jsonl(tmp_path / "p.jsonl", rows)), tok)
  assert from_parquet == from_jsonl
  pq.write_table(pa.Table.from_pylist([rows[0], {"prompt": None, "answer": "1"}]), tmp_path / "bad.parquet")
  with pytest.raises(ValueError, match=r"bad\.parquet:2: field 'prompt'"):
    pl.load_prompts(pl.PromptDataConfig(source=str(tmp_path / "bad.parquet")), tok)


@pytest.mark.parametrize("kwargs", [
  dict(source="x.csv"), dict(source="arithmetic", overlong="drop"), dict(source="arithmetic", batch_size=0),
  dict(source="reversal", task=tasks.TaskConfig(name="countdown"))])
def test_config_rejects_bad_values(kwargs):
  with pytest.raises(ValueError):
    pl.PromptDataConfig(**kwargs)


# ---------------------------------------------------------------------------------------------------
# Overlong prompts


@pytest.fixture
def lengths_file(tmp_path):
  return _write_jsonl(tmp_path / "len.jsonl", [{"prompt": "x" * n, "answer": ""} for n in (3, 9, 5, 6, 2)])


def test_overlong_skip_is_counted(lengths_file, tok):
  got = pl.load_prompts(pl.PromptDataConfig(source=lengths_file, max_prompt_len=5, overlong="skip"), tok)
  assert [len(e["prompt_ids"]) for e in got.examples] == [3, 5, 2]
  assert [e["source_row"] for e in got.examples] == [0, 2, 4]
  assert got.stats == pl.PromptStats(n_rows=5, n_kept=3, n_skipped=2, n_truncated=0)
  with pytest.raises(ValueError, match="No prompts left"):
    pl.load_prompts(pl.PromptDataConfig(source=lengths_file, max_prompt_len=1), tok)


def test_overlong_truncate_keeps_the_end(tmp_path, tok):
  path = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "abcdefgh=", "answer": ""}, {"prompt": "ab=", "answer": ""}])
  got = pl.load_prompts(pl.PromptDataConfig(source=path, max_prompt_len=4, overlong="truncate"), tok)
  assert [tok.decode(e["prompt_ids"]) for e in got.examples] == ["fgh=", "ab="]
  assert got.examples[0]["prompt"] == "abcdefgh="  # the text is the source's, before truncation
  assert got.stats == pl.PromptStats(n_rows=2, n_kept=2, n_skipped=0, n_truncated=1)


def test_overlong_error_names_the_line(lengths_file, tok):
  with pytest.raises(ValueError, match=r"len\.jsonl:2: prompt is 9 tokens, over max_prompt_len=5"):
    pl.load_prompts(pl.PromptDataConfig(source=lengths_file, max_prompt_len=5, overlong="error"), tok)


def test_chat_template_counts_in_the_length(tok):
  cfg = pl.PromptDataConfig(source="arithmetic", chat_template=True, max_prompt_len=64)
  example = pl.load_prompts(cfg, tok).examples[0]
  assert example["prompt_ids"] == tok.apply_chat_template_ids([{"role": "user", "content": example["prompt"]}])
  # "<|im_start|>user\n4+0=<|im_end|>\n<|im_start|>assistant\n": 3 markers + "user" 4 + "4+0=" 4 + "assistant" 9
  # + 3 newlines = 23 ids.
  assert len(example["prompt_ids"]) == 23
  truncated = pl.load_prompts(pl.PromptDataConfig(source="arithmetic", chat_template=True, max_prompt_len=22,
                                                  overlong="truncate"), tok)
  assert truncated.stats.n_truncated == 80 and tok.decode(truncated.examples[0]["prompt_ids"]).endswith("assistant\n")


def test_the_instruction_follows_every_prompt_inside_the_chat_turn(tok):
  """data.instruction: the model sees "<prompt>\\n\\n<instruction>" as its user turn; the row's own prompt (what a
  reward or a log shows) stays as written. configs/grpo_gsm8k.py asks for \\boxed{} that way (before: its
  INSTRUCTION constant reached no prompt, so GSM8K prompts never asked for the format math_answer reads)."""
  cfg = pl.PromptDataConfig(source="arithmetic", chat_template=True, max_prompt_len=64, instruction="Box it.")
  example = pl.load_prompts(cfg, tok).examples[0]
  assert example["prompt"] == "4+0="
  assert example["prompt_ids"] == tok.apply_chat_template_ids([{"role": "user", "content": "4+0=\n\nBox it."}])
  plain = pl.load_prompts(dataclasses.replace(cfg, chat_template=False), tok).examples[0]
  assert plain["prompt_ids"] == tok.encode("4+0=\n\nBox it.")
  from run_fixtures import load_config

  from jaxrl_topo.runtime.config import from_config_dict
  gsm8k = from_config_dict(load_config("grpo_gsm8k", "/models/none"))
  assert "\\boxed{}" in gsm8k.data.instruction and gsm8k.data.chat_template


# ---------------------------------------------------------------------------------------------------
# Iteration: shards, epochs, state


def _task_cfg(**kwargs):
  return pl.PromptDataConfig(source="arithmetic", task=tasks.TaskConfig(name="arithmetic", n_train=12, n_heldout=5),
                             **kwargs)


def test_shards_are_disjoint_cover_each_epoch_and_match_one_process(tok):
  P, B = 3, 2  # 12 prompts: each process reads 4 = 2 batches per epoch
  per_process = [_take(pl.make_prompt_iterator(_task_cfg(batch_size=B), tok, process_index=p, process_count=P), 6)
                 for p in range(P)]
  for epoch in range(3):
    shards = [set(_rows(batches[2 * epoch:2 * epoch + 2])) for batches in per_process]
    assert sum(map(len, shards)) == 12 and set().union(*shards) == set(range(12)), f"epoch {epoch}"
  # Global step t is the same prompts whatever the process count: process p holds global elements p, p+P, ...
  single = _rows(_take(pl.make_prompt_iterator(_task_cfg(batch_size=B * P), tok, process_index=0, process_count=1), 6))
  interleaved = [row for k in range(12) for row in (_rows(b)[k] for b in per_process)]
  assert interleaved == single[:36]


def test_epochs_reshuffle_deterministically(tok):
  rows = _rows(_take(pl.make_prompt_iterator(_task_cfg(batch_size=4), tok, process_index=0, process_count=1), 9))
  epochs = [rows[i:i + 12] for i in range(0, 36, 12)]
  assert all(sorted(e) == list(range(12)) for e in epochs)
  assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != list(range(12))
  def first_rows(**kwargs):
    return _rows(_take(pl.make_prompt_iterator(_task_cfg(**kwargs), tok, process_index=0, process_count=1), 9))
  assert first_rows(batch_size=4) == rows and first_rows(batch_size=4, seed=1) != rows


def test_batches_carry_reward_metadata(tok):
  batch = next(pl.make_prompt_iterator(pl.PromptDataConfig(source="countdown", batch_size=4), tok,
                                       process_index=0, process_count=1))
  assert len(batch) == 4 and all(tok.decode(item["prompt_ids"]) == item["prompt"] for item in batch)
  assert tasks.task_reward([i["prompt"] for i in batch], [i["answer"] for i in batch], batch) == [1.0] * 4
  batch[0]["numbers"].append(99)  # a caller's edit must not reach the source
  later = [i for b in _take(pl.make_prompt_iterator(pl.PromptDataConfig(source="countdown", batch_size=80), tok,
                                                    process_index=0, process_count=1), 2) for i in b]
  assert not any(99 in i["numbers"] for i in later)


def test_state_resumes_exactly(tok):
  cfg = _task_cfg(batch_size=5)  # 5 does not divide 12: resume lands mid-epoch and across epoch boundaries
  it = pl.make_prompt_iterator(cfg, tok, process_index=1, process_count=2)
  _take(it, 5)
  state = json.loads(json.dumps(it.get_state()))  # orbax stores it as JSON
  want = _take(it, 3)
  resumed = pl.make_prompt_iterator(cfg, tok, process_index=1, process_count=2)
  resumed.set_state(state)
  assert _take(resumed, 3) == want
  other = pl.make_prompt_iterator(cfg, tok, process_index=0, process_count=2)
  with pytest.raises(ValueError, match="resuming would read different prompts"):
    other.set_state(state)


def test_eval_batches_are_the_heldout_set_in_order(tok, tmp_path):
  cfg = _task_cfg(batch_size=2)
  batches, stats = pl.eval_batches(cfg, tok, process_index=0, process_count=1)
  heldout = tasks.make_split(cfg.task, "heldout")
  assert [len(b) for b in batches] == [2, 2, 1] and stats.n_kept == 5
  assert [i["prompt"] for b in batches for i in b] == [e["prompt"] for e in heldout]
  shards = [pl.eval_batches(cfg, tok, process_index=p, process_count=2)[0] for p in range(2)]
  assert sorted(_rows(shards[0]) + _rows(shards[1])) == list(range(5)) and _rows(shards[1]) == [1, 3]
  path = _write_jsonl(tmp_path / "e.jsonl", [{"prompt": "q", "answer": "a"}])
  with pytest.raises(ValueError, match="set eval_source"):
    pl.eval_batches(pl.PromptDataConfig(source=path), tok, process_index=0, process_count=1)
  got, _ = pl.eval_batches(pl.PromptDataConfig(source="arithmetic", eval_source=path), tok, process_index=0,
                           process_count=1)
  assert [i["prompt"] for b in got for i in b] == ["q"]


def test_an_empty_eval_file_is_named(tok, tmp_path):
  """Before: the error named the training file."""
  train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
  _write_jsonl(train, [{"prompt": "a", "answer": "b"}])
  held.write_text("")
  with pytest.raises(ValueError, match=f"No rows in {held}"):
    pl.load_prompts(pl.PromptDataConfig(source=str(train), eval_source=str(held)), tok, "heldout")


def test_seeds_do_not_replay_each_others_epochs(tmp_path, tok):
  """grain seeds epoch e with seed + e: seed 1's first epoch was seed 0's second, and so on."""
  path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(50)])

  def epochs(seed):
    it = pl.make_prompt_iterator(pl.PromptDataConfig(source=path, batch_size=50, seed=seed), tok, process_index=0,
                                 process_count=1)
    return [_rows([next(it)]) for _ in range(3)]

  zero, one = epochs(0), epochs(1)
  assert zero[1] != one[0] and zero[2] != one[1] and sorted(one[0]) == list(range(50))
  assert pl.shuffle_seed(0) != pl.shuffle_seed(1) and 0 <= pl.shuffle_seed(2**32 - 1) < 2**32


def test_text_that_is_not_unicode_is_refused_naming_the_line(tmp_path, tok):
  """Before: a bare UnicodeDecodeError, and a lone surrogate ("\\ud800", valid JSON) a TypeError from the
  tokenizer, neither naming the file or line."""
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
  with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text"):
    pl.load_prompts(pl.PromptDataConfig(source=str(path)), tok)
  path = _write_jsonl(tmp_path / "sur.jsonl", ['{"prompt": "a\\ud800b", "answer": "1"}'])
  with pytest.raises(ValueError, match=r"sur.jsonl:1: the prompt is not valid Unicode text"):
    pl.load_prompts(pl.PromptDataConfig(source=path), tok)


def test_an_empty_task_split_names_its_knob(tok):
  cfg = pl.PromptDataConfig(source="arithmetic", task=tasks.TaskConfig(name="arithmetic", n_train=50, n_heldout=0))
  with pytest.raises(ValueError, match=r"No heldout prompts in task 'arithmetic': data.task.n_heldout=0"):
    pl.load_prompts(cfg, tok, "heldout")

