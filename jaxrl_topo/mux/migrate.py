"""Long-tail migration: once `mux.migrate_at` of a rollout's sequences have ended, the next job may start.

Between decode chunks the job's engine is asked how many of its slots still hold a live sequence. When
at most (1 - migrate_at) of the batch is left and a slot is free (so nothing waits for admission), the
rollout pool's turn moves on (`RoundRobin.migrate`): the next job's rollout starts while this job's
stragglers finish in the few slots they hold. Nothing about the stragglers changes (same engine, same
weights, same sampling keys), so their tokens and log-probs are those of an unmigrated run; what the move
buys is the tail's idle decode capacity, given to the next job.

What this does not do (yet): move the stragglers onto a subset of the rollout devices. They keep their
slots on the whole rollout mesh and share its devices with the next job's rollout until they end.
"""

from __future__ import annotations

import time

from jaxrl_topo.mux.pools import RoundRobin


def live_slots(engine) -> int:
  return sum(engine.pool.seq_id(s) is not None for s in range(engine.ecfg.n_slots))


class TailMigration:
  def __init__(self, exp, pool: RoundRobin, job: str, migrate_at: float):
    self.exp, self.pool, self.job, self.migrate_at = exp, pool, job, migrate_at
    self.batch = exp.cfg.data.batch_size * exp.cfg.rl.group_size  # sequences per rollout round
    self.armed = False
    self.migrated_at: float | None = None

  def arm(self) -> None:
    """A rollout phase of this job starts (it holds the pool)."""
    self.armed, self.migrated_at = self.migrate_at < 1.0, None

  def on_chunk(self, engine) -> None:
    if not self.armed:
      return
    live = live_slots(engine)
    if live < engine.ecfg.n_slots and live <= (1.0 - self.migrate_at) * self.batch:
      self.armed, self.migrated_at = False, time.perf_counter()
      self.pool.migrate(self.job)
