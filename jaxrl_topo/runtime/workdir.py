"""A run's workdir before anything is written to it: whose run it holds, the checks a launch makes first, --fresh.

A workdir's checkpoints (and a preset's init_model/) belong to one run: its identity is the model (preset,
HF directory, overrides, init seed, dtype), the LoRA shape and the data (source, task). `train()` records it in
identity.json and refuses to resume a workdir recorded under another identity, naming what differs; so does the
launcher, which also reads the config.json of runs recorded before identity.json existed. A launch checks its
config first (runtime/preflight.py), and `start_over` (--fresh) runs only after every check has passed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil

from jaxrl_topo.runtime.config import RunConfig

IDENTITY_FILE = "identity.json"
CONFIG_FILE = "config.json"  # the launcher's ConfigDict (run.save_config): export and resume read it
EXPORT_RECORD = "exported_from.json"  # written by export.export beside the model: only such a directory is replaced
# a multiplexed group's (launchers/mux.py) own files
MUX_SPANS, MUX_SUMMARY, MUX_TIMELINE = "mux_spans.jsonl", "mux_summary.json", "mux_timeline.png"
RUN_FILES = ("checkpoints", "init_model", "metrics.jsonl", "histograms.jsonl", "spans.jsonl", "summary.json", "tb",
             "reward_curve.png", CONFIG_FILE, IDENTITY_FILE)
LOCK_FILE = "run.lock"  # held (flock) by the process running the run, its pid inside
RUNS_OWN = (*RUN_FILES, "profile", LOCK_FILE)  # what nothing else may write over (--fresh deletes only RUN_FILES)


def identity(cfg: RunConfig) -> dict:
  """{'section.key': value} of what makes a checkpoint this run's, as JSON would hold it."""
  m, task = cfg.model, cfg.data.task
  ident = {"model.preset": m.preset, "model.hf_dir": m.hf_dir, "model.overrides": dict(m.overrides),
           "model.init_seed": m.init_seed, "model.dtype": m.dtype, "data.source": cfg.data.source,
           "data.task": dataclasses.asdict(task) if task is not None else None,
           **{f"lora.{k}": v for k, v in dataclasses.asdict(cfg.lora).items()}}
  return json.loads(json.dumps(ident))  # tuples -> lists: compares equal to what was read back


def identity_diff(old: dict, new: dict) -> list[str]:
  """'key: old -> new' for every identity key that differs. LoRA's other settings do not count while both have
  lora.rank 0 (no adapters: the same model whatever their alpha or targets)."""
  if old.get("lora.rank") == new.get("lora.rank") == 0:
    old, new = ({k: v for k, v in d.items() if not k.startswith("lora.") or k == "lora.rank"} for d in (old, new))
  return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def config_changes(old: dict, new: dict) -> list[str]:
  """'key: old -> new' (identity_diff's words) for every key of two nested config dicts that differs, run.fresh
  aside."""
  return [d for d in identity_diff(_flat(old), _flat(new)) if not d.startswith("run.fresh:")]


def _flat(d: dict, prefix: str = "") -> dict:
  """{'section.key': leaf} of a nested dict."""
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def has_run(workdir: str) -> bool:
  """Whether `workdir` holds a checkpoint or a preset's init_model/ (something a launch would resume)."""
  init_model = os.path.join(workdir, "init_model", "config.json")
  return latest_checkpoint_step(workdir) is not None or os.path.isfile(init_model)


def recorded_identity(workdir: str) -> dict | None:
  """The identity the workdir's run was recorded under (identity.json, else the launcher's config.json)."""
  path = os.path.join(workdir, IDENTITY_FILE)
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  path = os.path.join(workdir, CONFIG_FILE)
  if os.path.isfile(path):
    from jaxrl_topo.runtime.config import from_config_dict
    with open(path) as f:
      try:
        return identity(from_config_dict(json.load(f)))
      except (ValueError, TypeError) as e:
        raise ValueError(f"{path} does not load ({e}): use a new workdir, or --fresh (run.fresh) to start it "
                         "over") from None
  return None


MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "tokenizer.json")  # a model directory's


def check_not_a_model(cfg: RunConfig, workdir: str, where: str = "--workdir") -> None:
  """Raises ValueError when `workdir` is the run's model or reward model directory, or holds a model's files
  or a config.json that is not a run's: a run writes config.json there, and --fresh or a failed first launch
  deletes it (RUN_FILES), so such a directory is refused before anything is written. `where`: what the message
  calls `workdir` (train.py's flag; `run.train`'s argument "workdir"; a mux job's folder)."""
  if os.path.isfile(workdir):
    raise ValueError(f"{where} {workdir} is a file: name a directory (made if missing)")
  real = os.path.realpath(workdir)
  run, folder = run_around(real)
  if run is not None:  # before: accepted, and the run's own --fresh then refused the files written there
    raise ValueError(f"{where} {workdir} is inside the run {run}'s own {folder}/: a run there would write into "
                     "that run's files; use another directory")
  for key, d in (("model.hf_dir", cfg.model.hf_dir), ("reward.model_dir", cfg.reward.model_dir)):
    if d is not None and os.path.realpath(d) == real:
      raise ValueError(f"{where} {workdir} is {key}: a run writes its own config.json there; use another directory")
  group = [n for n in (MUX_SPANS, MUX_SUMMARY) if os.path.isfile(os.path.join(workdir, n))]
  if group:  # before: accepted, and the group's own relaunch then refused the folder as a train.py run's
    raise ValueError(f"{where} {workdir} is a multiplexed group's directory (it holds {', '.join(group)}; "
                     "launchers/mux.py): a run there would mix its files with the group's; nothing was changed. Use "
                     "another directory (each job of the group runs in its own <i>-<config> folder inside it)")
  found = model_files(workdir)
  if found:
    raise ValueError(f"{where} {workdir} holds {', '.join(found)}: a model directory, not a run's; nothing was "
                     "changed. Use another directory (a run writes its own config.json there)")


