"""Built-in synthetic tasks with verifiable answers, and the batch reward function that scores them.

Each task draws examples `{"prompt", "answer", "task", ...}` from a seeded generator, so a run needs no
data files. Formats are short enough for the tiny char-level demo model (one token per character):

  arithmetic  "3+5="          -> "8"       a op b, operands 0..max_operand, op from `ops` ("+-*")
  countdown   "3 5 7 -> 22="  -> "3*5+7"   any expression over + - * / and the given numbers (each at
                                           most once) that equals the target; numbers are listed sorted
  reversal    "reverse abcd=" -> "dcba"    the string reversed; `length` characters from `alphabet`

Splits: the generator draws distinct prompts in one stream, held-out first, then train, so the two
are disjoint by prompt, the held-out set does not change when `n_train` does, and a larger `n_train`
extends a smaller one. A task space too small for `n_train + n_heldout` raises at generation.

Answer rule (what the model must learn): the answer is the completion up to its first newline (or
its end), with surrounding whitespace stripped; see `extract_answer`. Generation normally stops at
EOS, which decodes to nothing, so "8", " 8\n" and "8\nanything" all answer "8".

Scores are 1.0 (correct) or 0.0. Countdown completions are parsed with `ast` and walked by hand:
only integer literals, + - * / and parentheses are accepted; any other node (names, calls,
attributes, unary minus, ...) scores 0 without anything being evaluated. Division must be exact
(7/2 scores 0), as in the Countdown game.

This module must not import jax: `task_reward` runs inside reward worker processes.
"""

import ast
import collections
import dataclasses
import operator
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_topo.data import tool_calc

TASK_NAMES = ("arithmetic", "countdown", "reversal", "tool_calc")
ARITHMETIC_OPS = "+-*"
_MAX_COUNTDOWN_CHARS = 256  # a longer completion cannot be an expression over a handful of numbers


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
  """A built-in task and its split sizes; knobs a task does not use are ignored."""

  name: str  # one of TASK_NAMES
  seed: int = 0  # generation seed: same seed, same examples in the same order
  n_train: int = 80  # training prompts
  n_heldout: int = 20  # held-out prompts, disjoint from train by prompt text
  max_operand: int = 9  # arithmetic: operands 0..max_operand; countdown: numbers 1..max_operand
  ops: str = "+"  # arithmetic: operators to draw from, a subset of "+-*"
  n_numbers: int = 3  # countdown: numbers given per prompt
  length: int = 4  # reversal: characters per string
  alphabet: str = string.ascii_lowercase  # reversal: characters to draw from

  def __post_init__(self):
    if self.name not in TASK_NAMES:
      raise ValueError(f"Unknown task {self.name!r}; built-in tasks are {TASK_NAMES}.")
    if self.n_train < 0 or self.n_heldout < 0 or self.n_train + self.n_heldout == 0:
      raise ValueError(f"Need n_train, n_heldout >= 0 and not both 0, got {self.n_train=}, {self.n_heldout=}.")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}.")
    if self.max_operand < 1:
      raise ValueError(f"max_operand must be >= 1, got {self.max_operand}.")
    if not self.ops or set(self.ops) - set(ARITHMETIC_OPS) or len(set(self.ops)) != len(self.ops):
      raise ValueError(f"ops must be distinct characters from {ARITHMETIC_OPS!r}, got {self.ops!r}.")
    if self.n_numbers < 2:
      raise ValueError(f"countdown needs n_numbers >= 2, got {self.n_numbers}.")
    if self.length < 1:
      raise ValueError(f"length must be >= 1, got {self.length}.")
    if not self.alphabet or len(set(self.alphabet)) != len(self.alphabet) or any(c.isspace() for c in self.alphabet):
      raise ValueError(f"alphabet must be distinct non-whitespace characters, got {self.alphabet!r}.")


def extract_answer(completion: str) -> str:
  """The answer a completion gives: its text before the first newline, stripped of whitespace."""
  return completion.split("\n", 1)[0].strip()


# ---------------------------------------------------------------------------------------------------
# Generators: one example per draw, or None when the draw is rejected (countdown only).


def _arithmetic(cfg: TaskConfig, rng: np.random.Generator) -> dict[str, Any]:
  a, b = (int(x) for x in rng.integers(0, cfg.max_operand + 1, size=2))
  op = cfg.ops[int(rng.integers(len(cfg.ops)))]
  value = {"+": a + b, "-": a - b, "*": a * b}[op]
  return {"prompt": f"{a}{op}{b}=", "answer": str(value), "task": "arithmetic"}


