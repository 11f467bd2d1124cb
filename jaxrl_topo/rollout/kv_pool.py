"""Host-side bookkeeping of the paged KV cache: free pages, refcounts, page table, preemption.

Alphabet: P=pages, B=slots (decode rows), M=max pages per sequence. Position p of the sequence
in slot b lives on page `table_BM[b, p // page_size]` at offset p % page_size (rollout/paged.py's
layout); -1 = unassigned, assigned entries form a prefix of the row, `lengths_B` counts tokens
written. Lifecycle: `admit` (length = prompt length; the caller prefills at once) or `fork`, then
per decode chunk `ensure_capacity(slot, K)`, device writes, `advance(slot, k)`; then `free`.
Pages go out lowest id first, so the state after frees does not depend on their order.

Out-of-pages contract: `admit`, `fork` and `ensure_capacity` raise `OutOfPages` BEFORE touching
any state; its `needed` is the free-page count that lets the call succeed. The engine calls
`preempt_youngest(err.needed)`, requeues the returned seq ids for recomputation (vLLM's
"recompute" preemption; the requester may be among them) and retries. `OutOfSlots`: every row
is busy, wait for one to finish. Misuse raises ValueError naming the slot, seq and numbers.

Pins (a GRPO group whose samples start as slots free up): `pin(slot)` keeps the slot's current
tokens (its prompt) alive without a slot: +1 on its full pages and a private copy of its partial
page; `fork_pin(pin, seq)` starts a sequence from them (as `fork` does from a slot), `unpin` drops
them. Pinned pages are counted by `check` like a slot's; `preempt_youngest` never touches pins
(the caller unpins first when it must).

Copy-on-write is eager: `fork` shares the source's FULL pages (refcount + 1) and gives the child
a private copy of the partial last page at once, returning (src_page, dst_page) for the device
to copy before any later write. So shared pages are always full and decode never writes into
one: no per-write refcount check on device. Lazy COW would save nothing in GRPO, since every
sibling writes its first sampled token into that page at the very next step.

Data shards (`n_shards` = the rollout mesh's `data` axis): shard d owns slots [d*B/D, (d+1)*B/D) and
pages [d*P/D, (d+1)*P/D), the rows and pages of the KV pool its devices hold, and a slot only ever
gets pages of its own shard (one free list per shard). A fork, pin or fork_pin stays in its
source's shard, since they share pages; `admit_group` picks one shard for a whole GRPO group.
`OutOfPages.shard` says which shard ran out, and `preempt_youngest(needed, shard)` frees only there.
Table entries stay global page ids; the device translates them to its shard's (device.py).
"""

import heapq
from collections.abc import Hashable, Sequence

import numpy as np


class PoolExhausted(RuntimeError):
  """Base of the recoverable signals: the engine preempts or waits, then retries."""


class OutOfPages(PoolExhausted):
  """Too few free pages; state is untouched. `preempt_youngest(err.needed)` makes room."""

  def __init__(self, what: str, needed: int, free: int, shard: int = 0):
    where = f" in data shard {shard}" if shard else ""
    super().__init__(f"{what}: needs {needed} free pages, only {free} free{where}")
    self.needed, self.free, self.shard = needed, free, shard


class OutOfSlots(PoolExhausted):
  """Every slot holds a sequence; state is untouched."""


def _require(ok: bool, msg: str) -> None:
  if not ok:  # not `assert`: check() must still check under python -O
    raise AssertionError(msg)