def model_files(directory: str) -> list[str]:
  """What marks `directory` as a model's: its MODEL_FILES present, or a config.json that is not a run's."""
  found = [n for n in MODEL_FILES if os.path.exists(os.path.join(directory, n))]
  if not found and runs_config(directory) is False:  # (None: none, or a torn run config: recorded_identity names it)
    found = [CONFIG_FILE + " (not a run's)"]
  return found


def check_not_a_runs_file(path: str, flag: str) -> None:
  """Raises when writing the file `path` would overwrite a run's own files (RUNS_OWN, or inside its folders) or a
  multiplexed group's (launchers/mux.py)."""
  real = os.path.realpath(path)
  run, folder = run_around(real)
  if run is not None:
    raise ValueError(f"{flag}={path} is the run {run}'s own {folder}: writing there would damage the run; nothing "
                     "was written. Name a file elsewhere")
  if os.path.basename(real) in (MUX_SPANS, MUX_SUMMARY, MUX_TIMELINE) and os.path.isfile(
      os.path.join(os.path.dirname(real), MUX_SPANS)):
    raise ValueError(f"{flag}={path} is a multiplexed group's own file; nothing was written. Name a file elsewhere")


def run_around(real: str) -> tuple[str | None, str | None]:
  """(a run's directory, the folder of it) when the real path `real` lies in one of a run's own folders
  (checkpoints/, tb/, init_model/, ...); else (None, None)."""
  path = real
  while os.path.dirname(path) != path:
    parent, name = os.path.dirname(path), os.path.basename(path)
    if name in RUNS_OWN and (os.path.isfile(os.path.join(parent, IDENTITY_FILE)) or runs_config(parent)):
      return parent, name
    path = parent
  return None, None


def runs_config(directory: str) -> bool | None:
  """Whether `directory`'s config.json is a run's (sections "run" and "model"; a model's is not); None when there
  is none, or it is not JSON."""
  try:
    with open(os.path.join(directory, CONFIG_FILE)) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return None
  return isinstance(saved, dict) and "run" in saved and "model" in saved


def latest_checkpoint_step(workdir: str) -> int | None:
  """The newest complete checkpoint's step in `workdir` (orbax names a finished one by its step), or None."""
  ckpts = os.path.join(workdir, "checkpoints")
  steps = [int(n) for n in os.listdir(ckpts) if n.isdigit()] if os.path.isdir(ckpts) else []
  return max(steps, default=None)


def check_workdir(cfg: RunConfig, workdir: str, *, need_record: bool = True, where: str = "--workdir") -> None:
  """Raises ValueError, naming the differences, when `workdir` is a model directory (`check_not_a_model`, whose
  message calls it `where`) or holds another run, or a checkpoint past `run.steps`; nothing is changed. A run
  with no record (`train()` before identity.json) is refused when `need_record`, else trusted."""
  check_not_a_model(cfg, workdir, where)
  if not has_run(workdir):
    return
  latest = latest_checkpoint_step(workdir)
  if latest is not None and latest > cfg.run.steps:
    raise ValueError(f"{workdir} holds a checkpoint at step {latest}, past run.steps={cfg.run.steps}: raise "
                     f"run.steps to continue this run, or {_start_over(where)}; nothing was changed")
  old = recorded_identity(workdir)
  if old is None:
    if need_record:
      raise ValueError(f"{workdir} holds checkpoints but no {CONFIG_FILE} or {IDENTITY_FILE}: {_start_over(where)}")
    return
  diff = identity_diff(old, identity(cfg))
  if diff:
    raise ValueError(f"{workdir} holds another run (it was recorded with {'; '.join(diff)}); nothing was "
                     f"changed: {_start_over(where)}")


def _start_over(where: str) -> str:
  """How a caller that names its directory `where` starts over: train.py has --fresh; `run.train` and a mux
  job do not (their directory is emptied by hand, or by `start_over`)."""
  if where == "--workdir":
    return "use a new --workdir, or --fresh (--config.run.fresh=True) to start this one over (deletes its checkpoints)"
  return "use another directory, or empty this one to start over (deletes its checkpoints)"


