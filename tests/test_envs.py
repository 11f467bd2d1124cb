"""Environments (envs/): the worker pool's failure handling, the calculator environment, and the
chat rendering of environment replies against transformers' apply_chat_template."""

from __future__ import annotations

import logging
import time
import types

import pytest
import transformers
from test_tokenizer import HEADER_SPECIALS

from jaxrl_topo.data import tasks, tool_calc
from jaxrl_topo.envs import env as env_lib
from jaxrl_topo.envs.env_pool import EnvPool
from jaxrl_topo.envs.turns import EnvTurns, demonstrations, first_prompt, reply_ids, reply_text
from jaxrl_topo.models import tokenizer as tk

EX = {"prompt": "12*34=", "answer": "408", "task": "tool_calc", "expr": "12*34"}

# ---------------------------------------------------------------- the pool


@pytest.fixture(scope="module")
def pools():
  made = {}

  def get(name, **kw):
    if name not in made:
      made[name] = EnvPool(f"envs_for_tests:{name}", n_workers=1, **kw)
    return made[name]
  yield get
  for p in made.values():
    p.close()


def _wait(pool, n=1):
  out = []
  while len(out) < n:
    out += pool.poll(block=True)
  return out


def test_pool_replays_episodes_and_answers_by_key(pools):
  pool = pools("Chatty")
  pool.submit("a", EX, ["x", "y"])
  pool.submit("b", EX, [])
  got = dict((k, (kind, res)) for k, kind, res in _wait(pool, 2))
  assert got["a"] == ("ok", ("ok 2", 1.0, False, {"n": 2}))
  assert got["b"] == ("ok", ("12*34=", 0.0, False, {}))  # no turns: reset's observation


@pytest.mark.parametrize("name, kind", [("RaisesOnStep", "error"), ("BadReset", "error"), ("CrashesWorker", "error")])
def test_failing_environments_come_back_as_errors_and_the_pool_goes_on(pools, name, kind):
  pool = pools(name)
  pool.submit("k", EX, ["x"])
  [(key, got_kind, why)] = _wait(pool)
  assert key == "k" and got_kind == kind and isinstance(why, str)
  pool.submit("again", EX, [])  # the same pool (a fresh worker where one died) answers the next call
  [(key, _, _)] = _wait(pool)
  assert key == "again"


def test_a_hanging_environment_times_out_and_its_worker_is_replaced(pools):
  pool = pools("HangsOnStep", timeout_s=1.0)
  pid = pool._workers[0].proc.pid
  t = time.monotonic()
  pool.submit("k", EX, ["x"])
  [(key, kind, why)] = _wait(pool)
  assert (key, kind) == ("k", "timeout") and "timeout_s" in why and time.monotonic() - t < 10
  assert pool._workers[0].proc.pid != pid
  pool.submit("next", EX, [])
  assert _wait(pool)[0][:2] == ("next", "ok")


def test_unknown_environment_fails_before_any_worker_starts():
  with pytest.raises(ValueError, match="no_such_module"):
    EnvPool("no_such_module:Env", n_workers=1)


def test_a_worker_not_ready_by_the_start_timeout_names_its_config_key():
  with pytest.raises(RuntimeError, match=r"did not start within 0.01 s.*raise env.start_timeout_s"):
    EnvPool("envs_for_tests:Chatty", n_workers=1, start_timeout_s=0.01)  # no spawned process is ready in 10 ms


# ---------------------------------------------------------------- the calculator


def test_calculator_environment_by_hand():
  env = tool_calc.CalcEnv()
  assert env.reset(dict(EX)) == "12*34="
  assert env.step("<calc>12*34</calc>") == ("<result>408</result>", 0.0, False,
                                           {"correct": 0.0, "tool_calls": 1, "tool_correct": 1.0})
  assert env.step("408\nthanks") == ("", 1.0, True, {"correct": 1.0, "tool_calls": 1, "tool_correct": 1.0})
  env.reset(dict(EX))
  assert env.step("<calc>12*35</calc>")[0] == "<result>420</result>"  # a call, but not the question's
  assert env.step("420") == ("", 0.0, True, {"correct": 0.0, "tool_calls": 1, "tool_correct": 0.0})
  env.reset(dict(EX))
  assert env.step("<calc>__import__('os')</calc>")[1:3] == (0.0, True)  # not a call: a (wrong) final answer
  assert tool_calc.evaluate_expr("2**10") is None and tool_calc.evaluate_expr("7 * 6") == 42
  # Answers int() cannot read are wrong answers, not environment errors (before: ValueError for both).
  for wrong in ("--408", "4²"):
    env.reset(dict(EX))
    assert env.step(wrong) == ("", 0.0, True, {"correct": 0.0, "tool_calls": 0, "tool_correct": 0.0})
  # The transcript's turn markers between the tool result and the answer (before: 0.0, the answer read as a marker).
  transcript = "<calc>12*34</calc><|im_end|>\n<|im_start|>user\n<result>408</result><|im_end|>\n<|im_start|>" \
               "assistant\n408"
  assert tool_calc.verify(transcript, EX) == 1.0 and tool_calc.verify(transcript[:-1] + "9", EX) == 0.0


