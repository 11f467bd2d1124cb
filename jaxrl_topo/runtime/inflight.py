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

import dataclasses

import numpy as np

from jaxrl_topo.rollout.engine import Sample
from jaxrl_topo.runtime.loop import Trajectories


def _plain(v):
  if isinstance(v, np.ndarray):
    return v.tolist()
  return v.item() if isinstance(v, np.generic) else v


def to_json(traj: Trajectories) -> dict:
  """Everything the train step and its metrics read of a produced batch; floats round-trip exactly."""
  return {"step": traj.step, "examples": [{k: _plain(v) for k, v in ex.items()} for ex in traj.examples],
          "samples": [dataclasses.asdict(s) for s in traj.samples],
          "rewards_N": traj.rewards_N.tolist(), "rewards_dtype": str(traj.rewards_N.dtype),
          "correct_N": traj.correct_N.tolist(), "correct_dtype": str(traj.correct_N.dtype),
          "info": {k: _plain(v) for k, v in traj.info.items()}, "data_state": traj.data_state}


def from_json(d: dict) -> Trajectories:
  return Trajectories(step=d["step"], examples=d["examples"], samples=[Sample(**s) for s in d["samples"]],
                      rewards_N=np.asarray(d["rewards_N"], d["rewards_dtype"]),
                      correct_N=np.asarray(d["correct_N"], d["correct_dtype"]), info=d["info"],
                      data_state=d["data_state"])
