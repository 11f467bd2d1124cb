"""The run's checkpoint and resume (issue 6 §5): a thin, strict layer over orbax's CheckpointManager.

Layout: one step directory per checkpoint, `<directory>/<step>/`, holding two orbax items:
  state  the training state (any pytree of jax.Arrays, e.g. our TrainState), written shard by shard by
         every process (orbax's StandardCheckpointHandler; no process gathers a full copy);
  meta   a JSON dict written next to it (gen_id, data-iterator state, step, seed, mode, in-flight policy...).

Multi-process runs where only some processes hold the state (a disaggregated trainer): those processes
own the Checkpointer (`processes=`, orbax's active processes). When that is one process of several, the
state is saved from host copies (orbax rejects a jax.Array one process holds whole while others exist)
and restored onto the abstract state's shardings.

Durability. Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` only after
every item is written (on object stores, where there is no rename, it writes a commit_success file instead).
A process killed mid-write therefore leaves the previous checkpoints intact and the torn one out of every
listing; `cleanup_tmp_directories` removes the leftover the next time a Checkpointer opens the directory.
Keep-N deletion of old steps runs only after the new step committed, so keep=1 is still safe.

Async saves. `save` returns once the arrays are copied off the device (the caller may then donate or delete
them: the train step donates its state); the write and the commit finish on orbax's background thread.
`latest_step`/`all_steps` report only COMPLETE checkpoints: orbax's own listing already includes the step
in flight (and no longer the ones keep-N will delete once it commits), so while a save is in flight they
report the steps that were complete when it started. `wait` makes pending saves durable and re-raises a
failed background write.

Restore takes an abstract state (jax.ShapeDtypeStruct leaves WITH shardings, e.g. `abstract_like(state)` or
`jax.eval_shape` plus the state's shardings): orbax reads each shard straight onto the device that holds it
under the requested sharding, which may differ from the one the checkpoint was written with (a resharding
resume). Before reading, the checkpoint's own metadata is compared leaf by leaf with the abstract state, so a
missing or extra leaf, a shape or a dtype difference raises a ValueError naming the leaf's path (orbax would
cast dtypes silently and report shape mismatches without naming the array).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_STATE = "state"
_META = "meta"


def _key_str(key) -> str:
  """One step of a jax key path as orbax names it: dict key, attribute name or sequence index."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _flat(tree) -> dict[tuple[str, ...], Any]:
  """{path: leaf}; paths as tuples of strings, so a dataclass/namedtuple/tuple and the nested dicts/lists of
  orbax's metadata tree name a leaf alike."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {tuple(_key_str(k) for k in path): leaf for path, leaf in leaves}


def _path_str(path: tuple[str, ...]) -> str:
  return "/".join(path) or "<root>"


def abstract_like(tree):
  """jax.ShapeDtypeStruct tree (shape, dtype AND sharding) of live arrays: the abstract state `restore`
  takes, e.g. `ckpt.restore(None, abstract_like(state))` after building a fresh state."""
  def one(path, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or getattr(x, "sharding", None) is None:
      raise TypeError(f"abstract_like: leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}, not an array "
                      "with a sharding (jax.Array or a ShapeDtypeStruct with sharding)")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return jax.tree_util.tree_map_with_path(one, tree)


class Checkpointer:
  """Keep-N, optionally async checkpoints of (state pytree, JSON meta) in `directory`; see the module doc."""

  def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True,
               processes: frozenset[int] | None = None, read_only: bool = False):
    """`processes`: the processes that hold the state (default all); only they may construct and call
    this Checkpointer (a disaggregated run's rollout-only processes hold none of the train state).
    `read_only`: for readers beside a live run (export, serving): no saves, and the run's in-flight save
    (a tmp directory) is left alone; a writer's manager deletes tmp directories when it opens."""
    self.read_only = read_only
    if not isinstance(keep, int) or keep < 1:
      raise ValueError(f"Checkpointer keep={keep!r} must be an int >= 1 (checkpoints kept on disk)")
    directory = str(directory)
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    if "://" not in directory and os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise NotADirectoryError(f"Checkpointer: {directory} is a file; name a directory (made if missing)")
    if "://" not in directory and not os.path.exists(self.directory) and not read_only:
      from jaxrl_topo.models.hf_io import check_parent  # a path under a file, or an unwritable parent

      check_parent(self.directory, "Checkpointer: directory")
    multi = ocp.options.MultiprocessingOptions()
    self._host_copies = False
    if processes is not None and set(processes) != set(range(jax.process_count())):
      if jax.process_index() not in processes:
        raise ValueError(f"Checkpointer: process {jax.process_index()} is not one of its processes {sorted(processes)}")
      multi = ocp.options.MultiprocessingOptions(primary_host=min(processes), active_processes=set(processes),
                                                 barrier_sync_key_prefix="trainer")
      # orbax refuses a jax.Array one process holds whole while others exist; one holder saves host copies
      self._host_copies = len(processes) == 1
      if "://" not in self.directory:  # orbax will not create the root for a subset of processes
        os.makedirs(self.directory, exist_ok=True)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=not read_only,
                                           create=multi.active_processes is None and not read_only,
                                           multiprocessing_options=multi)
    # Handlers named up front, so a fresh manager can read a step's metadata before any save or restore.
    self._mngr = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={_STATE: ocp.StandardCheckpointHandler(), _META: ocp.JsonCheckpointHandler()})
    # (step, complete steps before it) of the last async save not yet known to be finalised
    self._pending: tuple[int, list[int]] | None = None

  def save(self, step: int, state, meta: dict) -> None:
    """Writes `state` and `meta` as checkpoint `step`. Async: returns after the device->host copy (the
    arrays may then be donated), the write continues in the background; it waits for a previous save first.
    Steps must increase: saving at or below the newest step raises ValueError."""
    if self.read_only:
      raise RuntimeError(f"a read-only Checkpointer cannot save (step {step} in {self.directory})")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"Checkpointer.save: step must be an int >= 0, got {step!r}")
    step = int(step)
    if not isinstance(meta, dict):
      raise TypeError(f"Checkpointer.save: meta must be a dict, got {type(meta).__name__}")
    try:
      json.dumps(meta, allow_nan=True)
    except (TypeError, ValueError) as e:  # fail here, not on the background thread
      raise TypeError(f"Checkpointer.save: meta is not JSON-serialisable: {e}") from e
    self.wait()  # orbax would wait too; waiting here also surfaces a failed previous save as itself
    before = list(self._mngr.all_steps())
    newest = max(before, default=None)
    if newest is not None and step <= newest:
      raise ValueError(f"Checkpointer.save: step {step} <= newest checkpoint {newest} in {self.directory}; "
                       "steps must increase")
    if self._host_copies:
      state = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state)
    args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta)})
    if not self._mngr.save(step, args=args, force=True):  # force: bypass the save-interval policy
      raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")
    self._pending = (step, before)

  def all_steps(self) -> list[int]:
    """Complete checkpoints, oldest first. While an async save is in flight these are the steps that were
    complete when it started: orbax already lists the new step and drops the steps keep-N will delete,
    but the deletion only happens after the new step commits."""
    if self._pending is not None:
      if self._mngr.is_saving_in_progress():
        return list(self._pending[1])
      self.wait()  # finalised: resolve it (raises if its background write failed)
    return list(self._mngr.all_steps())

  def latest_step(self) -> int | None:
    """The newest COMPLETE checkpoint's step (an in-flight or torn save is not one), None if there is none."""
    steps = self.all_steps()
    return max(steps) if steps else None

  def meta(self, step: int) -> dict:
    """Checkpoint `step`'s meta alone (no array is read): what a caller checks before building a state for it."""
    self.wait()
    return dict(self._mngr.restore(int(step), args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META])

  def restore(self, step: int | None, abstract_state) -> tuple[Any, dict]:
    """(state, meta) of checkpoint `step` (None: the newest complete one). `abstract_state` is a pytree of
    jax.ShapeDtypeStruct with shardings; each array is read directly into that sharding. Raises
    FileNotFoundError if the directory holds no such checkpoint, ValueError naming the leaf if the
    checkpoint's tree, shapes or dtypes differ from `abstract_state`. Waits for a pending save first."""
    self.wait()
    complete = self.all_steps()
    if step is None:
      if not complete:
        raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
      step = max(complete)
    step = int(step)
    if step not in complete:
      raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory} "
                              f"(complete steps: {complete})")
    want = _flat(abstract_state)
    for path, leaf in want.items():
      if not isinstance(leaf, jax.ShapeDtypeStruct) or leaf.sharding is None:
        raise ValueError(f"Checkpointer.restore: abstract_state leaf {_path_str(path)} is {leaf!r}; expected a "
                         "jax.ShapeDtypeStruct with a sharding (see abstract_like)")
    self._check_matches(step, want)
    target = jax.tree.map(lambda x: np.empty(x.shape, x.dtype), abstract_state) if self._host_copies else abstract_state
    args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target), _META: ocp.args.JsonRestore()})
    try:
      restored = self._mngr.restore(step, args=args)
    except ValueError as e:
      raise ValueError(f"restoring checkpoint step {step} from {self.directory}: {e}") from e
    state = restored[_STATE]
    if self._host_copies:
      state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), state, abstract_state)
    return state, dict(restored[_META])

  def _check_matches(self, step: int, want: dict[tuple[str, ...], jax.ShapeDtypeStruct]) -> None:
    """Leafwise comparison of the checkpoint's array metadata with the abstract state."""
    saved = _flat(self._mngr.item_metadata(step)[_STATE].tree)
    where = f"checkpoint step {step} in {self.directory}"
    missing = [p for p in want if p not in saved]
    extra = [p for p in saved if p not in want]
    if missing or extra:
      raise ValueError(f"{where} does not match the abstract state's tree: leaves not in the checkpoint "
                       f"{[_path_str(p) for p in missing]}, checkpoint leaves not in the abstract state "
                       f"{[_path_str(p) for p in extra]}")
    for path, leaf in want.items():
      meta = saved[path]
      shape, dtype = tuple(getattr(meta, "shape", ())), getattr(meta, "dtype", None)
      if shape != tuple(leaf.shape) or (dtype is not None and np.dtype(dtype) != leaf.dtype):
        raise ValueError(f"{where}: leaf {_path_str(path)} is saved as {shape} {dtype}, the abstract state "
                         f"wants {tuple(leaf.shape)} {leaf.dtype}")

  def wait(self) -> None:
    """Blocks until pending async saves are durable (committed, old steps pruned); re-raises their errors."""
    try:
      self._mngr.wait_until_finished()
      self._mngr.check_for_errors()
    finally:
      self._pending = None  # a failed save is reported once; orbax dropped it from its listing

  def close(self) -> None:
    """wait(), then closes the manager, once its start-up clean-up of tmp directories is done too: orbax's close()
    leaves that thread running, and a Checkpointer closed right after it opened (a build that fails at once) had
    it fail at interpreter exit ('cannot schedule new futures after interpreter shutdown')."""
    try:
      self.wait()
      cleanup = getattr(self._mngr, "_maybe_await_cleanup_tmp_directory", None)  # private in orbax 0.11
      if cleanup is not None:
        cleanup()
    finally:
      self._mngr.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