class PagePool:
  """Free lists (one per data shard), per-page refcounts and the per-slot page table of one paged KV cache."""

  def __init__(self, n_pages: int, page_size: int, n_slots: int, max_pages_per_seq: int, n_shards: int = 1):
    if min(n_pages, page_size, n_slots, max_pages_per_seq, n_shards) < 1:
      raise ValueError(f"PagePool: all sizes must be >= 1, got {n_pages=} {page_size=} {n_slots=} "
                       f"{max_pages_per_seq=} {n_shards=}")
    if n_pages % n_shards or n_slots % n_shards:
      raise ValueError(f"PagePool: n_pages={n_pages} and n_slots={n_slots} must be multiples of the data shards "
                       f"({n_shards}): each shard owns n_pages / {n_shards} pages and n_slots / {n_shards} slots")
    self.n_pages, self.page_size = int(n_pages), int(page_size)
    self.n_slots, self.max_pages_per_seq = int(n_slots), int(max_pages_per_seq)
    self.n_shards = int(n_shards)
    self.pages_per_shard, self.slots_per_shard = self.n_pages // self.n_shards, self.n_slots // self.n_shards
    self.max_len = self.page_size * self.max_pages_per_seq  # longest sequence a slot can hold
    P = self.pages_per_shard  # min-heaps, one per shard: sorted lists already are heaps
    self._free = [list(range(d * P, (d + 1) * P)) for d in range(self.n_shards)]
    self._ref_P = np.zeros(self.n_pages, np.int32)
    self._table_BM = np.full((self.n_slots, self.max_pages_per_seq), -1, np.int32)
    self._alloc_B = np.zeros(self.n_slots, np.int32)  # pages assigned to each slot (a prefix of its table row)
    self._len_B = np.zeros(self.n_slots, np.int32)
    self._order_B = np.full(self.n_slots, -1, np.int64)  # admission stamp; -1 = empty slot
    self._seq_B: list[Hashable | None] = [None] * self.n_slots
    self._slot_of: dict[Hashable, int] = {}
    self._stamp = self._n_preempted = self._n_forks = 0
    self._pins: dict[int, tuple[np.ndarray, int, int]] = {}  # pin id -> (its pages, tokens on them, shard)
    self._next_pin = 0

  def table(self) -> np.ndarray:
    """int32 [n_slots, max_pages_per_seq] copy for the device (-1 = unassigned), global page ids."""
    return self._table_BM.copy()

  def lengths(self) -> np.ndarray:
    return self._len_B.copy()

  def seq_id(self, slot: int) -> Hashable | None:
    return self._seq_B[slot]

  def slot_of(self, seq_id: Hashable) -> int | None:
    return self._slot_of.get(seq_id)

  def shard_of_slot(self, slot: int) -> int:
    return int(slot) // self.slots_per_shard

  def pin_shard(self, pin_id: int) -> int:
    return self._pins[pin_id][2]

  def n_free_pages(self, shard: int | None = None) -> int:
    """Free pages of one shard, or of the whole pool."""
    return len(self._free[shard]) if shard is not None else sum(map(len, self._free))

  def n_free_slots(self, shard: int | None = None) -> int:
    """Free slots of one shard, or of the whole pool."""
    order_b = self._order_B if shard is None else self._order_B[self._slots(shard)]
    return int(np.count_nonzero(order_b < 0))  # an empty slot's stamp is -1 (check() holds it)

  def max_free_slots(self) -> int:
    """The most free slots one shard has: the largest group that can start at once."""
    return max(self.n_free_slots(d) for d in range(self.n_shards))

  def stats(self) -> dict[str, int]:
    return dict(free_pages=self.n_free_pages(), used_pages=int(np.count_nonzero(self._ref_P)),
                shared_pages=int(np.count_nonzero(self._ref_P >= 2)), active_slots=len(self._slot_of),
                preemptions=self._n_preempted, forks=self._n_forks)

  def admit(self, seq_id: Hashable, n_tokens: int, shard: int = 0, slot: int | None = None) -> int:
    """Pages for a prompt of n_tokens in the shard's lowest free slot (or in `slot`, which must be free;
    its shard then is the slot's); the slot's length is n_tokens."""
    if not 1 <= n_tokens <= self.max_len:
      raise ValueError(f"admit seq {seq_id!r}: prompt of {n_tokens} tokens, allowed 1..{self.max_len} "
                       f"({self.max_pages_per_seq} pages x {self.page_size})")
    if slot is None:
      slot = self._find_slot(seq_id, "admit", shard)
    else:
      self._check_new_seq(seq_id, "admit")
      if not 0 <= slot < self.n_slots or self._seq_B[slot] is not None:
        raise ValueError(f"admit seq {seq_id!r}: slot {slot} is out of range or busy")
      shard = self.shard_of_slot(slot)
    pages = self._alloc(self._pages_for(n_tokens), f"admit seq {seq_id!r} ({n_tokens} tokens)", shard)
    self._table_BM[slot, :len(pages)] = pages
    self._alloc_B[slot] = len(pages)
    self._occupy(slot, seq_id, n_tokens)
    return slot

  def admit_group(self, seq_ids: Sequence[Hashable], n_tokens: int, *, pin: bool = False,
                  reserve: int = 0) -> tuple[list[int], list[tuple[int, int]], int | None]:
    """A GRPO group in ONE data shard (its samples share the prompt's pages): the prompt admitted for
    seq_ids[0], forked for the others, pinned when `pin` (samples that start later fork the pin), and
    pages for `reserve` more tokens per slot. Tries the shards with enough free slots, most free slots
    then most free pages first. Returns (slots, (src, dst) page copies, pin id or None). OutOfSlots /
    OutOfPages (that of the shard with the most free pages): nothing changed."""
    room = [d for d in range(self.n_shards) if self.n_free_slots(d) >= len(seq_ids)]
    if not room:
      raise OutOfSlots(f"admit group {list(seq_ids)!r}: no data shard has {len(seq_ids)} free slots")
    room.sort(key=lambda d: (-self.n_free_slots(d), -self.n_free_pages(d), d))
    errors = []
    for shard in room:
      try:
        return self._admit_group_in(shard, seq_ids, n_tokens, pin, reserve)
      except OutOfPages as err:
        errors.append(err)
    raise max(errors, key=lambda e: e.free)

  def _admit_group_in(self, shard: int, seq_ids, n_tokens: int, pin: bool, reserve: int):
    slots, copies, pin_id = [], [], None
    try:
      slots.append(self.admit(seq_ids[0], n_tokens, shard))
      for sid in seq_ids[1:]:
        slot, copy = self.fork(slots[0], sid)
        slots.append(slot)
        copies += [copy] if copy is not None else []
      if pin:
        pin_id, copy = self.pin(slots[0])
        copies += [copy] if copy is not None else []
      for slot in slots:
        self.ensure_capacity(slot, reserve)
    except PoolExhausted:  # nothing stays allocated
      if pin_id is not None:
        self.unpin(pin_id)
      for slot in reversed(slots):
        self.free(slot)
      self._n_forks -= len(slots) - 1 if slots else 0
      raise
    return slots, copies, pin_id

  def fork(self, src_slot: int, seq_id: Hashable) -> tuple[int, tuple[int, int] | None]:
    """New slot (in src's shard) sharing src's full pages; returns (slot, (src_page, dst_page) to copy or None)."""
    src = self._check_active(src_slot, "fork")
    shard = self.shard_of_slot(src)
    slot = self._find_slot(seq_id, "fork", shard)
    return self._start_from(self._table_BM[src], int(self._len_B[src]), seq_id, slot, f"fork of slot {src}")

  def pin(self, slot: int) -> tuple[int, tuple[int, int] | None]:
    """Keeps the slot's tokens so far alive without a slot: (pin id, (src_page, dst_page) to copy or None)."""
    src = self._check_active(slot, "pin")
    shard = self.shard_of_slot(src)
    n = int(self._len_B[src])
    n_full, partial = divmod(n, self.page_size)
    new = self._alloc(1 if partial else 0, f"pin of slot {src}", shard)
    pages = self._table_BM[src, :n_full].copy()
    self._ref_P[pages] += 1
    copy = None
    if partial:
      copy = (int(self._table_BM[src, n_full]), new[0])
      pages = np.append(pages, new[0]).astype(np.int32)
    pin_id, self._next_pin = self._next_pin, self._next_pin + 1
    self._pins[pin_id] = (pages, n, shard)
    return pin_id, copy

  def fork_pin(self, pin_id: int, seq_id: Hashable) -> tuple[int, tuple[int, int] | None]:
    """A new slot (in the pin's shard) starting from the pinned tokens, as `fork`."""
    pages, n, shard = self._pins[pin_id]
    slot = self._find_slot(seq_id, "fork_pin", shard)
    return self._start_from(pages, n, seq_id, slot, f"fork of pin {pin_id}")

  def _start_from(self, pages_M, n: int, seq_id: Hashable, slot: int, what: str):
    """Slot `slot` := n tokens on pages_M: full pages shared, the partial one copied (eager COW)."""
    n_full, partial = divmod(n, self.page_size)
    new = self._alloc(1 if partial else 0, f"{what} into seq {seq_id!r}", self.shard_of_slot(slot))
    self._table_BM[slot, :n_full] = pages_M[:n_full]
    self._ref_P[pages_M[:n_full]] += 1
    copy = None
    if partial:  # the child's private copy of the page its source is still writing into
      copy = (int(pages_M[n_full]), new[0])
      self._table_BM[slot, n_full] = new[0]
    self._alloc_B[slot] = n_full + len(new)
    self._occupy(slot, seq_id, n)
    self._n_forks += 1
    return slot, copy

  def unpin(self, pin_id: int) -> list[int]:
    """Drops a pin; returns the pages whose refcount reached 0."""
    pages, _, _ = self._pins.pop(pin_id)
    return self._release(pages)

  def pins(self) -> list[int]:
    return list(self._pins)

  def has_pin(self, pin_id: int) -> bool:
    return pin_id in self._pins

  def fits(self, n_new_tokens: dict[int, int]) -> bool:
    """Whether `ensure_capacity(slot, n)` for every {slot: n} would find its pages free (nothing
    allocated here)."""
    slots_N = np.fromiter(n_new_tokens, np.int64, len(n_new_tokens))
    short_N = self.shortfall(slots_N, np.fromiter(n_new_tokens.values(), np.int64, len(n_new_tokens)))
    need_D = np.bincount(slots_N // self.slots_per_shard, weights=short_N, minlength=self.n_shards)
    return all(k <= self.n_free_pages(d) for d, k in enumerate(need_D))

  def shortfall(self, slots_N: np.ndarray, n_new_N: np.ndarray) -> np.ndarray:
    """Pages `ensure_capacity(slot, n)` would allocate for each slot and n (0 where it has them)."""
    end_N = self._len_B[slots_N] + n_new_N
    return np.maximum(0, -(-end_N // self.page_size) - self._alloc_B[slots_N])

  def ensure_capacity(self, slot: int, n_new_tokens: int) -> list[int]:
    """Allocates pages so positions [len, len + n_new_tokens) are writable; returns new pages."""
    slot = self._check_active(slot, "ensure_capacity")
    end = int(self._len_B[slot]) + n_new_tokens
    if n_new_tokens < 0 or end > self.max_len:
      raise ValueError(f"ensure_capacity slot {slot} (seq {self._seq_B[slot]!r}): {self._len_B[slot]} + "
                       f"{n_new_tokens} tokens, allowed 0..{self.max_len}")
    have = self._n_alloc(slot)
    # Position len is never on a shared page (those are full), so no copy is ever needed here.
    new = self._alloc(max(0, self._pages_for(end) - have), f"ensure_capacity slot {slot} (+{n_new_tokens})",
                      self.shard_of_slot(slot))
    self._table_BM[slot, have:have + len(new)] = new
    self._alloc_B[slot] += len(new)
    return new

  def advance(self, slot: int, n: int) -> None:
    """Records n more tokens written; they must lie on pages already allocated."""
    slot = self._check_active(slot, "advance")
    cap = self._n_alloc(slot) * self.page_size
    if n < 0 or self._len_B[slot] + n > cap:
      raise ValueError(f"advance slot {slot} (seq {self._seq_B[slot]!r}): {self._len_B[slot]} + {n} tokens "
                       f"past {cap} allocated; call ensure_capacity first")
    self._len_B[slot] += n

  def rewind(self, slot: int, n: int) -> None:
    """Positions >= n may be written again (an episode's turn cut at a stop string); pages stay allocated."""
    slot = self._check_active(slot, "rewind")
    if not 0 < n <= self._len_B[slot] + 1:
      raise ValueError(f"rewind slot {slot} (seq {self._seq_B[slot]!r}) to {n}: it holds {self._len_B[slot]} tokens")
    self._len_B[slot] = min(n, self._len_B[slot])

  def free(self, slot: int) -> list[int]:
    """Releases the slot; returns the pages whose refcount reached 0 (back on the free list)."""
    slot = self._check_active(slot, "free")
    released = self._release(self._table_BM[slot, :self._n_alloc(slot)])
    del self._slot_of[self._seq_B[slot]]
    self._table_BM[slot] = -1
    self._alloc_B[slot] = 0
    self._len_B[slot], self._order_B[slot], self._seq_B[slot] = 0, -1, None
    return released

  def preempt_youngest(self, needed_pages: int, shard: int = 0) -> list[Hashable]:
    """Frees the shard's most recently admitted/forked sequences until needed_pages are free there.

    Returns their seq ids, youngest first, for the engine to requeue and recompute. Freeing a
    forked child may release only its private pages; the loop simply goes on to the next one.
    """
    if needed_pages > self.pages_per_shard:
      where = "the pool" if self.n_shards == 1 else f"data shard {shard} of the pool"
      raise ValueError(f"preempt_youngest: {needed_pages} pages needed, {where} has {self.pages_per_shard}")
    preempted = []
    order_b = self._order_B[self._slots(shard)]
    while len(self._free[shard]) < needed_pages and (order_b >= 0).any():  # ends: all freed frees all unpinned
      slot = self._slots(shard).start + int(np.argmax(order_b))
      preempted.append(self._seq_B[slot])
      self.free(slot)
      self._n_preempted += 1
      order_b = self._order_B[self._slots(shard)]
    return preempted

  def check(self) -> None:
    """Raises AssertionError naming the first broken invariant; tests call it after every op."""
    tab = self._table_BM
    held = [tab[tab >= 0]] + [pages for pages, _, _ in self._pins.values()]
    counts_P = np.bincount(np.concatenate(held), minlength=self.n_pages)
    _require(np.array_equal(counts_P, self._ref_P), f"refcounts {self._ref_P} != table entries {counts_P}")
    free = [p for heap in self._free for p in heap]
    _require(len(set(free)) == len(free), f"duplicate on the free list {sorted(free)}")
    _require(not self._ref_P[free].any(), f"a free page is in a table: {sorted(free)}")
    _require(len(free) + np.count_nonzero(self._ref_P) == self.n_pages, "a page is neither free nor used")
    for d, heap in enumerate(self._free):
      _require(all(p // self.pages_per_shard == d for p in heap), f"shard {d}'s free list holds {sorted(heap)}")
    for pin_id, (pages, n, d) in self._pins.items():
      _require(len(pages) == self._pages_for(n), f"pin {pin_id}: {len(pages)} pages for {n} tokens")
      _require(bool((pages // self.pages_per_shard == d).all()), f"pin {pin_id} of shard {d} holds pages {pages}")
    _require(len(self._slot_of) == sum(s is not None for s in self._seq_B), "seq index out of sync")
    _require(np.array_equal(self._alloc_B, (tab >= 0).sum(axis=1)), f"page counts {self._alloc_B} out of sync")
    for slot in range(self.n_slots):
      self._check_slot(slot)

  def _check_slot(self, slot: int) -> None:
    row, n, seq = self._table_BM[slot], int(self._len_B[slot]), self._seq_B[slot]
    have = self._n_alloc(slot)
    _require(bool((row[:have] >= 0).all()), f"slot {slot}: assigned pages are not a prefix: {row}")
    _require(len(set(row[:have].tolist())) == have, f"slot {slot}: a page appears twice: {row}")
    _require(bool((row[:have] // self.pages_per_shard == self.shard_of_slot(slot)).all()),
             f"slot {slot} of shard {self.shard_of_slot(slot)} holds pages of another shard: {row}")
    if seq is None:
      _require(have == 0 and n == 0 and self._order_B[slot] == -1, f"empty slot {slot} holds state")
      return
    _require(self._slot_of.get(seq) == slot, f"slot {slot}: seq {seq!r} indexed elsewhere")
    _require(self._pages_for(n) <= have, f"slot {slot}: {n} tokens on {have} pages of {self.page_size}")
    for i, page in enumerate(row[:have]):  # the COW invariant: nobody can write a shared page
      _require(self._ref_P[page] < 2 or n >= (i + 1) * self.page_size,
               f"slot {slot}: shared page {page} (index {i}) not full at length {n}")

  def _slots(self, shard: int) -> slice:
    return slice(shard * self.slots_per_shard, (shard + 1) * self.slots_per_shard)

  def _pages_for(self, n_tokens: int) -> int:
    return -(-n_tokens // self.page_size)

  def _n_alloc(self, slot: int) -> int:
    return int(self._alloc_B[slot])

  def _check_active(self, slot: int, what: str) -> int:
    if not 0 <= slot < self.n_slots:
      raise ValueError(f"{what}: slot {slot} out of range 0..{self.n_slots - 1}")
    if self._seq_B[slot] is None:
      raise ValueError(f"{what}: slot {slot} holds no sequence (already free or never admitted)")
    return int(slot)

  def _check_new_seq(self, seq_id: Hashable, what: str) -> None:
    if seq_id is None or seq_id in self._slot_of:
      raise ValueError(f"{what}: seq id {seq_id!r} is None or already in slot {self._slot_of.get(seq_id)}")

  def _find_slot(self, seq_id: Hashable, what: str, shard: int) -> int:
    self._check_new_seq(seq_id, what)
    if not 0 <= shard < self.n_shards:
      raise ValueError(f"{what}: data shard {shard} out of range 0..{self.n_shards - 1}")
    rows = self._slots(shard)
    if None not in self._seq_B[rows]:
      where = "" if self.n_shards == 1 else f" of data shard {shard}"
      raise OutOfSlots(f"{what} seq {seq_id!r}: all {self.slots_per_shard} slots{where} busy")
    return rows.start + self._seq_B[rows].index(None)

  def _alloc(self, n: int, what: str, shard: int) -> list[int]:
    free = self._free[shard]
    if n > len(free):  # raise before popping anything: callers rely on untouched state
      raise OutOfPages(what, n, len(free), shard)
    pages = [heapq.heappop(free) for _ in range(n)]
    self._ref_P[pages] = 1
    return pages

  def _release(self, pages) -> list[int]:
    """Refcount - 1 on each page; those reaching 0 go back on their shard's free list."""
    self._ref_P[pages] -= 1
    released = [int(p) for p in pages if self._ref_P[p] == 0]
    for p in released:
      heapq.heappush(self._free[p // self.pages_per_shard], p)
    return released

  def _occupy(self, slot: int, seq_id: Hashable, n_tokens: int) -> None:
    self._seq_B[slot], self._slot_of[seq_id] = seq_id, slot
    self._len_B[slot], self._order_B[slot] = n_tokens, self._stamp
    self._stamp += 1
