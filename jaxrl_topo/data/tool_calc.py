"""The calculator tool task: arithmetic too large to do in the head, and an environment with a calculator.

Examples (tasks.py, task "tool_calc"): "a*b=" with operands of max_operand's digit count ([10, 99]
for 99) and an operator from `ops`. The model may call the tool by ending a turn with
`<calc>EXPR</calc>` (EXPR: digits and + - *); the environment answers `<result>VALUE</result>` as
the next user turn. Any other turn is the final answer: its first line, stripped, compared as an
integer (tasks.extract_answer's rule).

Reward: 1.0 for a right final answer, else 0.0. Info per episode: `correct`, `tool_calls`, and
`tool_correct` (1.0 when some call computed exactly the question's expression).

Warm-up demonstrations (`demo_turns`): with probability `TOOL_DEMO_P` per example, the model turns of
a tool-using episode (["<calc>a*b</calc>", "VALUE"]), else a direct answer (["VALUE"]): a supervised
warm-up on them leaves a model that uses the tool sometimes and guesses otherwise, and RL is left to
find that the tool pays. This module imports neither jax nor numpy's random state: environments run
in worker processes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

TOOL_DEMO_P = 0.25  # share of warm-up demonstrations that use the calculator
_CALL = re.compile(r"<calc>([0-9+\-* ]{1,40})</calc>")
_EXPR = re.compile(r"\s*(\d{1,12})\s*([+\-*])\s*(\d{1,12})\s*")


def evaluate_expr(expr: str) -> int | None:
  """a op b for non-negative integers a, b and op in + - *; None for anything else (nothing is eval'd)."""
  m = _EXPR.fullmatch(expr)
  if m is None:
    return None
  a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
  return {"+": a + b, "-": a - b, "*": a * b}[op]


def make_example(a: int, op: str, b: int, use_tool: bool) -> dict[str, Any]:
  expr, value = f"{a}{op}{b}", str(evaluate_expr(f"{a}{op}{b}"))
  demo = [f"<calc>{expr}</calc>", value] if use_tool else [value]
  return {"prompt": f"{expr}=", "answer": value, "task": "tool_calc", "expr": expr, "demo_turns": demo}


def final_answer(text: str) -> str:
  return text.split("\n", 1)[0].strip()


class CalcEnv:
  """The calculator environment (envs/env.py protocol)."""

  def reset(self, example: dict) -> str:
    self.example, self.calls, self.tool_correct = example, 0, 0.0
    self.want = evaluate_expr(example["expr"])
    return example["prompt"]

  def step(self, model_text: str) -> tuple[str, float, bool, dict]:
    m = _CALL.search(model_text)
    if m is not None:
      self.calls += 1
      value = evaluate_expr(m.group(1))
      if value is not None and m.group(1).replace(" ", "") == self.example["expr"]:
        self.tool_correct = 1.0
      return f"<result>{'error' if value is None else value}</result>", 0.0, False, self._info(0.0)
    answer = final_answer(model_text)
    correct = float(re.fullmatch(r"-?[0-9]+", answer) is not None and int(answer) == self.want)  # "--408": wrong
    return "", correct, True, self._info(correct)

  def _info(self, correct: float) -> dict:
    return {"correct": correct, "tool_calls": self.calls, "tool_correct": self.tool_correct}


def verify(completion: str, example: Mapping[str, Any]) -> float:
  """1.0 if the text after the last tool result (or the whole text) answers the example."""
  tail = completion.rsplit("</result>", 1)[-1]
  tail = re.sub(r"^(\s*(<\|im_end\|>|<\|im_start\|>\w*))*\s*", "", tail)  # the turn markers between
  return float(final_answer(tail) == str(example["answer"]))
