"""The rollout engine: paged KV cache, continuous batching, GRPO prefix sharing, in-jit sampling.

Device side (device.py): pure jitted functions over a `DecodeState` (the paged pool plus per-slot
arrays), donated on every call; the state stays on the device from one call to the next.
Host side: a `PagePool` (kv_pool.py) owns page tables, refcounts and preemption, and a host mirror
of the slot state (`host`) is kept up to date from what the device returns anyway (tokens, emitted
flags, finish flags), never by reading the state back. What the host changes (admissions, new
pages, frees) goes out with the next dispatch: at most one prefill call per prompt-length bucket
of an admission wave and one `patch` call, only when something changed.
`run(requests)` (scheduler.py) is the continuous-batching loop: it fills free slots (one prefill
per GRPO group, forks that share the prompt's full pages), decodes in chunks of K with host work
overlapping the device, retires finished sequences (EOS / stop ids / length / stop strings) and
refills. When pages run out the youngest sequences are preempted, requeued and later recomputed
from scratch; since every sample's keys come from (seed, sequence id, position), a recomputed
sequence is identical to the one it replaces. Every emitted token carries the gen_id of the
weights it was sampled under.
Shapes are static per engine (slots, pages) and bucketed per call (prompt length, prompts and samples
per wave, the live rows a chunk packs: powers of two); a chunk's length is a traced value (one decode
program for every length), so steady state compiles nothing new.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.rollout import device, uploads
from jaxrl_topo.rollout.dense import bucket_length
from jaxrl_topo.rollout.device import DecodeState
from jaxrl_topo.rollout.engine_config import (
  UPDATE_POLICIES,
  EngineConfig,
  check_fits_model,
  check_on_mesh,
  check_update,
)
from jaxrl_topo.rollout.host_state import _Dispatched, _Pending, _pow2, _SlotMirror, _Wave, count_chunk, window_pages
from jaxrl_topo.rollout.kv_pool import OutOfPages, PagePool
from jaxrl_topo.rollout.paged import PagedKVCache
from jaxrl_topo.rollout.pallas_paged import resolve_impl
from jaxrl_topo.rollout.requests import MAX_STOP_IDS, Request, Sample
from jaxrl_topo.rollout.sampling import SamplingConfig
from jaxrl_topo.rollout.stream import Stream
from jaxrl_topo.topology.hostcomm import to_host

__all__ = ["EngineConfig", "Request", "RolloutEngine", "Sample", "UPDATE_POLICIES", "generate", "prefill"]

prefill, generate, patch = device.prefill, device.generate, device.patch  # the jitted functions (tests count traces)


class RolloutEngine:
  """Continuous-batching generation over a paged KV cache.

  JetStream-shaped pieces: `insert_group` (prefill once + insert n slots; `insert` is n = 1),
  `generate` (one chunk of K steps), `free`; `run(requests)` is the whole loop over them.
  With `mesh` (axes `data`, `tensor`), each data shard owns n_slots/data slots and n_pages/data
  pages of the KV pool (a group lives in one shard; device.py runs per shard), and KV heads split over
  `tensor`; the caller passes params already laid out on that mesh (topology ROLLOUT_RULES).
  `detokenize(ids) -> str` enables per-request stop strings.
  """

  def __init__(self, graphdef, cfg: ModelConfig, params, ecfg: EngineConfig, *, gen_id: int = 0, seed: int = 0,
               mesh: jax.sharding.Mesh | None = None, detokenize: Callable[[Sequence[int]], str] | None = None):
    check_fits_model(ecfg, cfg)  # before anything is allocated or compiled
    self.graphdef, self.cfg, self.ecfg = graphdef, cfg, ecfg
    self._static = device.Static(graphdef)
    self.params, self.gen_id, self.detokenize = params, gen_id, detokenize
    self.sampling = ecfg.sampling  # run(sampling=...) overrides it for one call
    self.key = jax.random.key(seed)
    self.mesh = mesh
    self._pending: _Pending | None = None
    self._running = False  # a stream is open: updates land under their policy
    self._stream = None  # the open stream (run() opens one of its own)
    self.layout = device.layout_for(mesh, ecfg.n_slots, ecfg.n_pages, cfg.n_kv_heads)
    self.impl = resolve_impl(ecfg.impl, cfg, ecfg.page_size)
    # The bucketed read folds KV heads into its key axis (paged.py) where that was measured to pay: on CPU,
    # at most 2 KV heads (the fold multiplies attention FLOPs by their count), each device holding them whole.
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    self._fold_heads = (platform == "cpu" and cfg.n_kv_heads <= 2
                        and not (self.layout is not None and self.layout.kv_heads_split))
    check_on_mesh(params, mesh)
    self._epoch_B = np.zeros(ecfg.n_slots, np.int64)  # bumped at every admission and free of a slot
    self._new_host_side()
    self.state = self._zero_state()
    self.stats = collections.Counter()
    self._kv_released = False
    self._dev_table = self.pool.table()  # what the device's page table holds

  def _new_host_side(self) -> None:
    """The host's bookkeeping of an engine that holds no sequence."""
    e = self.ecfg
    self.pool = PagePool(e.n_pages, e.page_size, e.n_slots, e.max_pages_per_seq,
                         n_shards=self.layout.data if self.layout else 1)  # a data shard's slots get its pages
    self.host = _SlotMirror.zeros(e.n_slots)
    self._epoch_B += 1  # chunks dispatched before this read as stale
    self._waves: list[_Wave] = []  # admitted, prefill not yet dispatched
    self._rows: dict[int, tuple] = {}  # slot -> (last, pos, seq, left, active, stop ids) for the next patch
    self._copies: dict[int, tuple[int, int]] = {}  # slot -> page copy for the next patch (forks from pins)
    # (seq id, pin id) -> (first token, log-prob, gen_id), read for samples prefilled without a slot
    self.first_of: dict[tuple[int, int], tuple[int, float, int]] = {}
    self._unread: list = []  # dispatched prefills whose first tokens are not read yet

  def _abandon(self) -> None:
    """After a failure inside a stream (an `on_chunk` hook raised, a batch was left unfinished, Ctrl-C): every
    sequence is dropped with its slot and pages, a requested weight update lands, and the KV pool's device memory
    is freed (the next admission allocates a fresh one, compiling nothing), so the next call starts clean."""
    if self._pending is not None:
      self._swap()
    self._new_host_side()
    try:
      self.release_kv()
    except Exception:  # noqa: BLE001 -- arrays a failed dispatch consumed: the next admission allocates anew either way
      self._kv_released = True

  @functools.cached_property
  def _zero_state(self) -> Callable[[], DecodeState]:
    """Makes an idle state, born in the steady-state layout (each device allocates only its shard of the
    pool); jitted once per engine, so `release_kv` and the next allocation compile nothing."""
    e, B = self.ecfg, self.ecfg.n_slots

    def zeros():
      cache = PagedKVCache.zeros(self.cfg, e.n_pages, e.page_size, e.max_pages_per_seq, B, impl=self.impl,
                                 dtype=jnp.dtype(e.kv_dtype) if e.kv_dtype else None,
                                 fold_heads=self._fold_heads, window_min_pages=e.window_min_pages,
                                 pallas_splits=e.pallas_splits)
      return device.constrain(DecodeState.idle(cache, B), self.layout)
    return jax.jit(zeros) if self.layout is not None else zeros

  def release_kv(self) -> None:
    """Frees the KV pool's device memory (colocated: the trainer needs it); the next `run` or
    `insert_group` allocates a fresh one. Only between runs: no sequence may hold pages."""
    if any(self.pool.seq_id(s) is not None for s in range(self.ecfg.n_slots)):
      raise RuntimeError("release_kv with live sequences; free them first")
    if not self._kv_released:
      self.state.cache.k_LPSKH.delete()
      self.state.cache.v_LPSKH.delete()
      self._kv_released = True

  def _ensure_kv(self) -> None:
    if self._kv_released:
      self.state = self._zero_state()
      self._dev_table = self.pool.table()
      self._kv_released = False

  # -- weights -----------------------------------------------------------------------------------

  def update_weights(self, params, gen_id: int, policy: str = "keep_kv") -> None:
    """New weights, version `gen_id`, landing between decode chunks under `policy`:
      keep_kv           now; live sequences continue on K/V cached under the old weights
      finish_on_old     live sequences finish on the old weights; nothing new is admitted until
                        they have, then the swap (the old weights stay alive until then)
      abort_and_resume  now; live sequences drop their K/V and are re-prefilled (prompt + tokens
                        so far) under the new weights, then continue
    Tokens keep the gen_id they were sampled under. Outside `run`, every policy swaps at once.
    Inside `run` with overlap, the chunk already dispatched still runs on the old weights."""
    newest = self._pending.gen_id if self._pending else self.gen_id
    if gen_id <= newest:
      raise ValueError(f"gen_id must increase: engine holds {newest}, got {gen_id}")
    check_update(self.params, params, policy)  # the policy; tree, shapes, dtypes, devices: now, not at the next chunk
    self._pending = _Pending(params, gen_id, policy)
    if not self._running:
      self._swap()

  @property
  def newest_params(self):
    """The weights of the newest gen_id handed to update_weights: a pending update's until it swaps in."""
    return self._pending.params if self._pending is not None else self.params

  def _swap(self) -> None:
    self.params, self.gen_id, self._pending = self._pending.params, self._pending.gen_id, None
    self.stats["weight_updates"] += 1

  # -- host bookkeeping, dispatch and read-back ---------------------------------------------------

  def _admit_group(self, prompt_ids: Sequence[int], seq_ids: Sequence[int], *, max_new_tokens: int,
                   stop_ids: Sequence[int] = (), lookahead: int = 0,
                   later: Sequence[int] = ()) -> tuple[list[int], int | None]:
    """Pages and slots for a group (the prompt once, forks sharing its full pages, and each slot's
    pages for its first `lookahead` decode writes, so the prefill's page table is the one decode
    starts with); the prefill goes out with the next `_flush`. `later`: more sequences of the group
    with no slot yet: their first tokens are sampled now (read into `first_of`) and the prompt is
    pinned for `fork_pinned`. Returns (slots, pin id or None). Raises OutOfPages, with nothing
    changed, if the group does not fit."""
    self._ensure_kv()
    slots, copies, pin = self.pool.admit_group(seq_ids, len(prompt_ids), pin=bool(later),  # one data shard
                                               reserve=min(lookahead, max_new_tokens - 1))
    h = self.host
    for slot, sid in zip(slots, seq_ids, strict=True):
      self._epoch_B[slot] += 1
      self._rows.pop(slot, None)  # the prefill sets the whole row
      h.pos_B[slot], h.seq_B[slot], h.left_B[slot] = len(prompt_ids), sid, max_new_tokens - 1
      h.active_B[slot] = max_new_tokens > 1  # until its first token is read
      h.stop_BX[slot] = -1
      h.stop_BX[slot, : len(stop_ids)] = stop_ids
    self._waves.append(_Wave(list(prompt_ids), slots, list(seq_ids), max_new_tokens, tuple(stop_ids), copies,
                             self.pool.table()[slots[0]], [(sid, pin) for sid in later]))
    self.stats["prefills"] += 1
    self.stats["forks"] += len(slots) - 1
    return slots, pin

  def fork_pinned(self, pin: int, seq_id: int, n_prompt: int, *, max_new_tokens: int, stop_ids: Sequence[int] = (),
                  lookahead: int = 0) -> int:
    """Starts `seq_id` in a free slot from a pinned prompt, with the first token already sampled for
    it (in `first_of[(seq_id, pin)]`); the row and the partial-page copy go out with the next patch. OutOfPages:
    nothing changed."""
    slot, copy = self.pool.fork_pin(pin, seq_id)
    try:
      self.pool.ensure_capacity(slot, min(lookahead, max_new_tokens - 1))
    except OutOfPages:
      self.pool.free(slot)
      raise
    tok = self.first_of[(seq_id, pin)][0]
    left = max_new_tokens - 1
    active = left > 0 and tok not in self.ecfg.eos_ids and tok not in stop_ids
    h = self.host
    self._epoch_B[slot] += 1
    h.last_B[slot], h.pos_B[slot], h.seq_B[slot], h.left_B[slot], h.active_B[slot] = tok, n_prompt, seq_id, left, active
    h.stop_BX[slot] = -1
    h.stop_BX[slot, : len(stop_ids)] = stop_ids
    self._rows[slot] = (tok, n_prompt, seq_id, left, int(active), tuple(stop_ids))
    if copy is not None:
      self._copies[slot] = copy
    self.stats["forks"] += 1
    return slot

  def _flush(self) -> None:
    """Sends the host's changes: a patch (deactivated rows, a page table that grew), then the
    pending admission wave, one prefill per prompt-length bucket. A wave must go out before any
    of its slots can be freed (its prefill writes the pages they held)."""
    e = self.ecfg
    table = self.pool.table()
    live = self.host.active_B
    stale = not np.array_equal(table[live], self._dev_table[live])  # rows of idle slots are never read
    if self._rows or self._copies or (stale and not self._waves):
      self.state = patch(self.state, table, *uploads.patch_arrays(self.pool, self._rows, self._copies, MAX_STOP_IDS),
                         layout=self.layout)
      self._dev_table, self._rows, self._copies = table, {}, {}
      self.stats["uploads"] += 1
    by_bucket: dict[int, list[_Wave]] = collections.defaultdict(list)
    for w in self._waves:
      by_bucket[bucket_length(len(w.prompt_ids), e.min_bucket, e.max_pages_per_seq * e.page_size)].append(w)
    for T, waves in sorted(by_bucket.items()):
      self._unread.append(self._prefill(table, T, waves))
    if self._waves:
      self._dev_table, self._waves = table, []

  def _prefill(self, table, T: int, waves: list[_Wave]):
    arrays, rows = uploads.prefill_arrays(self.pool, waves, T, self.ecfg.pad_id, MAX_STOP_IDS, self._epoch_B,
                                          self.gen_id)
    self.state, tok_N, lp_N = prefill(self._static, self.params, self.state, self.key, table, *arrays,
                                      sampling=self.sampling, eos_ids=self.ecfg.eos_ids, layout=self.layout)
    self.stats["prefill_calls"] += 1
    self.stats["uploads"] += 1
    return tok_N, lp_N, rows

  def _dispatch(self, n_steps: int | None = None, exit_on_free: bool = False, pack: bool = False,
                after: _Dispatched | None = None) -> _Dispatched:
    """Flushes the host's changes and launches one chunk of K decode steps; nothing is read.
    `exit_on_free`: it ends once a data shard has max(1, 1/8 of its slots) fewer live rows than the host
    counts now (finished in it or in the chunk not yet read): waiting requests need not wait it out.
    `pack` (run()'s loop): the steps compute only the live rows (below). JetStream's `generate` does
    not pack: its chunks keep their fixed length (with impl "window" a chunk also ends early when its longest row
    outgrows the window, or the longest ends and the read's width falls). `after`: the dispatched chunk not read
    yet (impl "window" sizes its window from the host's token counts, which lag the device by that chunk's
    steps)."""
    self._flush()
    e = self.ecfg
    n_steps = n_steps or e.decode_chunk
    live_D = self.host.active_B.reshape(self.pool.n_shards, -1).sum(axis=1)
    free_batch = max(1, self.pool.slots_per_shard // 8)
    floor_D = (live_D - free_batch + 1 if exit_on_free else np.zeros_like(live_D)).astype(np.int32)
    # Decode only the live rows, packed into a power-of-two batch per shard of at least min_pack_rows (a
    # program per size used); the chunk ends once a shard's live rows fit half of it, so the next one runs on
    # half the batch. A row's tokens and log-probs do not depend on how many rows share its step.
    rows = self.pool.slots_per_shard
    if pack:
      rows = min(rows, max(e.min_pack_rows, _pow2(int(live_D.max()))))
      if rows > e.min_pack_rows:
        floor_D = np.where(live_D > rows // 2, np.maximum(floor_D, rows // 2 + 1), floor_D).astype(np.int32)
    if not 0 < n_steps <= e.chunk_capacity:
      raise ValueError(f"a chunk of {n_steps} steps; EngineConfig allows 1..{e.chunk_capacity} (chunk_capacity)")
    # The chunk length is traced (one program whatever it is); the outputs have chunk_capacity rows.
    window = self._window_pages(after)
    out = generate(self._static, self.params, self.state, self.key, floor_D, np.int32(n_steps),
                   sampling=self.sampling, capacity=e.chunk_capacity, eos_ids=e.eos_ids, pad_id=e.pad_id,
                   layout=self.layout, n_rows=0 if rows == self.pool.slots_per_shard else rows, window_pages=window)
    self.state, chunk = out[0], out[1:]
    firsts, self._unread = self._unread, []
    return _Dispatched(firsts, chunk, self._epoch_B.copy(), self.gen_id, rows=rows * self.pool.n_shards,
                       steps=n_steps, window=window, floored=bool(floor_D.max() > 1), live_B=self.host.active_B.copy())

  def _window_pages(self, after: _Dispatched | None) -> int:
    """impl "window": the window's pages for the next chunk (host_state.window_pages); 0 for the other reads."""
    if self.impl != "window":
      return 0
    return window_pages(self.host, self.pool.lengths(), self._epoch_B, after, self.ecfg.page_size,
                        self.ecfg.max_pages_per_seq, self.ecfg.window_min_pages)

  def _read(self, d: _Dispatched):
    """One blocking read of a dispatch's results; updates the host mirror and the pool for slots
    still holding the same sequence. Returns ({slot: (tokens, logprobs, gen_ids)}, chunk arrays)."""
    tree = ([(t, lp) for t, lp, _ in d.firsts], d.chunk)
    # One batched fetch on one process; across processes hostcomm gathers what is not local.
    firsts, chunk = jax.device_get(tree) if jax.process_count() == 1 else to_host(tree)
    self.stats["host_reads"] += 1
    h, e = self.host, self.ecfg
    new: dict[int, tuple[list[int], list[float], list[int]]] = {}
    for (tok_N, lp_N), (_, _, rows) in zip(firsts, d.firsts, strict=True):
      for n, (slot, epoch, gen_id) in rows.items():
        if slot == e.n_slots:  # no slot yet: `epoch` is (seq id, pin id)
          if self.pool.has_pin(epoch[1]):  # a pin dropped since (an update, a preemption) starts nobody
            self.first_of[epoch] = (int(tok_N[n]), float(lp_N[n]), gen_id)
          continue
        if self._epoch_B[slot] != epoch:
          continue
        tok = int(tok_N[n])
        h.last_B[slot] = tok
        h.active_B[slot] = h.left_B[slot] > 0 and tok not in e.eos_ids and tok not in h.stop_BX[slot]
        new[slot] = ([tok], [float(lp_N[n])], [gen_id])
        self.stats["tokens"] += 1
    if chunk is None:
      return new, None
    toks_KB, lps_KB, emitted_KB, active_B = chunk
    n_B = emitted_KB.sum(axis=0)
    for slot in np.flatnonzero((self._epoch_B == d.epoch_B) & ((n_B > 0) | h.active_B)):
      k = int(n_B[slot])
      if k:
        self.pool.advance(int(slot), k)
        h.pos_B[slot] += k
        h.left_B[slot] -= k
        h.last_B[slot] = toks_KB[k - 1, slot]
      h.active_B[slot] = active_B[slot]
      toks, lps, gids = new.setdefault(int(slot), ([], [], []))
      toks += toks_KB[:k, slot].tolist()
      lps += lps_KB[:k, slot].tolist()
      gids += [d.gen_id] * k
      self.stats["tokens"] += k
    count_chunk(self.stats, emitted_KB, d, e.n_slots)
    return new, chunk

  def _park(self, slot: int) -> None:
    """The slot keeps its pages but stops decoding (an episode waiting for its environment)."""
    self._epoch_B[slot] += 1
    if self.host.active_B[slot]:
      self._rows[slot] = (0, 0, 0, 0, 0, ())  # last, pos, seq, left, active=False, no stop ids
    self.host.active_B[slot] = False

  def _released(self, slot: int) -> None:
    """Host side of a freed slot (pool already freed): the device must stop decoding it if it may be live, and
    an episode's next turn queued for it (episodes.extend: a one-row wave) must not go out, or its prefill would
    write through the slot's old page table into pages with new owners (an abort or a preemption between the
    reply and the flush; the sequence resumes later from its tokens, the reply among them)."""
    queued = [w for w in self._waves if slot in w.slots]
    if any(len(w.slots) > 1 or w.later for w in queued):
      raise AssertionError(f"slot {slot} freed before its group's prefill went out")  # _flush's invariant
    if queued:
      self._waves = [w for w in self._waves if slot not in w.slots]
    self._epoch_B[slot] += 1
    self._copies.pop(slot, None)  # a fork freed before its copy went out: its page may have a new owner
    if self.host.active_B[slot]:
      self._rows[slot] = (0, 0, 0, 0, 0, ())  # last, pos, seq, left, active=False, no stop ids
    self.host.active_B[slot] = False

  # -- JetStream-shaped pieces ---------------------------------------------------------------------

  def insert_group(self, prompt_ids: Sequence[int], seq_ids: Sequence[int], *, max_new_tokens: int,
                   stop_ids: Sequence[int] = ()) -> list[tuple[int, int, float]]:
    """Prefills `prompt_ids` once into a new slot, forks it for the other sequences (sharing the
    prompt's full pages), samples each one's first token and makes the slots live for up to
    `max_new_tokens` tokens in all: (slot, first token, its log-prob) per sequence. Raises
    OutOfPages, with nothing changed, if the pool cannot hold the whole group now."""
    slots, _ = self._admit_group(prompt_ids, seq_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    self._flush()
    new, _ = self._read(_Dispatched(self._unread))
    self._unread = []
    return [(slot, new[slot][0][0], new[slot][1][0]) for slot in slots]

  def insert(self, prompt_ids: Sequence[int], seq_id: int, **kw) -> tuple[int, int, float]:
    """One sequence: `insert_group` with a group of one."""
    return self.insert_group(prompt_ids, [seq_id], **kw)[0]

  def generate(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """K decode steps for every live slot (fewer with impl "window" when the longest row outgrows its window):
    (tokens_KB, logprobs_KB, emitted_KB) on the host.
    A slot stops emitting at EOS / its stop ids / its length budget and stays inactive (its pages
    held) until `free`. Raises OutOfPages if a live slot cannot get pages for the chunk."""
    e, h = self.ecfg, self.host
    for slot in np.flatnonzero(h.active_B):
      self.pool.ensure_capacity(int(slot), int(min(e.decode_chunk, h.left_B[slot])))
    _, (toks, lps, emitted, _) = self._read(self._dispatch())
    K = e.decode_chunk
    return toks[:K], lps[:K], emitted[:K]

  def free(self, slot: int) -> None:
    """Returns the slot's pages (shared prompt pages when the last sibling goes)."""
    self.pool.free(slot)
    self._released(slot)

  # -- the loop ------------------------------------------------------------------------------------

  def run(self, requests: Sequence[Request], on_chunk: Callable[[RolloutEngine], None] | None = None, *,
          key: jax.Array | None = None, sampling: SamplingConfig | None = None, seq_base: int = 0,
          turns=None, tag=0) -> list[Sample]:
    """Generates every request's n samples; returns them request-major. `on_chunk(engine)` runs
    between decode chunks, e.g. to `update_weights` (which then lands under its policy). `key`
    replaces the engine's sampling key from now on (the RL loop gives each step its own); `sampling`
    replaces `ecfg.sampling` for this call only (e.g. greedy evaluation); sequence ids (with the key,
    they fix the sampling keys) count from `seq_base`."""
    with self.stream(on_chunk, key=key, sampling=sampling, turns=turns) as stream:
      stream.add(requests, tag, seq_base=seq_base)  # tag: names the batch to `turns` (episodes.py)
      return stream.run_until(tag)

  @contextlib.contextmanager
  def stream(self, on_chunk: Callable[[RolloutEngine], None] | None = None, on_group=None, *,
             key: jax.Array | None = None, sampling: SamplingConfig | None = None, turns=None):
    """A `stream.Stream` open for the `with` block: batches added and returned while others decode.
    One stream generates at a time; another may open inside it (e.g. `run` for an evaluation) only
    while it is idle, and the outer stream's key and sampling come back after it."""
    outer = self._stream
    if outer is not None and outer.busy():
      raise RuntimeError("the engine is generating (an open stream has sequences); drain it first")
    saved = self.key, self.sampling
    if key is not None:
      self.key = device.key_on_mesh(key, self.mesh)
    self.sampling = sampling or self.ecfg.sampling
    self._running = True
    stream = self._stream = Stream(self, on_chunk, on_group, turns)  # turns: episodes.py
    try:
      yield stream
      stream.close()
    except BaseException:
      self._abandon()
      raise
    finally:
      self._stream, self._running = outer, outer is not None
      self.sampling = saved[1] if outer is not None else self.ecfg.sampling
      if outer is not None:
        self.key = saved[0]
