"""Outcome reward functions for math completions, and `resolve`, which maps a reward name to a function.

The protocol. A reward function scores a whole batch at once:

  fn(prompts: list[str], completions: list[str], metadata: list[dict]) -> list[float]

It returns one finite float per item. `metadata[i]` holds item i's dataset fields (for example
{"answer": "42"}). A function scores a batch rather than one item so that it can share set-up
across the batch: a compiled regex, a sandbox, one call to a verifier.

Functions are named by strings: "pkg.module:fn", or one of the built-in names in `BUILTINS`. The
`RewardPool` sends these strings to worker processes, which resolve them again there. A function
therefore needs only to be importable: it need not be picklable. This module imports neither jax
nor numpy, so a worker that imports it starts quickly and never starts a JAX runtime.

Answer matching works in two steps. `extract_answer` finds the final answer in a completion: the
last \\boxed{...}, else "#### x", else "The answer is x", else the last number. `answers_equal`
then compares two answers exactly as numbers (fractions.Fraction, so 0.5 == 1/2 == \\frac{1}{2}),
and falls back to a normalised string comparison. The matching is deliberately simple; it does
not handle symbolic equivalence, for example 2\\sqrt{2} against \\sqrt{8}.
"""

import importlib
import inspect
import os
import re
import sys
from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import Protocol


class RewardFn(Protocol):

  def __call__(self, prompts: list[str], completions: list[str], metadata: list[dict]) -> list[float]:
    ...


# Built-in names -> import paths. These are strings, so that "task" is not imported until someone asks for it.
BUILTINS = MappingProxyType({
    "math_answer": "jaxrl_topo.envs.rewards:math_answer",
    "format": "jaxrl_topo.envs.rewards:format_reward",
    "task": "jaxrl_topo.data.tasks:task_reward",
})

_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")  # what follows "####" on its line
_ANSWER_PHRASE = re.compile(r"(?:answer\s+is|answer\s*:)[\s:]*([^\n]*)", re.IGNORECASE)
# A number: optional sign (not after a word character, so "x-4" gives 4), thousands commas, decimals, a/b.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|\.\d+)")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_WRAPPERS = ("\\text{", "\\textbf{", "\\mathrm{", "\\mbox{", "\\boxed{")
_DECIMAL = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_RATIO = re.compile(r"(-?\d+)/(-?\d+)")
_FRAC = re.compile(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}")
_FRAC_SHORT = re.compile(r"(-?)\\frac(\d)(\d)")  # \frac12
_PATH = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def _boxed_contents(text: str) -> list[str]:
  """Contents of the top-level, brace-balanced \\boxed{...} groups, in order. An unclosed group is skipped."""
  out, pos = [], 0
  while (m := _BOXED.search(text, pos)) is not None:
    depth, i = 1, m.end()
    while i < len(text) and depth:
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      i += 1
    if depth:  # unclosed: look for a later, complete group
      pos = m.end()
      continue
    out.append(text[m.end():i - 1])
    pos = i
  return out


def _clean(answer: str) -> str | None:
  """Strips $ signs, surrounding space and markdown bold, a trailing full stop, and thousands commas."""
  s = answer.replace("\\$", "").replace("$", "")
  while (t := s.strip().strip("*").strip().rstrip(".")) != s:  # in any order: "**42**." and "**42.**" alike
    s = t
  s = _THOUSANDS_COMMA.sub("", s)
  return s or None


def extract_answer(text: str) -> str | None:
  """The final answer of a math completion, or None if there is none.

  In order of preference: the content of the last complete \\boxed{...} (nested braces are fine);
  else the rest of the line after the last "####"; else what follows the last "answer is" or
  "Answer:"; else the last number in the text. Examples: "so \\boxed{\\frac{1}{2}}." -> "\\frac{1}{2}",
  "#### $1,234." -> "1234", "The answer is 42." -> "42", "3 + 4 = 7" -> "7", "no idea" -> None, and a box
  never closed (cut off at the length limit) -> None: "so 2 / 2 = \\boxed{1" -> None.
  """
  if boxed := _boxed_contents(text):
    return _clean(boxed[-1])
  if _BOXED.search(text):  # a box opened and never closed: the answer was cut off (a number before it is no answer)
    return None
  if (hashes := _HASHES.findall(text)) and (answer := _clean(hashes[-1])):
    return answer
  if (phrases := _ANSWER_PHRASE.findall(text)) and (answer := _clean(phrases[-1])):
    return answer
  if numbers := _NUMBER.findall(text):
    return _clean(numbers[-1])
  return None


def _normalize(answer: str) -> str:
  """A canonical spelling for comparison: no whitespace, lower case, no \\text{} wrapper, \\dfrac -> \\frac."""
  s = answer.strip()
  while s.endswith("}") and (wrapper := next((w for w in _WRAPPERS if s.startswith(w)), None)):
    s = s[len(wrapper):-1].strip()
  for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\!", ""),
                   ("\\,", ""), ("\\;", ""), ("\\ ", ""), ("\\$", ""), ("$", "")):
    s = s.replace(old, new)
  s = re.sub(r"\s+", "", s).rstrip(".")
  s = _THOUSANDS_COMMA.sub("", s).lower()
  return re.sub(r"^[a-z]=", "", s)  # "x=5" -> "5"


