"""Where a review may write: `check_out(out, workdir)` refuses, before anything is read or written, an --out that
is a file, a run's workdir or one of its own folders (checkpoints/, tb/, ...: files there make train.py --fresh
refuse the workdir), a multiplexed group's directory or a model directory. A new folder, an earlier review's,
or one inside a run beside its own files (README: --out=runs/grpo/review) is fine.

The run and model checks are runtime/workdir.py's (export.py and generate.py refuse with the same ones).
"""

from __future__ import annotations

import os

_ELSEWHERE = "nothing was read or written: name a new directory for the record"


def check_out(out: str, workdir: str | None = None, flag: str = "--out") -> None:
  """Raises ValueError (one line) when the review cannot write record.md, record.json and its PNGs into `out`."""
  from jaxrl_topo.models import hf_io
  from jaxrl_topo.runtime import workdir as workdir_lib

  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f"{flag}={out} is a file, not a directory; {_ELSEWHERE} (made if missing)")
  real = os.path.realpath(out)
  run, folder = workdir_lib.run_around(real)
  if run is not None:
    raise ValueError(f"{flag}={out} is inside the run {run}'s own {folder}/: writing there would damage the run; "
                     f"{_ELSEWHERE}, e.g. {flag}={os.path.join(run, 'review')}")
  if os.path.isfile(os.path.join(out, workdir_lib.MUX_SPANS)):
    raise ValueError(f"{flag}={out} is a multiplexed group's directory (launchers/mux.py); {_ELSEWHERE}")
  if _is_run(out) or (workdir is not None and real == os.path.realpath(workdir)):
    raise ValueError(f"{flag}={out} is a run's workdir: the record would go in among the run's own files; "
                     f"{_ELSEWHERE}, e.g. {flag}={os.path.join(out, 'review')}")
  found = workdir_lib.model_files(out) or (["config.json", "*.safetensors"] if hf_io.is_model_dir(out) else [])
  if found:
    raise ValueError(f"{flag}={out} holds {', '.join(found)}: a model directory; {_ELSEWHERE}")


def _is_run(directory: str) -> bool:
  """Whether `directory` holds a run of launchers/train.py (its identity.json or run config.json, or checkpoints)."""
  from jaxrl_topo.runtime import workdir as workdir_lib

  if not os.path.isdir(directory):
    return False
  return (os.path.isfile(os.path.join(directory, workdir_lib.IDENTITY_FILE))
          or bool(workdir_lib.runs_config(directory)) or workdir_lib.has_run(directory))
