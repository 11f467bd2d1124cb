"""The mux launcher's job arguments: `path[:arg][,key=value,...]` per job, `--config.key=value` for every job."""

from __future__ import annotations

import os
from collections.abc import Sequence

from jaxrl_topo.cli import UserError, apply_override, message, unescape_stops


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


def parse_job(spec: str, common: Sequence[str], index: int):
  """(job id, ConfigDict) of `path[:arg][,k=v,...]`, the common overrides first, then the job's own."""
  from jaxrl_topo.runtime.config import config_from_file

  head, *own = spec.split(",")
  path, _, arg = head.partition(":")
  job_id = f"{index}-{os.path.splitext(os.path.basename(path))[0]}"
  try:
    config = config_from_file(path, arg or None)
  except (OSError, ValueError) as e:  # named by the job, as its other errors are
    raise UserError(f"job {job_id} (--job={spec}): {message(e)}") from None
  for item in common:
    apply_override(config, item, f"--config.{item}")
  for i, item in enumerate(own):
    key = item.partition("=")[0]
    if i + 1 < len(own) and (any(item.count(a) != item.count(b) for a, b in ("[]", "()", "{}"))
                             or item.count("'") % 2 or item.count('"') % 2):  # a value cut at a comma
      raise UserError(f"job {job_id}: override {item!r}: a job's own overrides are split at commas, so a value cannot "
                      f"hold one; give it to every job as --config.{key}=... instead, or in the job's config file")
    apply_override(config, item, f"job {job_id}: override {item!r}")
  unescape_stops(config)  # rollout.stop='\n' is a newline, as train.py reads it
  return job_id, config


def check_job(job_id: str, config, workdir: str):
  """The job's RunConfig (a colocated job's as disaggregated, the mode the group runs it in; an async one's as given,
  for `mode_notice`), after the checks a solo launch makes before its workdir is touched: the config, its
  prompts (`check_data`), its LoRA targets (`check_model`), its position limit (`check_positions`) and whose
  run `workdir` holds (`check_workdir`). A failure is a UserError naming the job; the launcher checks every job
  before it writes anything, so nothing is lost to a bad one (`Group.admit` then checks the devices and meshes)."""
  from jaxrl_topo.runtime.config import from_config_dict
  from jaxrl_topo.runtime.preflight import check_data, check_model, check_positions
  from jaxrl_topo.runtime.workdir import check_workdir

  try:
    if config.topology.mode == "colocated":  # checked as the group runs it (spec.on_policy): before, a trainer mesh
      config = config.copy_and_resolve_references()  # of its own was refused as "colocated mode time-shares ..."
      config.topology.mode = "disaggregated"
    cfg = from_config_dict(config)
    if cfg.run.fresh:  # train.py's --fresh; a group never deletes a job's checkpoints
      raise ValueError("run.fresh=True: a group does not start its jobs over; give the group a new --workdir (or "
                       "move this job's folder out of it)")
    check_data(cfg)
    check_model(cfg)
    check_positions(cfg)
    check_workdir(cfg, workdir, where="its folder")
  except (ValueError, OSError) as e:
    raise UserError(f"job {job_id}: {e}") from None
  return cfg


def mode_notice(job_id: str, cfg) -> str | None:
  """The line the launcher prints when a job asked for another mode than the group runs it in: every job runs
  disaggregated and strictly on-policy (eta = 0, mux/spec.py on_policy); colocated, the default, says nothing."""
  if cfg.topology.mode != "async":
    return None
  return (f"note: job {job_id}: topology.mode=async runs disaggregated in a mux group, strictly on-policy "
          f"(run.max_staleness={cfg.run.max_staleness} -> 0)")