def _to_fraction(s: str) -> Fraction | None:
  """The exact value of a normalised number (int, decimal, a/b, \\frac{a}{b}, \\frac12), else None.

  A percent sign is dropped, so "50%" is the number 50: equal to "50", not to "1/2".
  """
  s = s.removesuffix("\\%").removesuffix("%")
  if _DECIMAL.fullmatch(s):
    return Fraction(s)
  if (m := _RATIO.fullmatch(s)) and int(m[2]) != 0:
    return Fraction(int(m[1]), int(m[2]))
  if m := (_FRAC.fullmatch(s) or _FRAC_SHORT.fullmatch(s)):
    num, den = _to_fraction(m[2]), _to_fraction(m[3])
    if num is not None and den:
      return -num / den if m[1] else num / den
  return None


def answers_equal(pred: str | None, ref: str) -> bool:
  """True if `pred` and `ref` are the same number exactly, or the same string once normalised.

  0.5 == 1/2 == \\frac{1}{2} == \\dfrac{1}{2} == 0.50; -3 == -3.0; "1,000" == 1000; 1/3 != 0.33;
  "50\\%" == 50 but != 0.5. Strings compare without whitespace, case-insensitively, with a
  surrounding \\text{...} removed: "\\text{Yes}" == "yes". An empty answer equals nothing.
  """
  if pred is None:
    return False
  a, b = _normalize(str(pred)), _normalize(str(ref))
  if not a or not b:
    return False
  fa, fb = _to_fraction(a), _to_fraction(b)
  if fa is not None and fb is not None:
    return fa == fb
  return a == b


def _check_batch(prompts: list[str], completions: list[str], metadata: list[dict]) -> int:
  if not len(prompts) == len(completions) == len(metadata):
    raise ValueError(f"batch lengths differ: {len(prompts)} prompts, {len(completions)} completions, "
                     f"{len(metadata)} metadata")
  return len(completions)


def math_answer(prompts: list[str], completions: list[str], metadata: list[dict]) -> list[float]:
  """1.0 where `extract_answer(completion)` equals `metadata[i]["answer"]` (see `answers_equal`), else 0.0.

  A GSM8K-style reference (a worked solution ending in "#### 72") is reduced to what follows "####".
  """
  _check_batch(prompts, completions, metadata)
  scores = []
  for i, (completion, meta) in enumerate(zip(completions, metadata, strict=True)):
    if "answer" not in meta:
      raise KeyError(f"math_answer: metadata[{i}] has no 'answer' field (keys: {sorted(meta)})")
    ref = str(meta["answer"])
    if "####" in ref:
      ref = ref.rsplit("####", 1)[1].strip()
    scores.append(float(answers_equal(extract_answer(completion), ref)))
  return scores


def format_reward(prompts: list[str], completions: list[str], metadata: list[dict]) -> list[float]:
  """1.0 where the completion states one final answer in a recognised form, else 0.0.

  Recognised: exactly one complete, non-empty top-level \\boxed{...}, or exactly one "####" followed on
  its line by an answer ("#### 72"). Two boxes, an empty or unclosed box, or a bare "####" score 0.
  Correctness is not checked: pair it with `math_answer`.
  """
  _check_batch(prompts, completions, metadata)
  scores = []
  for completion in completions:
    boxed = _boxed_contents(completion)
    one_box = len(boxed) == 1 and bool(boxed[0].strip())
    hashes = _HASHES.findall(completion)
    scores.append(float(one_box or (len(hashes) == 1 and bool(hashes[0].strip()))))
  return scores


def resolve(path: str, what: str = "reward", builtins: Mapping[str, str] | None = None,
            args: tuple[str, ...] = ("prompts", "completions", "metadata")) -> RewardFn:
  """The reward function named by a built-in name (`BUILTINS`) or an import path "pkg.module:fn"; `what` names
  the setting in errors, `builtins` replaces BUILTINS (environments: envs/env.py), `args` names the positional
  arguments it is called with (an environment factory: none); a signature that cannot take them is refused.

  The attribute may be dotted ("pkg.module:Class.method"). Modules are found on sys.path and in
  the current directory (`my_reward.py` where you run the launcher is "my_reward:fn"). Raises
  ValueError, naming the path, for a malformed path, a module that is missing or fails to import,
  a missing attribute, or an object that is not callable.
  """
  builtins = BUILTINS if builtins is None else builtins
  if not isinstance(path, str):
    raise ValueError(f"{what} must be a name or an import path string, got {type(path).__name__}: {path!r}")
  target = builtins.get(path, path)
  what = f"{what} {path!r}" + (f" ({target})" if target != path else "")
  if (m := _PATH.fullmatch(target)) is None:
    raise ValueError(f"{what}: expected a built-in name ({', '.join(builtins)}) or an import path "
                     "'pkg.module:fn'")
  module_name, attr = m.groups()
  if os.getcwd() not in sys.path and "" not in sys.path:  # a reward module beside the user, as `python -c` finds it
    sys.path.append(os.getcwd())
  try:
    obj = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
      raise ValueError(f"{what}: no module named {module_name!r}") from e
    raise ValueError(f"{what}: importing {module_name!r} failed: {e}") from e
  except Exception as e:
    raise ValueError(f"{what}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"{what}: module {module_name!r} has no attribute {attr!r}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise ValueError(f"{what}: {target} is a {type(obj).__name__}, not a callable")
  try:
    sig = inspect.signature(obj)
  except (TypeError, ValueError):  # some builtins have none: then the first call says
    return obj
  try:
    sig.bind(*args)
  except TypeError as e:  # before: found at the first scoring call, after the warm-up
    raise ValueError(f"{what}: {target}{sig} cannot be called as {attr}({', '.join(args)}): {e}") from None
  return obj