def test_calc_operands_have_max_operands_digit_count():
  """Before: the lower bound was (max_operand + 1) // 10, right for 99 only: 150 drew 15-150."""
  for top, low in ((9, 1), (99, 10), (150, 100), (50, 10)):
    cfg = tasks.TaskConfig(name="tool_calc", max_operand=top, ops="+", n_train=80, n_heldout=1)
    operands = [int(x) for e in tasks.make_split(cfg, "train") for x in e["expr"].split("+")]
    assert min(operands) >= low and max(operands) <= top and min(operands) < low + 5, (top, min(operands))


def test_calc_task_split_is_seeded_and_disjoint():
  cfg = tasks.TaskConfig(name="tool_calc", max_operand=999, ops="*", n_train=200, n_heldout=50)
  train, held = tasks.make_split(cfg, "train"), tasks.make_split(cfg, "heldout")
  assert train == tasks.make_split(cfg, "train")
  assert not {e["prompt"] for e in train} & {e["prompt"] for e in held}
  for e in train[:20]:
    assert tool_calc.evaluate_expr(e["expr"]) == int(e["answer"]) and e["prompt"] == e["expr"] + "="
  tool_share = sum(len(e["demo_turns"]) == 2 for e in train) / len(train)
  assert 0.1 < tool_share < 0.4


# ---------------------------------------------------------------- chat rendering vs transformers

