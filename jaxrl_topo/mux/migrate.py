"""Long-tail migration: once `mux.migrate_at` of a rollout's sequences have ended, the rollout turn passes to
the next job and the stragglers move onto a subset of the rollout devices.

Between decode chunks the job's engine is asked how many of its slots still hold a live sequence. When at
most (1 - migrate_at) of the batch is left, the turn moves on (`RoundRobin.migrate`); from then on, at each
chunk, the stragglers move as soon as nothing waits for admission and they sit in at most `tail_shards`
of the rollout mesh's data shards:

  tail engine   a second `RolloutEngine` of the job on the first `tail_shards` data shards of the rollout mesh
                (all their tensor devices), each shard with the full engine's rows, pages for those rows at
                full length, the weights laid out on that sub-mesh; built and compiled at the group's build
  the move      the dispatched chunk is read; old data shard d's stragglers go, together, to the same rows of
                one tail shard (so each decode step sees the same rows beside it: the paged read's width, and
                so its numbers, depend on the longest co-resident row); their pages' K/V are gathered on the
                full mesh, sent to the tail's devices and scattered into its pool; their slot rows (last
                token, position, sequence id, budget, stop ids) go with the tail's next patch, and the
                stream's slot map is rewritten: the stream decodes on the tail engine from then on
  freed         the job's full KV pool is deleted at once, and the other data shards' devices run none of the
                job's programs until its rollout ends (span fields: tail_devices, tail_steps,
                freed_slot_steps = tail steps x (n_slots - tail rows), freed_kv_bytes)

Sampling keys depend on (key, sequence id, position) only, so the stragglers' tokens and log-probs are those
of an unmoved run, bit for bit (tests/test_mux_migrate.py). After the stream
closes, `restore` frees the tail's pool; the job's next rollout runs on its full engine again.

With a row-exact paged read (`ROW_EXACT`: rollout.impl fast, reference or pallas; auto is pallas on GPU) the
stragglers `merge`: they fill the tail's rows in slot order from any shards, so they move at `migrate_at`,
still bit for bit, and the turn passes only after the move. With bucketed or window (auto on CPU) a move waits until
the stragglers sit in the tail's shards, and the turn passes at once.

The freed shards (mux.resize, not under run.deterministic): tails take the first data shards, so the shards
after the widest tail (`rest_shards`) are free whenever a tail runs. Each job has a second engine there
(`sub_engine`, built with the group); a rollout that starts while another job's stragglers decode on their tail
runs on it, with fewer slots. Its prompts are then prefilled and decoded in other batches than in a solo run,
so its log-probs may differ from solo in the last bits (and, rarely, a sampled token): equality with solo is
what run.deterministic keeps, with every rollout on its job's whole mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from jaxrl_topo.mux.pools import RoundRobin
from jaxrl_topo.rollout.engine import Request, RolloutEngine
from jaxrl_topo.rollout.host_state import _SlotMirror

# Paged reads whose numbers for a row never depend on the rows beside it (paged.py): with them stragglers from
# several data shards can share a tail shard and still decode bit for bit as unmoved. Not "bucketed" or "window":
# their width is the longest co-resident row's, which changes the sums' shapes.
ROW_EXACT = ("reference", "fast", "pallas")


def live_slots(engine) -> int:
  return sum(engine.pool.seq_id(s) is not None for s in range(engine.ecfg.n_slots))


def unfinished(engine) -> int:
  """Sequences of the engine's open stream not finished yet: live, queued for a slot or waiting on a pinned
  prompt (live slots alone would pass a batch far larger than the slots as nearly done)."""
  stream = engine._stream
  if stream is None:
    return live_slots(engine)
  return sum(stream.loop.left)


def tail_shards(batch: int, migrate_at: float, slots_per_shard: int, data: int) -> int:
  """Data shards of the tail engine: enough of the rollout mesh's shards (each with the same rows as the full
  engine's shards) for the most stragglers a migration moves; `data` means no shard is freed (no move)."""
  most = max(1, int(np.floor((1.0 - migrate_at) * batch)))
  return min(data, -(-most // slots_per_shard))


def submesh(mesh: jax.sharding.Mesh, shards: range) -> jax.sharding.Mesh:
  """Data shards `shards` of a rollout mesh (all their tensor devices)."""
  axis = mesh.axis_names.index("data")
  devices = np.take(mesh.devices, shards, axis=axis)
  return jax.sharding.Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def _key_on(key, mesh: jax.sharding.Mesh):
  """The sampling key, replicated on `mesh` (one layout whatever the caller's: the tail compiles once)."""
  return jax.device_put(key, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _on(tree, mesh: jax.sharding.Mesh):
  """Arrays laid out on another mesh with the same axis names: same PartitionSpecs (a device-local copy where
  the spec does not split over `data`, as rollout weights do not)."""
  def to(x):
    spec = x.sharding.spec if isinstance(x.sharding, jax.sharding.NamedSharding) else None
    return x if spec is None else jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  return jax.tree.map(to, tree)


@jax.jit
def _gather_pages(kv, src_N):
  return jax.tree.map(lambda x: x[:, src_N], kv)


@functools.partial(jax.jit, donate_argnames=("kv",))
def _scatter_pages(kv, pages, dst_N):
  return jax.tree.map(lambda x, p: x.at[:, dst_N].set(p, mode="drop"), kv, pages)


def _move_pages(old, new, src_N, dst_N):
  """(k, v) pools: pages src_N of `old` (full mesh) into pages dst_N of `new` (tail mesh; out of range: dropped)."""
  pages = _gather_pages(old, src_N)
  pages = jax.device_put(pages, jax.tree.map(lambda x: x.sharding, new))  # the stragglers' K/V, to the tail's devices
  return _scatter_pages(new, pages, dst_N)


def kv_bytes(engine) -> int:
  c = engine.state.cache
  return 0 if engine._kv_released else int(c.k_LPSKH.nbytes + c.v_LPSKH.nbytes)


def _tail_engine(engine: RolloutEngine, n_data: int) -> RolloutEngine:
  """The job's tail engine: its first `n_data` data shards, each with the full engine's rows per shard (so every
  shard's decode program has the same shapes: bit-identical numbers), pages for those rows at full length."""
  return sub_engine(engine, range(n_data))


def sub_engine(engine: RolloutEngine, shards: range) -> RolloutEngine:
  """The job's engine on data shards `shards` of its rollout mesh (the full engine's rows per shard, pages for
  them at full length), its KV pool released until a run needs it."""
  e = engine.ecfg
  n_slots = engine.pool.slots_per_shard * len(shards)
  ecfg = dataclasses.replace(e, n_slots=n_slots, n_pages=n_slots * e.max_pages_per_seq)
  mesh = submesh(engine.mesh, shards)
  tail = RolloutEngine(engine.graphdef, engine.cfg, _on(engine.params, mesh), ecfg, gen_id=engine.gen_id, mesh=mesh,
                       detokenize=engine.detokenize)
  tail._static = engine._static  # the same hashed GraphDef
  tail.release_kv()
  return tail


def move_stragglers(engine: RolloutEngine, tail: RolloutEngine, merge: bool = False,
                    info: dict | None = None) -> int | None:
  """Moves the open stream's live sequences from `engine` onto `tail`; returns the KV bytes freed, or None
  (nothing moved) when the stream is not in a state to move: requests wait, weights are pending, or the
  stragglers still span more data shards than the tail has.

  Each old data shard's stragglers move together, each to the same row of one tail shard (same rows per
  shard): a decode step then sees the same rows beside it as before, which the paged read's width (the
  longest co-resident row, paged.py `bucketed` and `window`) and so its numbers depend on. `merge` (for a row-exact
  read, `ROW_EXACT`, whose numbers do not depend on the rows beside): the stragglers fill the tail's rows in
  slot order, from any shards, so they move as soon as they are few enough. `info["shards"]`: the old data
  shards the moved stragglers sat in."""
  stream = engine._stream
  loop = stream.loop if stream is not None else None
  if (loop is None or loop.queue or loop.pinned or loop.waiting or engine._pending is not None or engine._waves
      or engine._unread):
    return None
  if stream.inflight is not None:  # the dispatched chunk: read now (what the next iteration would collect)
    loop.collect(engine._read(stream.inflight)[0])
    stream.inflight = None
  spp = engine.pool.slots_per_shard
  shards = sorted({slot // spp for slot in loop.live})  # old data shards still holding stragglers
  if not loop.live or (len(loop.live) if merge else len(shards) * spp) > tail.ecfg.n_slots:
    return None
  if info is not None:
    info["shards"] = shards
  tail._ensure_kv()
  tail.params = _on(engine.params, tail.mesh)
  tail.gen_id, tail.key, tail.sampling = engine.gen_id, _key_on(engine.key, tail.mesh), engine.sampling
  tail.host = _SlotMirror.zeros(tail.ecfg.n_slots)
  src, dst, live, h = [], [], {}, engine.host
  old_table, lengths, ps = engine.pool.table(), engine.pool.lengths(), engine.ecfg.page_size
  for i, (slot, ri) in enumerate(sorted(loop.live.items())):
    n_held = int(np.count_nonzero(old_table[slot] >= 0))
    length = int(lengths[slot])
    t = i if merge else shards.index(slot // spp) * spp + slot % spp  # same row of a shard, same rows beside it
    tail.pool.admit(engine.pool.seq_id(slot), length, slot=t)
    tail.pool.ensure_capacity(t, n_held * ps - length)
    src += old_table[slot, :n_held].tolist()
    dst += tail.pool.table()[t, :n_held].tolist()
    row = (int(h.last_B[slot]), int(h.pos_B[slot]), int(h.seq_B[slot]), int(h.left_B[slot]), int(h.active_B[slot]),
           tuple(int(x) for x in h.stop_BX[slot] if x >= 0))
    for name in ("last_B", "pos_B", "seq_B", "left_B", "active_B", "stop_BX"):
      getattr(tail.host, name)[t] = getattr(h, name)[slot]
    tail._epoch_B[t] += 1
    tail._rows[t] = row
    live[t] = ri
  N = tail.ecfg.n_pages  # fixed size: one compile; padding rows copy page 0 to page N (dropped)
  src_N, dst_N = np.zeros(N, np.int32), np.full(N, N, np.int32)
  src_N[: len(src)], dst_N[: len(dst)] = src, dst
  old, new = engine.state.cache, tail.state.cache
  k, v = _move_pages((old.k_LPSKH, old.v_LPSKH), (new.k_LPSKH, new.v_LPSKH), src_N, dst_N)
  tail.state = tail.state.replace(cache=new.replace(k_LPSKH=k, v_LPSKH=v))
  freed = kv_bytes(engine)
  for slot in loop.live:
    engine.free(slot)
  engine._rows, engine._copies = {}, {}
  engine.release_kv()  # the full pool's device memory goes now
  loop.live = live
  stream.engine = loop.engine = tail
  tail._stream, tail._running = stream, True
  return freed


def compile_engine(sub: RolloutEngine, engine: RolloutEngine) -> None:
  """Compiles a sub engine's programs at build: one two-token request (keyed as a move or a phase keys it) and
  a patch of an idle row (a move's rows go with one); then its pool is released."""
  sub.run([Request([engine.ecfg.pad_id], n=1, max_new_tokens=2)], key=_key_on(engine.key, sub.mesh))
  sub._rows[0] = (0, 0, 0, 0, 0, ())
  sub._flush()
  sub.release_kv()
  sub.stats.clear()


def compile_move(src: RolloutEngine, dst: RolloutEngine) -> None:
  """Compiles the page move from `src`'s pool into `dst`'s (an empty one: every page dropped)."""
  src_free, dst_free = src._kv_released, dst._kv_released
  src._ensure_kv()
  dst._ensure_kv()
  N = dst.ecfg.n_pages
  old, new = src.state.cache, dst.state.cache
  k, v = _move_pages((old.k_LPSKH, old.v_LPSKH), (new.k_LPSKH, new.v_LPSKH), np.zeros(N, np.int32),
                     np.full(N, N, np.int32))
  dst.state = dst.state.replace(cache=new.replace(k_LPSKH=k, v_LPSKH=v))
  for e, was_free in ((src, src_free), (dst, dst_free)):
    if was_free:
      e.release_kv()


def restore(tail: RolloutEngine | None, engine: RolloutEngine | None = None) -> None:
  """After the migrated stream closed: the tail engine lets its pool go; its counters join `engine`'s."""
  if tail is not None and tail._running:
    tail._stream, tail._running = None, False
    tail.release_kv()
  if tail is not None and engine is not None:
    engine.stats.update(tail.stats)
    tail.stats.clear()


def rest_shards(tails: list, data: int) -> range | None:
  """The rollout mesh's data shards that no job's tail engine uses (tails take the first shards): where a job's
  rollout runs while another job's stragglers decode on their tail. None when a tail may take every shard."""
  first = max((m.n_data for m in tails if m.movable), default=data)
  return range(first, data) if first < data else None


class TailMigration:
  """One job's long-tail migration: `arm()` at its rollout phase's start, `on_chunk` between decode chunks,
  `done()` once the rollout returned. `migrated_at`, `freed_kv_bytes`, `tail_steps` describe the last one."""

  def __init__(self, exp, pool: RoundRobin, job: str, migrate_at: float):
    self.exp, self.pool, self.job, self.migrate_at = exp, pool, job, migrate_at
    self.merge = exp.engine.impl in ROW_EXACT  # stragglers from any shards move at once, still bit-exact
    self.batch = exp.cfg.data.batch_size * exp.cfg.rl.group_size  # sequences per rollout round
    eng = exp.engine
    data = eng.pool.n_shards if eng.mesh is not None and "data" in eng.mesh.axis_names else 1
    self.n_data = tail_shards(self.batch, migrate_at, eng.pool.slots_per_shard, data)
    self.movable = self.n_data < data  # else no shard can be freed: the turn passes, the stragglers stay
    self.n_tail = eng.pool.slots_per_shard * self.n_data
    self.tail: RolloutEngine | None = None
    self.armed = False
    self.migrated_at: float | None = None
    self.freed_kv_bytes = 0
    self.moving = False  # the stragglers move once they fit the tail's data shards
    self.passing = False  # the turn passes on at the move (merge), or at once (no merge: the move may wait)
    self.moved_at: float | None = None
    self.moved_from = 0  # data shards the moved stragglers sat in (> the tail's: they merged)

  def warm(self) -> None:
    """Builds the tail engine and compiles its programs now (the job is being built, its weights on the rollout
    pool), so no move compiles in a phase."""
    if not self.movable or self.tail is not None:
      return
    eng = self.exp.engine
    self.tail = _tail_engine(eng, self.n_data)
    compile_engine(self.tail, eng)
    compile_move(eng, self.tail)

  @property
  def running(self) -> bool:
    """The job's stragglers decode on its tail engine now (its other data shards are free)."""
    return self.moved_at is not None and self.tail is not None and self.tail._running

  def arm(self) -> None:
    """A rollout phase of this job starts (it holds the pool)."""
    restore(self.tail, self.exp.engine)
    self.armed, self.migrated_at, self.freed_kv_bytes = self.migrate_at < 1.0, None, 0
    self.moving, self.passing, self.moved_at = False, False, None

  def on_chunk(self, engine) -> None:
    if engine is self.tail:
      return
    if self.armed:
      if live_slots(engine) >= engine.ecfg.n_slots or unfinished(engine) > (1.0 - self.migrate_at) * self.batch:
        return
      self.armed, self.migrated_at, self.moving, self.passing = False, time.perf_counter(), self.movable, True
    if self.moving:  # until the stragglers fit the tail's shards (or they end)
      if self.tail is None:
        self.tail = _tail_engine(engine, self.n_data)
      info = {}
      freed = move_stragglers(engine, self.tail, self.merge, info)
      if freed is not None:
        self.moving, self.moved_at, self.freed_kv_bytes = False, time.perf_counter(), freed
        self.moved_from = len(info["shards"])
    if self.passing and not (self.merge and self.moving):  # the next job's rollout may start now
      self.passing = False
      self.pool.migrate(self.job)

  def done(self) -> dict:
    """The rollout returned: the tail's pool is freed; what the migration gave the next job."""
    out = {"migrated_at": self.migrated_at, "moved_at": self.moved_at}
    if self.moved_at is not None and self.tail is not None and self.tail._running:
      steps = int(self.tail.stats["slot_steps"]) // self.n_tail
      full = self.exp.engine.ecfg.n_slots
      out.update(tail_slots=self.n_tail, tail_devices=[d.id for d in self.tail.mesh.devices.flat], tail_steps=steps,
                 freed_slot_steps=steps * (full - self.n_tail), freed_kv_bytes=self.freed_kv_bytes,
                 moved_from_shards=self.moved_from)
    restore(self.tail, self.exp.engine)
    return out
