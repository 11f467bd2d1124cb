"""Produced-but-untrained rollout batches as JSON, for the checkpoint meta (exact resume).

A checkpoint taken after step k holds the train state of version k + 1 and the batches already produced
for steps k + 1, k + 2, ... (disaggregated: the batch generated while step k ran, under version k). A
resumed run trains those batches as they were, instead of regenerating them under newer weights, so
with `run.deterministic=True` its metrics equal the uninterrupted run's. A batch that was still being
generated (async) is not saved: the prompt iterator is restored to the state after the last saved
batch, so its prompts are drawn again and sampled under the restored weights (no prompt lost or
trained twice; the staleness bound holds, the tokens differ).
"""

from __future__ import annotations

import base64
import dataclasses
import pickle

import numpy as np

from jaxrl_topo.rollout.engine import Sample
from jaxrl_topo.runtime.loop import Trajectories

_PICKLED = "__pickled__"


def _plain(v):
  """`v` as JSON: numpy values as Python ones, containers walked, and anything else JSON cannot hold (a Parquet
  row's dates, bytes, decimals) pickled under a tag, so the examples come back equal (`_restored`)."""
  if isinstance(v, np.ndarray):
    v = v.tolist()
  if isinstance(v, np.generic):
    v = v.item()
  if v is None or isinstance(v, str | int | float | bool):
    return v
  if isinstance(v, list | tuple):
    return [_plain(x) for x in v]
  if isinstance(v, dict) and all(isinstance(k, str) for k in v):
    return {k: _plain(x) for k, x in v.items()}
  return {_PICKLED: base64.b64encode(pickle.dumps(v)).decode("ascii")}


def _restored(v):
  if isinstance(v, list):
    return [_restored(x) for x in v]
  if isinstance(v, dict):
    if set(v) == {_PICKLED}:
      return pickle.loads(base64.b64decode(v[_PICKLED]))
    return {k: _restored(x) for k, x in v.items()}
  return v


def to_json(traj: Trajectories) -> dict:
  """Everything the train step and its metrics read of a produced batch; floats round-trip exactly."""
  return {"step": traj.step, "examples": _plain(list(traj.examples)),
          "samples": [dataclasses.asdict(s) for s in traj.samples],
          "rewards_N": traj.rewards_N.tolist(), "rewards_dtype": str(traj.rewards_N.dtype),
          "correct_N": traj.correct_N.tolist(), "correct_dtype": str(traj.correct_N.dtype),
          "info": {k: _plain(v) for k, v in traj.info.items()}, "data_state": traj.data_state}


def from_json(d: dict) -> Trajectories:
  return Trajectories(step=d["step"], examples=_restored(d["examples"]), samples=[Sample(**s) for s in d["samples"]],
                      rewards_N=np.asarray(d["rewards_N"], d["rewards_dtype"]),
                      correct_N=np.asarray(d["correct_N"], d["correct_dtype"]), info=d["info"],
                      data_state=d["data_state"])


def max_lag(saved) -> int | None:
  """The most weight versions any token of the saved batches (`to_json` dicts) lags the step that trains it;
  None when there are none."""
  if not isinstance(saved, list):  # none, or an older checkpoint's note (its batches are regenerated)
    return None
  lags = [d["step"] - min(s["gen_ids"]) for d in saved for s in d["samples"] if s["gen_ids"]]
  return max(lags) if lags else None
