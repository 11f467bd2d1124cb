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
"""

import heapq
from collections.abc import Hashable

import numpy as np


class PoolExhausted(RuntimeError):
  """Base of the recoverable signals: the engine preempts or waits, then retries."""


class OutOfPages(PoolExhausted):
  """Too few free pages; state is untouched. `preempt_youngest(err.needed)` makes room."""

  def __init__(self, what: str, needed: int, free: int):
    super().__init__(f"{what}: needs {needed} free pages, only {free} free")
    self.needed, self.free = needed, free


class OutOfSlots(PoolExhausted):
  """Every slot holds a sequence; state is untouched."""


def _require(ok: bool, msg: str) -> None:
  if not ok:  # not `assert`: check() must still check under python -O
    raise AssertionError(msg)


class PagePool:
  """Free list, per-page refcounts and the per-slot page table of one paged KV cache."""

  def __init__(self, n_pages: int, page_size: int, n_slots: int, max_pages_per_seq: int):
    if min(n_pages, page_size, n_slots, max_pages_per_seq) < 1:
      raise ValueError(f"PagePool: all sizes must be >= 1, got {n_pages=} {page_size=} {n_slots=} "
                       f"{max_pages_per_seq=}")
    self.n_pages, self.page_size = int(n_pages), int(page_size)
    self.n_slots, self.max_pages_per_seq = int(n_slots), int(max_pages_per_seq)
    self.max_len = self.page_size * self.max_pages_per_seq  # longest sequence a slot can hold
    self._free = list(range(self.n_pages))  # a min-heap: sorted lists already are one
    self._ref_P = np.zeros(self.n_pages, np.int32)
    self._table_BM = np.full((self.n_slots, self.max_pages_per_seq), -1, np.int32)
    self._len_B = np.zeros(self.n_slots, np.int32)
    self._order_B = np.full(self.n_slots, -1, np.int64)  # admission stamp; -1 = empty slot
    self._seq_B: list[Hashable | None] = [None] * self.n_slots
    self._slot_of: dict[Hashable, int] = {}
    self._stamp = self._n_preempted = self._n_forks = 0
    self._pins: dict[int, tuple[np.ndarray, int]] = {}  # pin id -> (its pages, tokens on them)
    self._next_pin = 0

  def table(self) -> np.ndarray:
    """int32 [n_slots, max_pages_per_seq] copy for the device (-1 = unassigned)."""
    return self._table_BM.copy()

  def lengths(self) -> np.ndarray:
    return self._len_B.copy()

  def seq_id(self, slot: int) -> Hashable | None:
    return self._seq_B[slot]

  def slot_of(self, seq_id: Hashable) -> int | None:
    return self._slot_of.get(seq_id)

  def n_free_pages(self) -> int:
    return len(self._free)

  def stats(self) -> dict[str, int]:
    return dict(free_pages=len(self._free), used_pages=int(np.count_nonzero(self._ref_P)),
                shared_pages=int(np.count_nonzero(self._ref_P >= 2)), active_slots=len(self._slot_of),
                preemptions=self._n_preempted, forks=self._n_forks)

  def admit(self, seq_id: Hashable, n_tokens: int) -> int:
    """Pages for a prompt of n_tokens in the lowest free slot; the slot's length is n_tokens."""
    if not 1 <= n_tokens <= self.max_len:
      raise ValueError(f"admit seq {seq_id!r}: prompt of {n_tokens} tokens, allowed 1..{self.max_len} "
                       f"({self.max_pages_per_seq} pages x {self.page_size})")
    slot = self._find_slot(seq_id, "admit")
    pages = self._alloc(self._pages_for(n_tokens), f"admit seq {seq_id!r} ({n_tokens} tokens)")
    self._table_BM[slot, :len(pages)] = pages
    self._occupy(slot, seq_id, n_tokens)
    return slot

  def fork(self, src_slot: int, seq_id: Hashable) -> tuple[int, tuple[int, int] | None]:
    """New slot sharing src's full pages; returns (slot, (src_page, dst_page) to copy or None)."""
    src = self._check_active(src_slot, "fork")
    n = int(self._len_B[src])
    n_full, partial = divmod(n, self.page_size)
    slot = self._find_slot(seq_id, "fork")
    new = self._alloc(1 if partial else 0, f"fork of slot {src} into seq {seq_id!r}")
    shared = self._table_BM[src, :n_full]
    self._table_BM[slot, :n_full] = shared
    self._ref_P[shared] += 1
    copy = None
    if partial:  # eager COW: the child's private copy of the page src is still writing into
      copy = (int(self._table_BM[src, n_full]), new[0])
      self._table_BM[slot, n_full] = new[0]
    self._occupy(slot, seq_id, n)
    self._n_forks += 1
    return slot, copy

  def pin(self, slot: int) -> tuple[int, tuple[int, int] | None]:
    """Keeps the slot's tokens so far alive without a slot: (pin id, (src_page, dst_page) to copy or None)."""
    src = self._check_active(slot, "pin")
    n = int(self._len_B[src])
    n_full, partial = divmod(n, self.page_size)
    new = self._alloc(1 if partial else 0, f"pin of slot {src}")
    pages = self._table_BM[src, :n_full].copy()
    self._ref_P[pages] += 1
    copy = None
    if partial:
      copy = (int(self._table_BM[src, n_full]), new[0])
      pages = np.append(pages, new[0]).astype(np.int32)
    pin_id, self._next_pin = self._next_pin, self._next_pin + 1
    self._pins[pin_id] = (pages, n)
    return pin_id, copy

  def fork_pin(self, pin_id: int, seq_id: Hashable) -> tuple[int, tuple[int, int] | None]:
    """A new slot starting from the pinned tokens (full pages shared, partial page copied), as `fork`."""
    pages, n = self._pins[pin_id]
    n_full, partial = divmod(n, self.page_size)
    slot = self._find_slot(seq_id, "fork_pin")
    new = self._alloc(1 if partial else 0, f"fork of pin {pin_id} into seq {seq_id!r}")
    self._table_BM[slot, :n_full] = pages[:n_full]
    self._ref_P[pages[:n_full]] += 1
    copy = None
    if partial:
      copy = (int(pages[n_full]), new[0])
      self._table_BM[slot, n_full] = new[0]
    self._occupy(slot, seq_id, n)
    self._n_forks += 1
    return slot, copy

  def unpin(self, pin_id: int) -> list[int]:
    """Drops a pin; returns the pages whose refcount reached 0."""
    pages, _ = self._pins.pop(pin_id)
    self._ref_P[pages] -= 1
    released = [int(p) for p in pages if self._ref_P[p] == 0]
    for p in released:
      heapq.heappush(self._free, p)
    return released

  def pins(self) -> list[int]:
    return list(self._pins)

  def ensure_capacity(self, slot: int, n_new_tokens: int) -> list[int]:
    """Allocates pages so positions [len, len + n_new_tokens) are writable; returns new pages."""
    slot = self._check_active(slot, "ensure_capacity")
    end = int(self._len_B[slot]) + n_new_tokens
    if n_new_tokens < 0 or end > self.max_len:
      raise ValueError(f"ensure_capacity slot {slot} (seq {self._seq_B[slot]!r}): {self._len_B[slot]} + "
                       f"{n_new_tokens} tokens, allowed 0..{self.max_len}")
    have = self._n_alloc(slot)
    # Position len is never on a shared page (those are full), so no copy is ever needed here.
    new = self._alloc(max(0, self._pages_for(end) - have), f"ensure_capacity slot {slot} (+{n_new_tokens})")
    self._table_BM[slot, have:have + len(new)] = new
    return new

  def advance(self, slot: int, n: int) -> None:
    """Records n more tokens written; they must lie on pages already allocated."""
    slot = self._check_active(slot, "advance")
    cap = self._n_alloc(slot) * self.page_size
    if n < 0 or self._len_B[slot] + n > cap:
      raise ValueError(f"advance slot {slot} (seq {self._seq_B[slot]!r}): {self._len_B[slot]} + {n} tokens "
                       f"past {cap} allocated; call ensure_capacity first")
    self._len_B[slot] += n

  def free(self, slot: int) -> list[int]:
    """Releases the slot; returns the pages whose refcount reached 0 (back on the free list)."""
    slot = self._check_active(slot, "free")
    pages = self._table_BM[slot, :self._n_alloc(slot)]
    self._ref_P[pages] -= 1
    released = [int(p) for p in pages if self._ref_P[p] == 0]
    for p in released:
      heapq.heappush(self._free, p)
    del self._slot_of[self._seq_B[slot]]
    self._table_BM[slot] = -1
    self._len_B[slot], self._order_B[slot], self._seq_B[slot] = 0, -1, None
    return released

  def preempt_youngest(self, needed_pages: int) -> list[Hashable]:
    """Frees the most recently admitted/forked sequences until needed_pages are free.

    Returns their seq ids, youngest first, for the engine to requeue and recompute. Freeing a
    forked child may release only its private pages; the loop simply goes on to the next one.
    """
    if needed_pages > self.n_pages:
      raise ValueError(f"preempt_youngest: {needed_pages} pages needed, the pool has {self.n_pages}")
    preempted = []
    while len(self._free) < needed_pages and self._slot_of:  # ends: every slot freed frees all unpinned pages
      slot = int(np.argmax(self._order_B))
      preempted.append(self._seq_B[slot])
      self.free(slot)
      self._n_preempted += 1
    return preempted

  def check(self) -> None:
    """Raises AssertionError naming the first broken invariant; tests call it after every op."""
    tab = self._table_BM
    held = [tab[tab >= 0]] + [pages for pages, _ in self._pins.values()]
    counts_P = np.bincount(np.concatenate(held), minlength=self.n_pages)
    _require(np.array_equal(counts_P, self._ref_P), f"refcounts {self._ref_P} != table entries {counts_P}")
    _require(len(set(self._free)) == len(self._free), f"duplicate on the free list {sorted(self._free)}")
    _require(not self._ref_P[self._free].any(), f"a free page is in a table: {sorted(self._free)}")
    _require(len(self._free) + np.count_nonzero(self._ref_P) == self.n_pages, "a page is neither free nor used")
    for pin_id, (pages, n) in self._pins.items():
      _require(len(pages) == self._pages_for(n), f"pin {pin_id}: {len(pages)} pages for {n} tokens")
    _require(len(self._slot_of) == sum(s is not None for s in self._seq_B), "seq index out of sync")
    for slot in range(self.n_slots):
      self._check_slot(slot)

  def _check_slot(self, slot: int) -> None:
    row, n, seq = self._table_BM[slot], int(self._len_B[slot]), self._seq_B[slot]
    have = self._n_alloc(slot)
    _require(bool((row[:have] >= 0).all()), f"slot {slot}: assigned pages are not a prefix: {row}")
    _require(len(set(row[:have].tolist())) == have, f"slot {slot}: a page appears twice: {row}")
    if seq is None:
      _require(have == 0 and n == 0 and self._order_B[slot] == -1, f"empty slot {slot} holds state")
      return
    _require(self._slot_of.get(seq) == slot, f"slot {slot}: seq {seq!r} indexed elsewhere")
    _require(self._pages_for(n) <= have, f"slot {slot}: {n} tokens on {have} pages of {self.page_size}")
    for i, page in enumerate(row[:have]):  # the COW invariant: nobody can write a shared page
      _require(self._ref_P[page] < 2 or n >= (i + 1) * self.page_size,
               f"slot {slot}: shared page {page} (index {i}) not full at length {n}")

  def _pages_for(self, n_tokens: int) -> int:
    return -(-n_tokens // self.page_size)

  def _n_alloc(self, slot: int) -> int:
    return int(np.count_nonzero(self._table_BM[slot] >= 0))

  def _check_active(self, slot: int, what: str) -> int:
    if not 0 <= slot < self.n_slots:
      raise ValueError(f"{what}: slot {slot} out of range 0..{self.n_slots - 1}")
    if self._seq_B[slot] is None:
      raise ValueError(f"{what}: slot {slot} holds no sequence (already free or never admitted)")
    return int(slot)

  def _find_slot(self, seq_id: Hashable, what: str) -> int:
    if seq_id is None or seq_id in self._slot_of:
      raise ValueError(f"{what}: seq id {seq_id!r} is None or already in slot {self._slot_of.get(seq_id)}")
    if len(self._slot_of) == self.n_slots:
      raise OutOfSlots(f"{what} seq {seq_id!r}: all {self.n_slots} slots busy")
    return self._seq_B.index(None)

  def _alloc(self, n: int, what: str) -> list[int]:
    if n > len(self._free):  # raise before popping anything: callers rely on untouched state
      raise OutOfPages(what, n, len(self._free))
    pages = [heapq.heappop(self._free) for _ in range(n)]
    self._ref_P[pages] = 1
    return pages

  def _occupy(self, slot: int, seq_id: Hashable, n_tokens: int) -> None:
    self._seq_B[slot], self._slot_of[seq_id] = seq_id, slot
    self._len_B[slot], self._order_B[slot] = n_tokens, self._stamp
    self._stamp += 1