def check_export_out(workdir: str, out: str) -> None:
  """Raises, writing nothing, when an export of `workdir` to `out` would overwrite the run or the model it started
  from (`out` is the workdir, anything the run keeps in it, or its config's model.hf_dir) or cannot be written
  (hf_io.check_out_dir: new, empty, or an earlier export to replace: a model directory with EXPORT_RECORD; any
  other model directory is refused). `out=<workdir>/hf` is fine."""
  from jaxrl_topo.models import hf_io

  work, dest = os.path.realpath(workdir), os.path.realpath(out)
  if dest == work:
    raise ValueError(f"--out={out} is the --workdir: the export would overwrite the run's config.json; "
                     f"write it to a new directory, e.g. --out={os.path.join(workdir, 'hf')}")
  inside = os.path.relpath(dest, work).split(os.sep)[0] if dest.startswith(work + os.sep) else None
  if inside in RUNS_OWN:
    raise ValueError(f"--out={out} is the run's own {inside} (in --workdir={workdir}): writing there would "
                     f"damage the run; use e.g. --out={os.path.join(workdir, 'hf')}")
  try:
    with open(os.path.join(workdir, CONFIG_FILE)) as f:
      base = json.load(f).get("model", {}).get("hf_dir")
  except (OSError, ValueError, AttributeError):
    base = None  # export names what is wrong with the config
  if isinstance(base, str) and base and os.path.realpath(base) == dest:
    raise ValueError(f"--out={out} is the model the run started from (model.hf_dir): choose a new directory")
  if hf_io.is_model_dir(out) and not os.path.isfile(os.path.join(out, EXPORT_RECORD)):
    raise FileExistsError(f"--out={out} holds a model that no export wrote (no {EXPORT_RECORD}); nothing was written: "
                          "choose a new directory (an earlier export there would be replaced)")
  hf_io.check_out_dir(out, replace_model=True)



@contextlib.contextmanager
def held(workdir: str):
  """While a run writes in `workdir`: an exclusive flock on <workdir>/run.lock, which holds the process id. A
  second run on the workdir is refused with a ValueError naming that process; the kernel drops the lock when the
  process ends, a kill -9 included, so a file left behind never blocks a relaunch. (Before, two launches on one
  workdir both ran and wrote over each other's checkpoints, metrics and summary.)"""
  os.makedirs(workdir, exist_ok=True)
  f = open(os.path.join(workdir, LOCK_FILE), "a+")  # noqa: SIM115 (held open while the run runs)
  try:
    _lock(f, workdir)
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    yield
  finally:
    f.close()  # releases the lock


def check_not_in_use(workdir: str) -> None:
  """Raises ValueError when a running process holds `workdir`'s run.lock (`held`): e.g. before --fresh deletes the
  run's files under it. Call it outside a process's own `held(workdir)`."""
  path = os.path.join(workdir, LOCK_FILE)
  if os.path.isfile(path):
    with open(path) as f:
      _lock(f, workdir)


def _lock(f, workdir: str) -> None:
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    pid = f.read().strip() or "?"
    raise ValueError(f"{workdir} is in use by another run (process {pid} holds {LOCK_FILE}): wait for it to end, "
                     "stop it, or use another directory; nothing was changed") from None


def write_identity(cfg: RunConfig, workdir: str) -> None:
  """identity.json, replaced whole: another process checking the workdir never reads half a file."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, IDENTITY_FILE)
  with open(path + ".tmp", "w") as f:
    json.dump(identity(cfg), f, indent=2)
  os.replace(path + ".tmp", path)


# What a run writes inside its folders: checkpoints/<step> (orbax; a save in progress is <step>.<suffix>) and
# tb/events.out.tfevents.*. Anything else there is someone else's, and --fresh would delete it with the folder.
_OURS_INSIDE = {"checkpoints": lambda name: name.split(".")[0].isdigit(),
                "tb": lambda name: name.startswith("events.out.tfevents")}


def check_fresh(workdir: str, where: str = "--workdir") -> None:
  """Raises ValueError, naming them, when the folders --fresh deletes hold entries a run does not write (a
  `checkpoints/` of another tool, say): --fresh removes only a run's files, and those would go with it."""
  foreign = [os.path.join(name, entry) for name, ours in _OURS_INSIDE.items()
             if os.path.isdir(os.path.join(workdir, name))
             for entry in sorted(os.listdir(os.path.join(workdir, name))) if not ours(entry)]
  if foreign:
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    raise ValueError(f"{where} {workdir} holds {shown}, which no run writes: --fresh would delete them with their "
                     "folder; nothing was changed. Move them, or use another directory")


def start_over(workdir: str) -> list[str]:
  """--fresh: removes the run's files from `workdir` (nothing else there); returns what went. Refuses
  (`check_fresh`) when a folder it would remove holds something a run does not write."""
  check_fresh(workdir)
  gone = []
  for name in RUN_FILES:
    p = os.path.join(workdir, name)
    if os.path.isdir(p):
      shutil.rmtree(p)
    elif os.path.exists(p):
      os.remove(p)
    else:
      continue
    gone.append(name)
  return gone
