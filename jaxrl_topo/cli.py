"""What every launcher shares: one-line user errors, quiet libraries, and a prompt exit across processes.

`launch(main)` stands in for absl's `app.run(main)` in launchers/*.py:

- A user-facing error (a bad config value or key, a missing file or model directory, bad data, a
  topology that does not fit: `ValueError`, `OSError`, `UserError`) prints `error: <message>` on
  stderr and exits with status 2, without a traceback; `--traceback` shows it. Any other exception
  is a bug: its traceback is printed and the status is 1.
- In a multi-process run (jax.distributed started), a failing process leaves at once (`os._exit`)
  instead of waiting in jax.distributed's shutdown barrier for processes that are still working;
  the local launcher (or a cluster's scheduler) sees it fail and stops the others.
- INFO lines from libraries (orbax, jax, grain, ...) are dropped; this project's own INFO lines stay.
  `--library_logs` keeps them all.
"""

from __future__ import annotations

import ast
import logging as std_logging
import os
import re
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

from absl import app, flags
from absl import logging as absl_logging

_TRACEBACK = flags.DEFINE_bool("traceback", False, "On an error, show the full traceback, not only the message.")
_LIBRARY_LOGS = flags.DEFINE_bool("library_logs", False, "Keep the INFO log lines of libraries (orbax, jax, ...).")

USER_ERROR_EXIT = 2
_OURS = tuple(os.path.dirname(os.path.abspath(p)) + os.sep
              for p in (__file__, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                               "launchers", "x")))


class UserError(Exception):
  """An error in what the user asked for (not a bug): shown as one line."""


class _QuietLibraries(std_logging.Filter):
  """Passes warnings and errors from anywhere, INFO/DEBUG only from this project's own files."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return record.levelno >= std_logging.WARNING or os.path.abspath(record.pathname).startswith(_OURS)


_FILTER = _QuietLibraries()


def quiet_libraries() -> None:
  """Installs the filter on the root logger's handlers (absl's included, which libraries log through)."""
  handlers = list(std_logging.getLogger().handlers)
  absl_handler = absl_logging.get_absl_handler()
  if absl_handler not in handlers:
    handlers.append(absl_handler)
  for h in handlers:
    if _FILTER not in h.filters:
      h.addFilter(_FILTER)


def _flags_parsed() -> bool:
  return flags.FLAGS.is_parsed()


def is_user_error(e: BaseException) -> bool:
  """ValueError, OSError, UserError; a KeyError/AttributeError only from parsing `--config.x=v`."""
  if isinstance(e, ValueError | OSError | UserError):
    return True
  return isinstance(e, KeyError | AttributeError) and not _flags_parsed()


def message(e: BaseException) -> str:
  """The error's own words: ml-collections' key errors arrive as an escaped repr inside a KeyError
  inside an AttributeError, unwrapped here."""
  inner = e
  while isinstance(inner, KeyError | AttributeError) and len(inner.args) == 1 and isinstance(
      inner.args[0], KeyError | AttributeError | str):
    if isinstance(inner.args[0], str):
      text = inner.args[0]
      key, _, hint = text.partition("\n")
      return f"no config key {key}" + (f". {hint}" if hint else "") if isinstance(inner, KeyError) else text
    inner = inner.args[0]
  if isinstance(e, OSError) and e.filename and e.strerror:  # "README.md/x: Not a directory", not "[Errno 20] ..."
    return f"{e.filename}: {e.strerror}"
  text = str(e) or type(e).__name__
  if "Failed loading config file" in text:  # ml-collections' four lines, naming its own flag "config_config"
    return f"--config: {text.strip().splitlines()[-1].strip()}"
  return text


def overrides_hint(msg: str, argv: list[str], job: bool = False) -> str:
  """For "no config key 'x'" from `--config.<...>.overrides.x=v`: ml-collections adds no key from the command line,
  so a field the config's overrides (a dict) do not hold is given with the whole dict. `job`: the override was a
  mux job's own (`--job=FILE,key=value`), whose dict takes one field (a comma ends the item)."""
  missing = re.match(r"no config key '([^']+)'", msg)
  keys = [a.split("=", 1)[0] for a in argv if a.startswith("--config.")]
  path = next((k[len("--config."):] for k in keys if missing and k.endswith(f".overrides.{missing.group(1)}")), None)
  if path is None:
    return _section_hint(missing.group(1), keys) if missing else ""
  field, section = missing.group(1), path.rsplit(".", 1)[0]
  whole = (f"{section}={{'{field}': ...}} in the --job (one field: a comma ends the item)" if job else
           f"--config.{section}=\"{{'{field}': ...}}\"")
  return (f"\nhint: {section} holds only the fields its config file gives it, and a command line adds no key: give "
          f"the whole dict, e.g. {whole} (it replaces the config's own)")


