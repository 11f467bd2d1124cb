"""ConfigDict <-> frozen dataclasses, checked: unknown keys get a suggestion, every field is type-checked.

Generic over any dataclass whose fields are plain types, tuples, dicts, unions or nested dataclasses;
`runtime/config.py` applies it to the run's sections.
"""

import dataclasses
import difflib
import functools
import math
import numbers
import types
import typing
from typing import Any

import numpy as np


def plain(value: Any) -> Any:
  """ConfigDict / FrozenConfigDict -> dict, lists -> tuples, recursively."""
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, dict):
    return {k: plain(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return tuple(plain(v) for v in value)
  return value


def _check_type(value: Any, hint: Any, where: str) -> Any:
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    options = typing.get_args(hint)
    if value is None and type(None) in options:
      return None
    errors = []
    for option in options:
      if option is type(None):
        continue
      try:
        return _check_type(value, option, where)
      except (TypeError, ValueError) as e:
        errors.append(str(e))
    raise TypeError(errors[0] if errors else f"{where}: got {value!r}")
  if hint is Any:
    return value
  if origin is dict:
    if not isinstance(value, dict):
      raise TypeError(f"{where} must be a dict, got {type(value).__name__}")
    _, vt = typing.get_args(hint)
    return {k: _check_type(v, vt, f"{where}.{k}") for k, v in value.items()}
  if origin is tuple:
    if not isinstance(value, tuple):
      raise TypeError(f"{where} must be a list/tuple, got {type(value).__name__}")
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_check_type(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    return value
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  wrong = isinstance(hint, type) and (hint is int and isinstance(value, bool) or not isinstance(value, hint))
  if wrong:
    raise TypeError(f"{where} must be {hint.__name__}, got {type(value).__name__} {value!r}")
  return value


def build_dataclass(cls, value: Any, where: str):
  """`cls(**value)` with every key checked (typos get a suggestion) and every field type-checked."""
  value = plain(value)
  if not isinstance(value, dict):
    raise ValueError(f"{where} must be a section (dict), got {type(value).__name__}")
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls) if f.init]
  kwargs = {}
  for key, v in value.items():
    if key not in names:
      close = difflib.get_close_matches(key, names, n=1)
      hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {names}"
      raise ValueError(f"config: unknown key {where}.{key}{hint}")
    hint = hints[key]
    sub = [t for t in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(t)]
    if sub and isinstance(v, dict):
      kwargs[key] = build_dataclass(sub[0], v, f"{where}.{key}")
    else:
      try:
        kwargs[key] = _check_type(v, hint, f"{where}.{key}")
      except TypeError as e:  # a value of the wrong type is the user's error: one line, like a bad value
        raise ValueError(str(e)) from None
  try:
    return cls(**kwargs)
  except TypeError as e:  # a missing required field
    raise ValueError(f"config section {where}: {e}") from None
  except ValueError as e:  # a class's own check, worded for its library users: say which section it is
    if f"{where}." in str(e) or str(e).startswith("config"):
      raise
    raise ValueError(f"config section {where}: {e}") from e


def config_defaults(cls, **required) -> dict:
  """{field: default} of a dataclass: a ConfigDict section that build_dataclass reads back. A `T | None = None`
  field becomes a typed placeholder, so a locked config still accepts `--config.section.field=value` for it
  (ml-collections cannot override a plain None)."""
  from ml_collections import config_dict

  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    if f.name in required:
      out[f.name] = required[f.name]
    elif f.default is None:
      inner = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
      simple = len(inner) == 1 and inner[0] in (str, int, float, bool)
      out[f.name] = config_dict.placeholder(inner[0]) if simple else None
    elif f.default is not dataclasses.MISSING:
      out[f.name] = f.default
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = f.default_factory()
  return out


_RANGES = {">=0": (lambda v: v >= 0, ">= 0"), ">=1": (lambda v: v >= 1, ">= 1"), ">0": (lambda v: v > 0, "> 0"),
           "0..1": (lambda v: 0 <= v <= 1, "in [0, 1]"), "finite": (math.isfinite, "a finite number")}


_SCALARS = (int, float, bool, str)


@functools.cache
def _scalar_hints(cls) -> tuple[tuple[str, type], ...]:
  """(field, type) of a dataclass's fields typed as a plain scalar or an optional one (`int`, `float | None`)."""
  out = []
  for f in dataclasses.fields(cls):
    hint = typing.get_type_hints(cls)[f.name]
    inner = [t for t in (typing.get_args(hint) or (hint,)) if t is not type(None)]
    if f.init and len(inner) == 1 and inner[0] in _SCALARS:
      out.append((f.name, inner[0]))
  return tuple(out)


def _is_a(value, kind: type) -> bool:
  """A Python scalar, or a NumPy one standing for it (np.int64 for int; no bool for a number)."""
  if kind is bool:
    return isinstance(value, bool | np.bool_)
  if kind is str:
    return isinstance(value, str)
  number = numbers.Integral if kind is int else numbers.Real
  return isinstance(value, number) and not isinstance(value, bool | np.bool_)


def check_types(where: str, obj) -> None:
  """Raises ValueError naming `where.field` for the first scalar field of the wrong type: a config built in
  Python skips build_dataclass's checks (`warmup_steps=2.5` would reach the schedule). Call it first in a
  __post_init__, before other checks compare the fields."""
  for name, kind in _scalar_hints(type(obj)):
    value = getattr(obj, name)
    if value is not None and not _is_a(value, kind):
      raise ValueError(f"{where}.{name}={value!r} must be of type {kind.__name__}, not {type(value).__name__}")


def check_ranges(where: str, obj, **rules: str) -> None:
  """check_types, then a ValueError naming `where.field` for the first field outside its rule (">=0", ">=1",
  ">0", "0..1", "finite"); None passes (an optional setting left off). NaN fails every rule."""
  check_types(where, obj)
  for name, rule in rules.items():
    value = getattr(obj, name)
    test, text = _RANGES[rule]
    if value is not None and not test(value):
      raise ValueError(f"{where}.{name}={value!r} must be {text}")
