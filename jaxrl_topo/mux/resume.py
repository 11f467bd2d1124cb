"""Checkpoints and resume of a group's jobs: re-running a group on its workdir resumes each job from its own
newest checkpoint (`<job workdir>/checkpoints`, the same orbax layout and meta as a solo run's, runtime/run.py).

A job is strictly on-policy (eta = 0), so a checkpoint after step k holds everything its step k+1 needs: the
train state, the prompt iterator's state after batch k, and the weights version k (the rollout copy is rebuilt
from the restored state). A group checkpoints every `run.checkpoint_every` steps and at the last step, inside
the train phase (the state is on the train pool), and waits for the save to commit before the state is parked.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading

from absl import logging

from jaxrl_topo.runtime import experiment as experiment_lib
from jaxrl_topo.runtime import loop as loop_lib
from jaxrl_topo.runtime import run as run_lib
from jaxrl_topo.runtime import spans as spans_lib
from jaxrl_topo.runtime.checkpoint import Checkpointer, abstract_like


def build_job(job, checkpoints: bool) -> None:
  """Builds `job.exp`; with `checkpoints`, opens its Checkpointer and restores its newest checkpoint (the
  supervised warm-up is then skipped, as a resumed solo run skips it), setting `job.start`."""
  cfg, workdir = job.spec.cfg, job.spec.workdir
  job.ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.run.keep_checkpoints) if checkpoints else None
  try:
    latest = job.ckpt.latest_step() if job.ckpt is not None else None
    in_flight = job.ckpt.meta(latest).get("in_flight") if latest is not None else None
    if in_flight:  # a solo off-policy run's: a group job (eta = 0) would skip those batches' prompts
      raise ValueError(f"job {job.spec.job_id}: checkpoint {latest} in {workdir} holds {len(in_flight)} batches "
                       "generated but not trained (an off-policy run's, max_staleness > 0); a group job is on-policy "
                       "and cannot train them: resume it alone (launchers/train.py) or give the job another folder")
    job.exp = experiment_lib.build(cfg, workdir, warmup=latest is None)
  except BaseException:  # its Checkpointer closed now: an open one's background thread fails at interpreter exit
    close_checkpointer(job)
    raise
  if latest is None:
    return
  exp = job.exp
  exp.state, meta = job.ckpt.restore(latest, abstract_like(exp.state))
  exp.sync.rebase(exp.state)  # LoRA: the checkpoint's (warmed-up) base
  job.start = int(meta["step"])
  exp.prompts.set_state(meta["data_state"])  # after the last trained batch
  loop_lib.restored_weights(exp, job.start)  # a checkpoint 0 (a solo run's warm-up) too
  # Killed after this checkpoint committed, before its step's line reached the job's metrics.jsonl: the job's loop
  # logs that line first, from the checkpoint (its evaluation, where due, in the job's first rollout-pool turn).
  # Only launchers/mux.py writes that file: a group run without it logs the line again on every resume.
  if run_lib.lost_line(cfg, workdir, job.start, meta.get("landed")):
    job.lost = run_lib.landed_metrics(meta["landed"])


def close_checkpointer(job) -> None:
  """Closes the job's Checkpointer (pending saves first), once."""
  ckpt, job.ckpt = job.ckpt, None
  if ckpt is not None:
    ckpt.close()


def save(job, done: int, data_state, landed: dict | None) -> None:
  """Checkpoint after `done` steps when due (every run.checkpoint_every, and the last); committed on return.
  `landed`: step done - 1's metrics as they stood when its weights landed (its line is written later)."""
  cfg = job.spec.cfg
  every = cfg.run.checkpoint_every
  if job.ckpt is None or not (done == cfg.run.steps or (every and done % every == 0)):
    return
  meta = {"step": done, "gen_id": done, "data_state": data_state, "seed": cfg.run.seed, "mode": cfg.topology.mode,
          "accuracy_before": None, "in_flight": [], "landed": run_lib.landed_meta(landed)}
  with job.saving:  # a Ctrl-C waits for it (finish_saves, from Group.run)
    job.ckpt.save(done, job.exp.state, meta)
    job.ckpt.wait()  # the state is parked (its device buffers freed) right after this


def finish_saves(jobs, timeout_s: float = 300.0) -> None:
  """After a Ctrl-C: a checkpoint being written (`save`) commits before the process ends (before: lost, and the
  relaunch went on from the one before); each job's lock then held, no new one starts."""
  for job in jobs:
    if not job.saving.acquire(blocking=False):
      logging.warning("mux: waiting for job %s's checkpoint to commit (Ctrl-C again to quit without it)",
                      job.spec.job_id)
      if not job.saving.acquire(timeout=timeout_s):
        logging.warning("mux: job %s's checkpoint did not commit within %.0f s; leaving without it",
                        job.spec.job_id, timeout_s)


@contextlib.contextmanager
def noting_interrupts(flag: threading.Event):
  """Sets `flag` on a SIGINT, then lets Python's own handling raise KeyboardInterrupt in the main thread (Group.run
  then lets a checkpoint being written commit, `finish_saves`, and re-raises). A job that fails meanwhile (e.g. its
  reward worker gone) is not reported as failing on its own: the group reads `flag`. Off the main thread (where no
  signal handler can be set) it does nothing."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.getsignal(signal.SIGINT)

  def handler(signum, frame):
    flag.set()
    if callable(previous):
      previous(signum, frame)
    else:
      raise KeyboardInterrupt

  signal.signal(signal.SIGINT, handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def earlier_spans(workdir: str, name: str, starts: dict[str, int], lost: set[str]) -> list[dict]:
  """The spans in the group's spans file `name` of steps each job resumes past (`starts`: job id -> the step it
  resumes at; none for a job started over), less the evaluation a job in `lost` runs again (spans.kept_span)."""
  path = os.path.join(workdir, name)
  if not any(starts.values()) or not os.path.isfile(path):
    return []
  from jaxrl_topo.mux.report import read_spans  # noqa: PLC0415 (the report's plotting stays out of the group)

  return [r for r in read_spans(path) if spans_lib.kept_span(r, starts.get(r["job"], 0), r["job"] in lost)]


def write_spans(workdir: str, name: str, spans: list[dict]) -> None:
  """The group's spans file `name`, rewritten with `spans` in time order."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, name), "w") as f:
    f.writelines(json.dumps(s) + "\n" for s in sorted(spans, key=lambda s: s["start"]))
