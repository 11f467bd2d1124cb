"""Intra-group round-robin: each pool runs one job's phase at a time, in a fixed cyclic order.

A `RoundRobin` pool holds the group's active jobs in their cyclic order and whose turn it is. A job's
phase waits in `acquire(job)` until the turn is its own, runs, and `release(job)` hands the pool to the
next job of the cycle. One rollout and one train phase per job per cycle, so with both pools in the
same order the train pool runs job A's step while the rollout pool runs job B's batch. A job that ends
(its steps are done, or it failed) `retire`s: it leaves the cycle and the pool passes over it, so a
failed job never stalls the others.

An evaluation of a job (its `run.eval_every`) is a rollout-pool phase of that job in its own turn: it
acquires the pool when the job's next rollout would, and releases with `keep_turn=True`, so the job's
rollout follows in the same turn and the cycle's order is unchanged (history records it as "job:eval").

`migrate(job)` (long-tail migration) lets the next job start while `job` still finishes its stragglers:
the turn moves on, and `job`'s `release` then only drops its hold.
"""

from __future__ import annotations

import threading


class RoundRobin:
  def __init__(self, name: str, jobs: list[str]):
    if len(set(jobs)) != len(jobs) or not jobs:
      raise ValueError(f"pool {name}: job ids must be distinct and non-empty, got {jobs}")
    self.name = name
    self.order = list(jobs)
    self.turn = 0  # index into order of the job whose phase runs next
    self.holders: set[str] = set()  # jobs with a phase on the pool now (two while one migrates its tail)
    self.history: list[str] = []  # jobs in the order their phases were granted
    self.moved: set[str] = set()  # holders whose turn already passed on (migrated tails)
    self._cv = threading.Condition()

  def _current(self) -> str | None:
    return self.order[self.turn % len(self.order)] if self.order else None

  def acquire(self, job: str, phase: str | None = None) -> None:
    with self._cv:
      if job not in self.order:
        raise RuntimeError(f"pool {self.name}: {job} is not in the group (retired?)")
      self._cv.wait_for(lambda: self._current() == job and job not in self.holders)
      self.holders.add(job)
      self.history.append(job if phase is None else f"{job}:{phase}")

  def _advance(self, job: str) -> None:
    if self._current() == job:
      self.turn = (self.turn + 1) % len(self.order)

  def migrate(self, job: str) -> None:
    """`job` keeps running its stragglers; the next job of the cycle may start now."""
    with self._cv:
      if job in self.holders and job not in self.moved:
        self.moved.add(job)
        self._advance(job)
      self._cv.notify_all()

  def release(self, job: str, keep_turn: bool = False) -> None:
    """`keep_turn`: the turn stays with `job` (an evaluation before its rollout of the same turn)."""
    with self._cv:
      if job not in self.holders:
        raise RuntimeError(f"pool {self.name}: {job} releases a pool it does not hold")
      self.holders.discard(job)
      if job in self.moved:  # its turn passed on at the migration; it may be this job's turn again by now
        self.moved.discard(job)
      elif not keep_turn:
        self._advance(job)
      self._cv.notify_all()

  def retire(self, job: str) -> None:
    """`job` leaves the cycle (done or failed); a phase it holds is given up."""
    with self._cv:
      self.holders.discard(job)
      self.moved.discard(job)
      if job in self.order:
        i = self.order.index(job)
        current = self._current()
        self.order.pop(i)
        if self.order:
          self.turn = self.order.index(current) if current != job else i % len(self.order)
        else:
          self.turn = 0
      self._cv.notify_all()