def _combine(left: tuple[str, int, int], right: tuple[str, int, int], op: str) -> tuple[str, int, int] | None:
  """(text, value, precedence) of `left op right` with minimal parentheses; None if not a positive int."""
  (ls, lv, lp), (rs, rv, rp) = left, right
  prec = 1 if op in "+-" else 2
  if op == "/" and lv % rv:  # rv > 0: every node is a positive int
    return None
  value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv // rv}[op]
  if value <= 0:
    return None
  ls = f"({ls})" if lp < prec else ls
  rs = f"({rs})" if rp < prec or (rp == prec and op in "-/") else rs  # a-(b+c), a/(b*c)
  return f"{ls}{op}{rs}", value, prec


def _countdown(cfg: TaskConfig, rng: np.random.Generator) -> dict[str, Any] | None:
  """A random expression tree over a random subset (>= 2) of the numbers; its value is the target."""
  numbers = sorted(int(x) for x in rng.integers(1, cfg.max_operand + 1, size=cfg.n_numbers))
  k = int(rng.integers(2, cfg.n_numbers + 1))
  nodes = [(str(v), v, 3) for v in (numbers[i] for i in rng.permutation(cfg.n_numbers)[:k])]
  while len(nodes) > 1:
    i, j = (int(x) for x in rng.choice(len(nodes), size=2, replace=False))
    node = _combine(nodes[i], nodes[j], "+-*/"[int(rng.integers(4))])
    if node is None:
      return None  # rejected draw: negative, zero or inexact intermediate
    nodes = [n for m, n in enumerate(nodes) if m not in (i, j)] + [node]
  expr, target, _ = nodes[0]
  return {"prompt": f"{' '.join(map(str, numbers))} -> {target}=", "answer": expr, "task": "countdown",
          "numbers": numbers, "target": target}


def _reversal(cfg: TaskConfig, rng: np.random.Generator) -> dict[str, Any]:
  s = "".join(cfg.alphabet[int(i)] for i in rng.integers(len(cfg.alphabet), size=cfg.length))
  return {"prompt": f"reverse {s}=", "answer": s[::-1], "task": "reversal"}


def _tool_low(cfg: TaskConfig) -> int:
  return 10 ** (len(str(cfg.max_operand)) - 1)  # 99 -> 10, 150 -> 100: operands with max_operand's digit count


def _tool_calc(cfg: TaskConfig, rng: np.random.Generator) -> dict[str, Any]:
  """tool_calc.py: a op b with operands of max_operand's digit count, for the calculator environment."""
  a, b = (int(x) for x in rng.integers(_tool_low(cfg), cfg.max_operand + 1, size=2))
  op = cfg.ops[int(rng.integers(len(cfg.ops)))]
  return tool_calc.make_example(a, op, b, bool(rng.random() < tool_calc.TOOL_DEMO_P))


_GENERATORS: dict[str, Callable[[TaskConfig, np.random.Generator], dict[str, Any] | None]] = {
  "arithmetic": _arithmetic, "countdown": _countdown, "reversal": _reversal, "tool_calc": _tool_calc}


def _space_size(cfg: TaskConfig) -> int | None:
  """Number of distinct prompts a task can produce, where that is a simple product; else None."""
  if cfg.name == "arithmetic":
    return (cfg.max_operand + 1) ** 2 * len(cfg.ops)
  if cfg.name == "reversal":
    return len(cfg.alphabet) ** cfg.length
  if cfg.name == "tool_calc":
    return (cfg.max_operand - _tool_low(cfg) + 1) ** 2 * len(cfg.ops)
  return None


@dataclasses.dataclass(frozen=True)
class _Drawn:
  heldout: list[dict[str, Any]]
  train: list[dict[str, Any]]


