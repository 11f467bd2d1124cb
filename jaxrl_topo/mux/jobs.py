"""The mux launcher's job arguments: `path[:arg][,key=value,...]` per job, `--config.key=value` for every job."""

from __future__ import annotations

import ast
import os
from collections.abc import Sequence

from jaxrl_topo.cli import UserError


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """(argv without the `--config.k=v` arguments, those `k=v`): they apply to every job."""
  rest, common = [], []
  for a in argv:
    if a.startswith("--config."):
      if "=" not in a:
        raise UserError(f"{a}: write --config.key=value")
      common.append(a[len("--config."):])
    else:
      rest.append(a)
  return rest, common


def _value(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text  # a bare string


def apply_override(config, item: str) -> None:
  """`a.b.c=value` into a locked ConfigDict; an unknown key is rejected with the config's message."""
  key, _, text = item.partition("=")
  if not key or not _:
    raise UserError(f"override {item!r}: expected key=value")
  *path, last = key.split(".")
  node = config
  try:
    for p in path:
      node = node[p]
    node[last] = _value(text)
  except (KeyError, AttributeError, TypeError) as e:
    raise UserError(f"override {item!r}: {e}") from None


def parse_job(spec: str, common: Sequence[str], index: int):
  """(job id, ConfigDict) of `path[:arg][,k=v,...]`, the common overrides first, then the job's own."""
  from jaxrl_topo.runtime.config import config_from_file

  head, *own = spec.split(",")
  path, _, arg = head.partition(":")
  config = config_from_file(path, arg or None)
  for item in [*common, *own]:
    apply_override(config, item)
  return f"{index}-{os.path.splitext(os.path.basename(path))[0]}", config


def check_job(job_id: str, config, workdir: str):
  """The job's RunConfig, after the checks a solo launch makes before its workdir is touched: the config, its
  prompts (`check_data`) and whose run `workdir` holds (`check_workdir`). A failure is a UserError naming the
  job; the launcher checks every job before it writes anything, so nothing is lost to a bad one."""
  from jaxrl_topo.runtime.config import from_config_dict
  from jaxrl_topo.runtime.workdir import check_data, check_workdir

  try:
    cfg = from_config_dict(config)
    check_data(cfg)
    check_workdir(cfg, workdir)
  except (ValueError, OSError) as e:
    raise UserError(f"job {job_id}: {e}") from None
  return cfg