def _section_hint(field: str, keys: list[str]) -> str:
  """For "no config key 'x'" from `--config.<section>.x`, where x is a key of other sections (`--config.run.lr`)."""
  import dataclasses

  from jaxrl_topo.runtime.config import _SECTIONS

  given = next((k[len("--config."):].split(".") for k in keys if k.rsplit(".", 1)[-1] == field), None)
  homes = [name for name, cls in _SECTIONS.items() if field in {f.name for f in dataclasses.fields(cls)}]
  if given is None or len(given) != 2 or not homes or given[0] in homes:
    return ""
  return f"\nhint: {field} is a key of {' and '.join(homes)}: " + ", ".join(f"--config.{h}.{field}" for h in homes)


def device_hint(msg: str) -> str:
  """For a 'needs N devices' error on a CPU: how to fake them."""
  need = re.search(r"needs? (\d+) devices", msg)
  if need is None or "jax" not in sys.modules:
    return ""
  import jax
  try:
    if jax.default_backend() != "cpu":
      return ""
  except RuntimeError:
    return ""
  n = need.group(1)
  if os.environ.get("JAXRL_NUM_PROCESSES"):  # started by launchers/local_multiprocess.py: it sets the count
    per = -(-int(n) // int(os.environ["JAXRL_NUM_PROCESSES"]))
    return f"\nhint: give local_multiprocess.py --devices_per_process={per} (or more)"
  return (f"\nhint: on a CPU, JAX sees one device unless told otherwise: start with "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={n} (or more) in the environment")


def _distributed() -> bool:
  if "jax" not in sys.modules:
    return False
  try:
    from jax._src import distributed
    return distributed.global_state.client is not None
  except Exception:  # noqa: BLE001 - an unknown jax layout: behave as a single process
    return False


def _leave(code: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  if _distributed():  # skip the shutdown barrier: the other processes may never reach it
    os._exit(code)
  sys.exit(code)


def exit_now(code: int) -> None:
  """Leaves at once (os._exit) after a Ctrl-C, the `with`/`finally` blocks already run: threads may still be inside
  XLA (a compile, a job's step), and an interpreter shutdown around them crashes (status 139 in train.py's warm-up,
  134 in mux.py, after the 'interrupted' line). os._exit skips multiprocessing's exit handling, so the reward
  workers (which ignore SIGINT) are stopped here first."""
  import logging
  import multiprocessing

  for child in multiprocessing.active_children():
    child.terminate()
  for child in multiprocessing.active_children():
    child.join(timeout=5)
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _want_traceback() -> bool:
  if _flags_parsed():
    return bool(_TRACEBACK.value)
  return any(a in ("--traceback", "-traceback", "--traceback=true") for a in sys.argv[1:])  # failed parsing


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, except that its errors are one line with status 2: a value of the wrong type
  (`--config.run.steps=abc`), an unknown flag, a config file's get_config refusing its `:ARG` (not
  ml-collections' whole traceback under 'FATAL Flags parsing error'). absl's own fallback parses again, and
  ml-collections' override flags, defined during the first parse, then fail as 'defined twice', which hid
  the real error; so nothing is parsed twice here. `--config.key=None` sets the key to None (_set_nones)."""
  argv, nones = _none_overrides(argv)
  try:
    _given_once(argv)
    rest = flags.FLAGS(argv)
    _set_nones(nones)
    empty = [name for name in _PATH_FLAGS if name in flags.FLAGS and flags.FLAGS[name].value is not None
             and not flags.FLAGS[name].value.strip()]
    if empty:  # before: --workdir= failed after the checks and jax's start-up as "No such file or directory: ''"
      raise UserError(f"--{empty[0]} is empty: name a path")
    return rest
  except SystemExit as e:  # absl's --help/--helpfull print the flags, then exit 1 as if something had failed
    if e.code == 1 and _asks_for_help(argv):
      sys.exit(0)
    raise
  except flags.Error as e:
    if _want_traceback():
      raise
    text = str(e).strip()
    if "Error whilst parsing config file" in text:
      flag = next((a for a in argv[1:] if a.startswith(("--config=", "-config="))), "--config")
      text = f"{flag}: {text.splitlines()[-1]}"
    if "Unknown command line flag 'config'" in text and "job" in flags.FLAGS:  # mux.py: one config per job
      text += "; give each job's config file as --job=FILE[:ARG][,key=value,...]"
    print(f"error: {text}\n(--helpfull lists every flag; run with --traceback to see where it was raised)",
          file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)


def _given_once(argv: list[str]) -> None:
  """Refuses a flag given twice, unless it is a repeatable one (--stop, --job, --set): absl keeps the last one, so
  `--config=a.py --config=b.py` silently ran b.py (with overrides it failed as "flag defined twice"),
  `--workdir=a --workdir=b` wrote b, and `--model=a --model=b` generated from b. A boolean's --noX counts as --X."""
  end = argv.index("--") if "--" in argv else len(argv)
  given: dict[str, list[str]] = {}
  for i, a in enumerate(argv[:end]):
    if not i or not a.startswith("-") or a.startswith("--config."):
      continue
    name = a.lstrip("-").split("=", 1)[0]
    negated = name.startswith("no") and name not in flags.FLAGS and name[2:] in flags.FLAGS
    if negated and isinstance(flags.FLAGS[name[2:]], flags.BooleanFlag):
      name = name[2:]
    if name not in flags.FLAGS or isinstance(flags.FLAGS[name], flags.MultiFlag):
      continue
    boolean = isinstance(flags.FLAGS[name], flags.BooleanFlag)
    value = a.split("=", 1)[1] if "=" in a else a if boolean else (argv[i + 1] if i + 1 < end else "")
    given.setdefault(name, []).append(value)
  for name, values in given.items():
    if len(values) > 1:
      keys = ", and change its keys with --config.<key>=value" if name == "config" else ""
      raise UserError(f"--{name} given {len(values)} times ({', '.join(values)}): give one{keys}")


def _none_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
  """(argv less its `--config.key=None` arguments, those keys). ml-collections parses an override by the key's
  type, so `--config.rl.is_cap=None` failed as "could not convert string to float: 'None'" and a key defaulting
  to a number could not be switched off from the command line."""
  end = argv.index("--") if "--" in argv else len(argv)
  nones = {i: a.split("=", 1)[0][len("--config."):] for i, a in enumerate(argv[:end])
           if i and a.startswith("--config.") and a.partition("=")[2] in ("None", "none")}
  return [a for i, a in enumerate(argv) if i not in nones], list(nones.values())


def _set_nones(keys: list[str]) -> None:
  """Sets each dotted key of the parsed --config to None (the config's own checks then say if it may be)."""
  if not keys:
    return
  if "config" not in flags.FLAGS or flags.FLAGS["config"].value is None:
    raise UserError(f"--config.{keys[0]}=None without a --config file")
  for key in keys:
    apply_override(flags.FLAGS["config"].value, f"{key}=None", f"--config.{key}=None")


def value_of(text: str):
  """An override's value: a Python literal, "none" as None (as `--config.key=none` is), else the bare string."""
  if text == "none":
    return None
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text  # a bare string


def apply_override(config, item: str, where: str = "") -> None:
  """`a.b.c=value` into a locked ConfigDict; an unknown key is rejected as train.py's `--config.a.b.c=v` is (the
  same lookup, ml-collections' `config_path`, and cli.message's words: "did you mean ..."). `where`: how the
  error names the item (default `override 'a.b.c=value'`)."""
  from ml_collections.config_flags import config_path

  where = where or f"override {item!r}"
  key, _, text = item.partition("=")
  if not key or not _:
    raise UserError(f"{where}: expected key=value")
  *path, last = key.split(".")
  try:
    want = config_path.get_type(key, config)  # the key exists (else the nearest one is named)
  except (KeyError, AttributeError) as e:
    said = message(e)
    hint = overrides_hint(said, ["--config." + key], job=where.startswith("job "))
    raise UserError(f"{where}: {said}{hint}") from None
  try:
    node = config
    for p in path:
      node = node[p]
    node[last] = value_of(text)
  except (TypeError, ValueError) as e:  # ml-collections' "Could not override field ... cannot be casted"
    said = f"{text!r} is not a valid {getattr(want, '__name__', want)}" if "cast" in str(e) else message(e)
    raise UserError(f"{where}: {said}") from None


_PATH_FLAGS = ("workdir", "out")  # the launchers' path flags: an empty value is refused when parsed
_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?")


def _asks_for_help(argv: list[str]) -> bool:
  """Whether the command line holds one of absl's help flags (before a `--` that ends the flags)."""
  args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
  return any(a.startswith("-") and a.lstrip("-").split("=")[0] in _HELP_FLAGS for a in args)


def unescape(text: str) -> str:
  r"""`text` with \n, \t and \\ read as a newline, a tab and a backslash: a shell passes --stop='\n' as two
  characters (before: generate.py's stop string was a backslash and an n, which no completion held)."""
  escapes = {"n": "\n", "t": "\t", "\\": "\\"}
  return re.sub(r"\\([nt\\])", lambda m: escapes[m.group(1)], text)


def unescape_stops(config) -> None:
  r"""A run's ConfigDict with rollout.stop's strings unescaped (`unescape`), as generate.py reads --stop: before,
  --config.rollout.stop='\n' stopped at a backslash and an n, which no completion held."""
  stops = config.rollout.stop if "rollout" in config and "stop" in config.rollout else None
  if isinstance(stops, list | tuple):
    config.rollout.stop = tuple(unescape(s) if isinstance(s, str) else s for s in stops)


def _flag_owner() -> dict:
  """define_*_flags' module_name for the launcher that called it: absl's --help lists only a script's own flags,
  and a flag defined here would otherwise belong to this module."""
  caller = sys._getframe(2).f_globals.get("__name__")
  return {"module_name": sys.argv[0] if caller == "__main__" else caller}


def launch(main: Callable[[list[str]], None], interrupted: str | Callable[[], str] = "") -> None:
  """absl's app.run(main) with the behaviour described in the module doc; `interrupted`: what to tell the user
  after a Ctrl-C (exit 130), e.g. how to resume, or a function that says it then."""

  def wrapped(argv):
    if not _LIBRARY_LOGS.value:
      quiet_libraries()
    try:
      return main(argv)
    except app.UsageError as e:  # absl would print every flag's help above it, and exit 1
      raise UserError(str(e)) from None

  try:
    app.run(wrapped, flags_parser=_parse_flags)
  except SystemExit as e:
    if e.code not in (0, None) and _distributed():
      _leave(e.code if isinstance(e.code, int) else 1)
    raise
  except KeyboardInterrupt:
    said = interrupted() if callable(interrupted) else interrupted
    print(f"interrupted{'; ' + said if said else ''}", file=sys.stderr)
    exit_now(130)
  except Exception as e:  # noqa: BLE001 - every failure ends here, shown once
    pid = ""
    if _distributed():
      import jax
      pid = f"[process {jax.process_index()}] "
    if is_user_error(e) and not _want_traceback():
      said = message(e)
      print(f"error: {pid}{said}{device_hint(said)}{overrides_hint(said, sys.argv)}\n(run with --traceback to see "
            "where it was raised)", file=sys.stderr)
      _leave(USER_ERROR_EXIT)
    traceback.print_exc()
    if pid:
      print(f"error: {pid}{type(e).__name__}: {message(e)}", file=sys.stderr)
    _leave(USER_ERROR_EXIT if is_user_error(e) else 1)


def define_distributed_flags() -> Callable[[], Any]:
  """--coordinator, --num_processes, --process_id: an explicit jax.distributed set-up (all three or none; none: the
  JAXRL_* variables launchers/local_multiprocess.py sets, then the cluster's own, else one process). Returns a
  function giving their runtime.distributed.DistributedConfig; call it first: a partial set-up raises there."""
  where = _flag_owner()
  coord = flags.DEFINE_string("coordinator", None, "host:port of process 0 (explicit jax.distributed set-up, with "
                              "--num_processes and --process_id; default: the environment's).", **where)
  count = flags.DEFINE_integer("num_processes", None, "Processes in the job (explicit set-up).", **where)
  index = flags.DEFINE_integer("process_id", None, "This process's index (explicit set-up).", **where)

  def config():
    from jaxrl_topo.runtime.distributed import DistributedConfig

    try:
      return DistributedConfig(coordinator=coord.value, num_processes=count.value, process_id=index.value)
    except ValueError as e:
      raise ValueError(f"--coordinator/--num_processes/--process_id: {e}") from None
  return config


def define_engine_flags() -> Callable[[], dict]:
  """The rollout engine's knobs as flags of a launcher (generate.py, serve.py): --kv_dtype, --min_pack_rows,
  --min_window_tokens, --pallas_splits. Returns a function that gives the ones set on the command line, by
  EngineConfig name."""
  from jaxrl_topo.rollout.engine_config import KV_DTYPES, EngineConfig

  where = _flag_owner()
  defined = [
      flags.DEFINE_enum("kv_dtype", None, list(KV_DTYPES), "KV pool dtype (default: the compute --dtype).", **where),
      flags.DEFINE_integer("min_pack_rows", None, "Smallest batch a decode chunk's live rows are packed into per "
                           "data shard (>= 2; each size met is a program to compile; default "
                           f"{EngineConfig.min_pack_rows}).", **where),
      flags.DEFINE_integer("min_window_tokens", None, "--read=window: no narrower window than this many tokens "
                           f"(fewer programs to compile; default {EngineConfig.min_window_tokens}).", **where),
      flags.DEFINE_integer("pallas_splits", None, "--read=pallas (or auto on a GPU): programs each row's page walk "
                           "is divided over (flash-decoding; default: the kernel's, 1).", **where)]

  def given() -> dict:
    from jaxrl_topo.rollout.engine_config import check_fields

    values = {f.name: f.value for f in defined if f.value is not None}
    check_fields(values, "--")  # EngineConfig's own checks, naming the flag: "--min_pack_rows=0 must be >= 2"
    return values

  return given


def free_port() -> int:
  """A TCP port on localhost that nothing holds now (local_multiprocess's coordinator, a test's server)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]