def _draw(cfg: TaskConfig) -> _Drawn:
  """Distinct prompts from one seeded stream: held-out first, then train."""
  need = cfg.n_train + cfg.n_heldout
  space = _space_size(cfg)
  if space is not None and need > space:
    raise ValueError(f"Task {cfg.name!r} has only {space} distinct prompts with {cfg}; n_train + n_heldout = "
                     f"{need}. Lower the sizes or widen the task (max_operand, ops, length, alphabet).")
  rng = np.random.default_rng(cfg.seed)
  generate, seen, examples = _GENERATORS[cfg.name], set(), []
  max_draws = 20 * need + 1000  # covers coupon collecting of a full space: need * ln(need) draws
  for _ in range(max_draws):
    example = generate(cfg, rng)
    if example is not None and example["prompt"] not in seen:
      seen.add(example["prompt"])
      examples.append(example)
      if len(examples) == need:
        return _Drawn(heldout=examples[:cfg.n_heldout], train=examples[cfg.n_heldout:])
  raise ValueError(f"Task {cfg.name!r} gave only {len(examples)} distinct prompts in {max_draws} draws, fewer "
                   f"than n_train + n_heldout = {need}: the task space is too small. Lower the sizes or widen the "
                   f"task (max_operand, n_numbers).")


def make_split(cfg: TaskConfig, split: str) -> list[dict[str, Any]]:
  """The `split` ("train" or "heldout") examples of a task, deterministic given `cfg`."""
  if split not in ("train", "heldout"):
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}.")
  return getattr(_draw(cfg), split)


# ---------------------------------------------------------------------------------------------------
# Verifiers: (completion, example) -> 1.0 or 0.0.


class _Invalid(Exception):
  """A countdown expression outside the allowed grammar, or one that breaks a rule."""


def _exact_div(a: int, b: int) -> int:
  if b == 0 or a % b:
    raise _Invalid("division by zero or not exact")
  return a // b


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _exact_div}


def _literals(node: ast.AST) -> list[int]:
  """The integer literals of an expression tree; raises _Invalid on any node outside the grammar."""
  if isinstance(node, ast.Constant) and type(node.value) is int:  # not bool, float or str
    return [node.value]
  if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
    return _literals(node.left) + _literals(node.right)
  raise _Invalid(f"disallowed syntax: {type(node).__name__}")


def _evaluate(node: ast.AST) -> int:
  """Value of a tree that `_literals` accepted, in exact integer arithmetic."""
  if isinstance(node, ast.Constant):
    return node.value
  return _BINOPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))


def _verify_countdown(completion: str, example: Mapping[str, Any]) -> float:
  text = extract_answer(completion)
  if not text or len(text) > _MAX_COUNTDOWN_CHARS:
    return 0.0
  try:
    tree = ast.parse(text, mode="eval").body  # parsing runs nothing
    used = collections.Counter(_literals(tree))  # grammar check before any arithmetic
    if used - collections.Counter(int(n) for n in example["numbers"]):
      return 0.0  # a number not given, or one used more often than given
    return float(_evaluate(tree) == int(example["target"]))
  except (SyntaxError, ValueError, RecursionError, MemoryError, _Invalid):
    return 0.0


def _verify_exact(completion: str, example: Mapping[str, Any]) -> float:
  return float(extract_answer(completion) == str(example["answer"]).strip())


# "exact" scores any dataset whose rows carry "task": "exact" and a reference "answer".
VERIFIERS: dict[str, Callable[[str, Mapping[str, Any]], float]] = {
  "arithmetic": _verify_exact, "countdown": _verify_countdown, "reversal": _verify_exact, "exact": _verify_exact,
  "tool_calc": tool_calc.verify}


def verify(task: str, completion: str, example: Mapping[str, Any]) -> float:
  """1.0 if `completion` (raw generated text) solves `example` of `task`, else 0.0."""
  if task not in VERIFIERS:
    raise ValueError(f"No verifier for task {task!r}; known: {sorted(VERIFIERS)}.")
  return VERIFIERS[task](completion, example)


def task_reward(prompts: Sequence[str], completions: Sequence[str],
                metadata: Sequence[Mapping[str, Any]]) -> list[float]:
  """Batch reward: metadata[i] holds example i's fields ("task", "answer"; countdown adds "numbers", "target").

  A prompt batch item from data/pipeline.py works as metadata as it is. `prompts` is unused: the
  verifiers read everything from metadata.
  """
  if not len(prompts) == len(completions) == len(metadata):
    raise ValueError(f"Length mismatch: {len(prompts)} prompts, {len(completions)} completions, "
                     f"{len(metadata)} metadata.")
  rewards = []
  for i, (completion, meta) in enumerate(zip(completions, metadata, strict=True)):
    if "task" not in meta:
      raise ValueError(f"metadata[{i}] has no 'task' field (keys: {sorted(meta)}); add one per row, e.g. "
                       f"'exact' for exact-match against 'answer'.")
    rewards.append(verify(meta["task"], completion, meta))
  return rewards