# Qwen2-style: ChatML with a default system turn; tool results as user turns in <tool_response>.
QWEN2 = (
  "{% for m in messages %}"
  "{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
  "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
  "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
  "{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-style: assistant turns after the last user query keep their reasoning in <think> blocks,
# earlier ones lose it; consecutive tool results share one user turn.
QWEN3 = (
  "{%- set ns = namespace(last_query=messages|length - 1) %}"
  "{%- for m in messages[::-1] %}{%- set i = messages|length - 1 - loop.index0 %}"
  "{%- if ns.last_query == messages|length - 1 and m.role == 'user' %}{%- set ns.last_query = i %}{%- endif %}"
  "{%- endfor %}"
  "{%- for m in messages %}"
  "{%- if m.role == 'user' or m.role == 'system' %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
  "{%- elif m.role == 'assistant' %}"
  "{%- set content = m.content %}{%- set reasoning = '' %}"
  "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
  "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
  "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
  "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
  "{%- else %}{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
  "{%- elif m.role == 'tool' %}"
  "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
  "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
  "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
  "{%- endif %}{%- endfor %}"
  "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama-3-style: header markers, a BOS, trimmed contents, <|eot_id|> ends every turn.
LLAMA3 = (
  "{{- bos_token }}"
  "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TEMPLATES = {
  "qwen2": (QWEN2, tk.CHAR_SPECIAL_TOKENS, "<bos>", "<|im_end|>", "tool"),
  "qwen3": (QWEN3, tk.CHAR_SPECIAL_TOKENS, "<bos>", "<|im_end|>", "tool"),
  "llama3": (LLAMA3, HEADER_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", "ipython"),
}


def _tokenizers(tmp_path, name):
  template, specials, bos, eos, role = TEMPLATES[name]
  tk.save_tokenizer_dir(tmp_path, tk.build_char_tokenizer(special_tokens=specials), chat_template=template,
                        bos_token=bos, eos_token=eos, pad_token="<pad>", unk_token="<unk>")
  return tk.Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path)), role


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("role", ["user", "tool"])
def test_episode_tokens_render_as_transformers_renders_the_conversation(tmp_path, name, role):
  """prompt + model turns (as sampled) + replies (tokenized once) == apply_chat_template's ids for the
  same messages, with the generation prompt, after every reply; model turns end at a stop string
  (no EOS) or at EOS."""
  ours, ref, tool_role = _tokenizers(tmp_path, name)
  role = tool_role if role == "tool" else role
  eos = ours.eos_token_ids[0]
  msgs = [{"role": "user", "content": "12*34="}]
  ids = first_prompt(ours, "12*34=", chat=True)
  turns = [("<calc>12*34</calc>", False, "<result>408</result>"), ("I think 408", True, "Sure?"),
           ("<calc>408+0</calc>", False, "<result>408</result>")]
  for text, with_eos, obs in turns:
    ids += ours.encode(text) + ([eos] if with_eos else [])  # what the model sampled
    ids += reply_ids(ours, msgs, text, obs, role=role, ended_with=ours.eos_token if with_eos else "")
    msgs += [{"role": "assistant", "content": text}, {"role": role, "content": obs}]
    want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == want, f"{name}: episode ids differ from transformers after {len(msgs)} messages"
    assert ours.decode(ids, skip_special_tokens=False) == ref.apply_chat_template(msgs, tokenize=False,
                                                                                  add_generation_prompt=True)


def test_reply_after_eos_starts_with_the_next_role_marker(tmp_path):
  ours, _, _ = _tokenizers(tmp_path, "qwen2")
  msgs = [{"role": "user", "content": "q"}]
  tail = "\n<|im_start|>user\nr<|im_end|>\n<|im_start|>assistant\n"
  assert reply_text(ours, msgs, "a", "r", ended_with="<|im_end|>") == tail
  assert reply_text(ours, msgs, "a", "r") == "<|im_end|>" + tail
  # A turn that ended on another special token (a base model's EOS): the template's marker still closes it.
  # Before, this raised and the episode was scored as an environment error.
  assert reply_text(ours, msgs, "a", "r", ended_with="<eos>") == "<|im_end|>" + tail


def test_warmup_demonstrations_mask_the_environment_tokens(tmp_path):
  ours, _, _ = _tokenizers(tmp_path, "qwen2")
  ex = tool_calc.make_example(12, "*", 34, use_tool=True)
  [(prompt, resp, mask)] = demonstrations(ours, env_lib.resolve("calc"), [ex], resp_len=200)
  assert prompt == ours.apply_chat_template_ids([{"role": "user", "content": "12*34="}])
  text = ours.decode(resp, skip_special_tokens=False)
  assert text == "<calc>12*34</calc><|im_end|>\n<|im_start|>user\n<result>408</result><|im_end|>\n" \
                 "<|im_start|>assistant\n408<|im_end|>"
  model = ours.decode([t for t, m in zip(resp, mask, strict=True) if m], skip_special_tokens=False)
  assert model == "<calc>12*34</calc>408<|im_end|>"
  # A user's environment that raises or returns the wrong shape in the warm-up (a new user's trial): before, a
  # 25-line traceback, or "not enough values to unpack (expected 4, got 3)", naming neither environment nor example.
  calc = env_lib.resolve("calc")
  raising = lambda: types.SimpleNamespace(reset=lambda ex: 1 / 0, step=calc().step)  # noqa: E731
  short = lambda: types.SimpleNamespace(reset=calc().reset, step=lambda text: ("x", 1.0, False))  # noqa: E731
  for make_env, says in ((raising, "ZeroDivisionError: division by zero"),
                         (short, r"TypeError: step must return \(observation, reward, done, info\), got \('x', ")):
    with pytest.raises(ValueError, match=r"^env.fn=mine:Env: the warm-up's demonstration of example 0 \('12\*34="
                                         rf"'\) failed: {says}"):
      demonstrations(ours, make_env, [ex], resp_len=200, name="mine:Env")


def test_a_long_reset_keeps_its_last_tokens_and_an_empty_reply_is_an_env_error(tmp_path, caplog):
  """Found by a helper's review: a reset observation over data.max_prompt_len reached the engine and stopped the
  run ('prompt 219 + max_new_tokens 32 > max_len 96'); an empty observation without a chat template is no tokens,
  and the engine refused the reply (run stopped). Now the prompt keeps its last max_prompt_len tokens, as
  data.overlong="truncate" does (counted), and a reply of no tokens ends the episode as an environment error."""
  tok, _, _ = _tokenizers(tmp_path, "qwen2")
  turns = EnvTurns(EnvPool("envs_for_tests:LongResetEmptyReply", n_workers=0), tok, chat=False, error_score=-1.0,
                   max_prompt_len=16)
  [got], info = turns.prepare([{"prompt": "1+1=", "answer": "2", "prompt_ids": tok.encode("1+1=")}])
  assert info == {"env/reset_errors": 0, "env/reset_truncated": 1}
  assert got["prompt_ids"] == tok.encode("y" * 200)[-16:]
  turns.add("t", [got], 1)
  turns.submit(("t", 0, 0), types.SimpleNamespace(tokens=tok.encode("ab")), 0)
  assert _replies(turns) == [(("t", 0, 0), None, "env_error")]
  assert turns.episodes[("t", 0, 0)].ret == -1.0
  # The console says so, as for a failing reward function (a new user's trial: only metrics.jsonl counted it).
  with caplog.at_level(logging.WARNING):
    sample = types.SimpleNamespace(tokens=tok.encode("ab"), turns=1, finish_reason="env_error")
    returns, info = turns.take("t", [sample])
  assert returns.tolist() == [-1.0] and info["env/errors"] == 1
  assert "environment: 1 of 1 episodes failed (1 errors, 0 timeouts; the last: its observation rendered as no " \
         "tokens" in caplog.text, caplog.text


def _replies(turns, timeout_s: float = 30.0) -> list:
  deadline, out = time.monotonic() + timeout_s, []
  while not out and time.monotonic() < deadline:
    out = turns.poll(block=True)
  return out
