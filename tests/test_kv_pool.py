"""Tests for rollout/kv_pool.py: hand-worked page ids, eager COW on fork, preemption, stress.

Pages are handed out lowest id first, so every expected id below follows by hand from the ops.
The stress test also plays the device: it writes token ids through `table()` into a host
array of pages and reads every live sequence back, so a wrong table entry or a write into a
shared page shows up as a corrupted sequence, not just as a broken refcount.
"""

import copy
import itertools

import numpy as np
import pytest

from jaxrl_topo.rollout.kv_pool import OutOfPages, OutOfSlots, PagePool, PoolExhausted


def _snapshot(pool: PagePool):
  return pool.table(), pool.lengths(), pool.stats(), pool.n_free_pages()


def _assert_same(a, b):
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)


def test_admit_and_ensure_capacity_by_hand():
  """page_size 4: 5 tokens -> pages [0, 1]; 4 tokens -> [2]; 5 + 4 = 9 tokens need a third page."""
  pool = PagePool(n_pages=8, page_size=4, n_slots=3, max_pages_per_seq=4)
  assert pool.admit("a", 5) == 0
  assert pool.admit("b", 4) == 1
  np.testing.assert_array_equal(pool.table(), [[0, 1, -1, -1], [2, -1, -1, -1], [-1] * 4])
  np.testing.assert_array_equal(pool.lengths(), [5, 4, 0])
  assert pool.ensure_capacity(0, 3) == []  # positions 5..7 are on page 1 already
  assert pool.ensure_capacity(0, 4) == [3]  # position 8 starts page index 2
  assert pool.ensure_capacity(1, 1) == [4]  # slot 1 is exactly full: its next token needs a page
  pool.advance(0, 4)
  pool.advance(1, 1)
  pool.check()
  np.testing.assert_array_equal(pool.table()[:2], [[0, 1, 3, -1], [2, 4, -1, -1]])
  np.testing.assert_array_equal(pool.lengths(), [9, 5, 0])
  assert pool.stats() == dict(free_pages=3, used_pages=5, shared_pages=0, active_slots=2, preemptions=0, forks=0)
  assert pool.free(0) == [0, 1, 3]
  assert pool.admit("c", 2) == 0 and pool.table()[0, 0] == 0  # lowest free page and slot reused
  pool.check()


def test_fits_says_whether_ensure_capacity_would_find_pages():
  """5 free pages of 4 tokens: slot 0 (5 tokens, 2 pages) + 11 needs 2 more, slot 1 (4 tokens, 1 page) + 12
  needs 3 (5 in all: fits), + 13 needs 4 (6: does not, and ensure_capacity then runs out). Per data shard:
  a shard's free pages count only for its own slots. `fits` allocates nothing."""
  pool = PagePool(n_pages=8, page_size=4, n_slots=3, max_pages_per_seq=6)
  pool.admit("a", 5)
  pool.admit("b", 4)
  before = _snapshot(pool)
  assert pool.fits({0: 3}) and pool.fits({0: 11, 1: 12}) and not pool.fits({0: 11, 1: 13}) and pool.fits({})
  # shortfall, slot by slot: 5 + 3 = 8 tokens fit slot 0's 2 pages, 5 + 4 need a third; 4 + 0 none, 4 + 13 four more
  np.testing.assert_array_equal(pool.shortfall(np.array([0, 0, 1, 1]), np.array([3, 4, 0, 13])), [0, 1, 0, 4])
  _assert_same(before, _snapshot(pool))
  trial = copy.deepcopy(pool)
  trial.ensure_capacity(0, 11)
  with pytest.raises(OutOfPages):
    trial.ensure_capacity(1, 13)
  sharded = PagePool(n_pages=8, page_size=4, n_slots=4, max_pages_per_seq=4, n_shards=2)
  sharded.admit("a", 4, slot=0)  # shard 0: 3 free pages left; shard 1: 4
  assert sharded.fits({0: 12}) and not sharded.fits({0: 13}) and sharded.fits({0: 12, 2: 0})


def test_admit_into_a_given_slot_takes_that_slots_shard():
  """`slot=`: the sequence lands in that slot, with pages of the slot's own data shard; a busy slot, a slot
  out of range or a seq id already admitted are errors that change nothing."""
  pool = PagePool(n_pages=8, page_size=4, n_slots=4, max_pages_per_seq=2, n_shards=2)
  assert pool.admit("a", 5, slot=3) == 3
  np.testing.assert_array_equal(pool.table()[3], [4, 5])  # shard 1 owns pages 4..7
  for bad in (dict(seq_id="b", slot=3), dict(seq_id="b", slot=4), dict(seq_id="a", slot=0)):
    with pytest.raises(ValueError):
      pool.admit(bad["seq_id"], 2, slot=bad["slot"])
  np.testing.assert_array_equal(pool.lengths(), [0, 0, 0, 5])
  pool.check()


def test_fork_shares_full_pages_and_copies_the_partial_one():
  """6 tokens on pages [0, 1] (page 1 half full): each child shares page 0, gets a copy of 1."""
  pool = PagePool(n_pages=8, page_size=4, n_slots=4, max_pages_per_seq=3)
  parent = pool.admit("p", 6)
  assert pool.fork(parent, "c1") == (1, (1, 2))
  assert pool.fork(parent, "c2") == (2, (1, 3))
  pool.check()
  np.testing.assert_array_equal(pool.table()[:3], [[0, 1, -1], [0, 2, -1], [0, 3, -1]])
  np.testing.assert_array_equal(pool.lengths()[:3], [6, 6, 6])
  assert pool.stats()["shared_pages"] == 1 and pool.stats()["forks"] == 2
  assert pool.stats()["used_pages"] == 4  # page 0 counted once though three slots use it
  assert pool.ensure_capacity(1, 2) == []  # positions 6, 7 go to the child's own copy, page 2
  assert pool.ensure_capacity(1, 3) == [4]
  pool.advance(1, 3)
  assert pool.free(parent) == [1]  # page 0 stays: both children still read it
  pool.check()
  assert pool.free(1) == [2, 4]
  assert pool.free(2) == [0, 3]
  assert pool.n_free_pages() == 8
  pool.check()


def test_fork_of_an_exact_multiple_copies_nothing():
  """8 tokens fill pages [0, 1]: the child shares both; each first decode token takes a fresh page."""
  pool = PagePool(n_pages=6, page_size=4, n_slots=2, max_pages_per_seq=3)
  pool.admit("p", 8)
  assert pool.fork(0, "c") == (1, None)
  np.testing.assert_array_equal(pool.table(), [[0, 1, -1], [0, 1, -1]])
  assert pool.stats()["shared_pages"] == 2
  assert pool.ensure_capacity(1, 1) == [2]
  assert pool.ensure_capacity(0, 1) == [3]
  pool.advance(0, 1)
  pool.advance(1, 1)
  pool.check()
  np.testing.assert_array_equal(pool.table(), [[0, 1, 3], [0, 1, 2]])


def _grpo_pool() -> PagePool:
  """Parent of 6 tokens, two forks, some decode: pages 0 (shared x3), 1..5 private."""
  pool = PagePool(n_pages=10, page_size=4, n_slots=4, max_pages_per_seq=3)
  pool.admit("p", 6)
  pool.fork(0, "c1")
  pool.fork(0, "c2")
  pool.admit("q", 3)
  pool.ensure_capacity(1, 3)
  pool.advance(1, 3)
  return pool


def test_pin_keeps_a_prompt_alive_after_its_slot_is_freed():
  """page_size 4, prompt of 6 tokens on pages [0, 1]: pin shares page 0 and copies page 1 -> 2;
  a fork from the pin shares page 0 and copies 2 -> 3; pages go back only when the last holder goes."""
  pool = PagePool(n_pages=6, page_size=4, n_slots=2, max_pages_per_seq=3)
  owner = pool.admit("a", 6)
  pin, copy = pool.pin(owner)
  assert copy == (1, 2)
  pool.check()
  pool.free(owner)  # page 1 goes back; page 0 stays (pinned), page 2 is the pin's copy
  assert pool.n_free_pages() == 4
  pool.check()
  slot, copy = pool.fork_pin(pin, "b")
  assert copy == (2, 1) and pool.lengths()[slot] == 6
  np.testing.assert_array_equal(pool.table()[slot], [0, 1, -1])
  pool.check()
  assert pool.stats()["shared_pages"] == 1
  assert sorted(pool.unpin(pin)) == [2]  # page 0 is still the fork's
  pool.check()
  assert sorted(pool.free(slot)) == [0, 1]
  assert pool.n_free_pages() == 6 and pool.pins() == []
  pool.check()


def test_preempt_stops_when_only_pins_hold_pages():
  pool = PagePool(n_pages=4, page_size=4, n_slots=2, max_pages_per_seq=3)
  slot = pool.admit("a", 8)  # pages 0, 1
  pin, copy = pool.pin(slot)
  assert copy is None  # a full prompt copies nothing
  assert pool.preempt_youngest(4) == ["a"]  # frees the slot, then stops: the pin holds 0 and 1
  assert pool.n_free_pages() == 2
  pool.check()


def test_free_order_does_not_change_the_final_state():
  base = _grpo_pool()
  base.check()
  finals = []
  for order in itertools.permutations([0, 1, 2]):
    pool = copy.deepcopy(base)
    for slot in order:
      pool.free(slot)
      pool.check()
    pool.admit("next", 9)  # the next allocation sees the same free set too
    finals.append(_snapshot(pool))
  for final in finals[1:]:
    _assert_same(final, finals[0])
  np.testing.assert_array_equal(finals[0][0][0], [0, 1, 2])  # "next" got pages 0, 1, 2 in slot 0


def test_preempt_frees_the_youngest_first():
  """page_size 2, 6 pages: a [0, 1], b [2], c [3, 4]; forks are admissions too."""
  pool = PagePool(n_pages=6, page_size=2, n_slots=4, max_pages_per_seq=3)
  pool.admit("a", 4)
  pool.admit("b", 2)
  pool.admit("c", 3)
  assert pool.preempt_youngest(1) == []  # page 5 is free already: nobody is preempted
  assert pool.preempt_youngest(3) == ["c"]
  pool.fork(0, "a2")  # youngest now; shares both full pages of a, so freeing it releases nothing
  assert pool.preempt_youngest(4) == ["a2", "b"]  # 3 free; a2 releases none, b releases page 2
  np.testing.assert_array_equal(pool.table()[:, 0], [0, -1, -1, -1])
  assert pool.stats()["preemptions"] == 3
  assert pool.preempt_youngest(6) == ["a"]
  assert pool.n_free_pages() == 6
  pool.check()


def test_out_of_pages_leaves_state_untouched():
  pool = PagePool(n_pages=3, page_size=4, n_slots=4, max_pages_per_seq=3)
  pool.admit("a", 7)
  pool.admit("b", 4)
  before = _snapshot(pool)
  with pytest.raises(OutOfPages) as err:
    pool.admit("c", 5)
  assert (err.value.needed, err.value.free) == (2, 0)
  for op in (lambda: pool.fork(0, "a2"), lambda: pool.ensure_capacity(1, 1)):
    with pytest.raises(OutOfPages):
      op()
  _assert_same(_snapshot(pool), before)
  assert pool.slot_of("c") is None and pool.slot_of("a2") is None
  assert pool.preempt_youngest(err.value.needed) == ["b", "a"]
  assert pool.admit("c", 5) == 0


def test_out_of_slots():
  pool = PagePool(n_pages=4, page_size=4, n_slots=1, max_pages_per_seq=2)
  pool.admit("a", 1)
  with pytest.raises(OutOfSlots, match="all 1 slots busy"):
    pool.fork(0, "b")
  pool.check()


@pytest.mark.parametrize("op, match", [
    (lambda p: p.free(2), "slot 2 holds no sequence"),
    (lambda p: p.free(7), "slot 7 out of range 0..3"),
    (lambda p: p.advance(0, 4), r"slot 0 \(seq 'a'\): 5 \+ 4 tokens past 8 allocated"),
    (lambda p: p.fork(3, "x"), "fork: slot 3 holds no sequence"),
    (lambda p: p.admit("x", 13), "prompt of 13 tokens, allowed 1..12"),
    (lambda p: p.admit("x", 0), "prompt of 0 tokens"),
    (lambda p: p.admit("a", 2), "seq id 'a' is None or already in slot 0"),
    (lambda p: p.ensure_capacity(0, 8), r"slot 0 \(seq 'a'\): 5 \+ 8 tokens, allowed 0..12"),
    (lambda p: p.preempt_youngest(11), "11 pages needed, the pool has 10"),
])
def test_misuse_raises_a_clear_error(op, match):
  pool = PagePool(n_pages=10, page_size=4, n_slots=4, max_pages_per_seq=3)
  pool.admit("a", 5)
  pool.admit("b", 1)
  pool.free(1)
  before = _snapshot(pool)
  with pytest.raises(ValueError, match=match):
    op(pool)
  _assert_same(_snapshot(pool), before)


class _Device:
  """Host stand-in for the device cache: token ids stored on pages through the page table."""

  def __init__(self, pool: PagePool):
    self.pool, self.kv_PS = pool, np.full((pool.n_pages, pool.page_size), -1, np.int64)
    self.tokens: dict[str, list[int]] = {}  # what each live sequence must read back

  def write(self, slot: int, start: int, toks: list[int]) -> None:
    pos = np.arange(start, start + len(toks))
    page = self.pool.table()[slot, pos // self.pool.page_size]
    assert (page >= 0).all(), f"write to an unassigned page in slot {slot}"
    self.kv_PS[page, pos % self.pool.page_size] = toks

  def verify(self) -> None:
    table, lengths = self.pool.table(), self.pool.lengths()
    for seq, toks in self.tokens.items():
      slot = self.pool.slot_of(seq)
      pos = np.arange(lengths[slot])
      got = self.kv_PS[table[slot, pos // self.pool.page_size], pos % self.pool.page_size]
      np.testing.assert_array_equal(got, toks, err_msg=f"seq {seq} in slot {slot} reads back wrong")


def _random_op(pool: PagePool, dev: _Device, rng: np.random.Generator, n_seq: int) -> int:
  """One admit/fork/decode/free/preempt; returns the next fresh seq number."""
  live = sorted(dev.tokens)
  kind = rng.choice(["admit", "fork", "decode", "decode", "free", "preempt"])
  if kind == "admit" or not live:
    n = int(rng.integers(1, pool.max_len + 1))
    toks = rng.integers(0, 1000, n).tolist()
    slot = pool.admit(f"s{n_seq}", n, int(rng.integers(pool.n_shards)) if pool.n_shards > 1 else 0)
    dev.tokens[f"s{n_seq}"] = toks
    dev.write(slot, 0, toks)  # prefill
    return n_seq + 1
  seq = live[rng.integers(len(live))]
  slot = pool.slot_of(seq)
  if kind == "fork":
    child, cp = pool.fork(slot, f"s{n_seq}")
    if cp is not None:
      dev.kv_PS[cp[1]] = dev.kv_PS[cp[0]]
    dev.tokens[f"s{n_seq}"] = list(dev.tokens[seq])
    return n_seq + 1
  if kind == "decode":
    k = min(int(rng.integers(1, 5)), pool.max_len - len(dev.tokens[seq]))
    pool.ensure_capacity(slot, k)
    toks = rng.integers(0, 1000, int(rng.integers(0, k + 1))).tolist()  # may stop early (EOS)
    dev.write(slot, len(dev.tokens[seq]), toks)
    pool.advance(slot, len(toks))
    dev.tokens[seq] += toks
  elif kind == "free":
    pool.free(slot)
    del dev.tokens[seq]
  else:
    shard = pool.shard_of_slot(slot)
    for gone in pool.preempt_youngest(int(rng.integers(0, pool.pages_per_shard + 1)), shard):
      del dev.tokens[gone]
  return n_seq


@pytest.mark.parametrize("n_shards, n_slots", [(1, 5), (2, 6)])
def test_random_ops_keep_every_invariant(n_shards, n_slots):
  """3000 seeded ops on a 12-page pool (one shard, or two of 6 pages and 3 slots each): check() (which
  also checks that every slot and pin holds only its own shard's pages) and a device read-back after each."""
  rng = np.random.default_rng(0)
  pool = PagePool(n_pages=12, page_size=3, n_slots=n_slots, max_pages_per_seq=5, n_shards=n_shards)
  dev, n_seq, exhausted = _Device(pool), 0, 0
  for _ in range(3000):
    before = _snapshot(pool)
    try:
      n_seq = _random_op(pool, dev, rng, n_seq)
    except PoolExhausted as err:  # the only signal allowed out; the op must not have touched anything
      _assert_same(_snapshot(pool), before)
      exhausted += 1
      if isinstance(err, OutOfPages) and rng.random() < 0.5:  # what the engine does next
        for gone in pool.preempt_youngest(err.needed, err.shard):
          del dev.tokens[gone]
        assert pool.n_free_pages(err.shard) >= err.needed
    pool.check()
    dev.verify()
  stats = pool.stats()
  assert stats["forks"] > 100 and stats["preemptions"] > 100 and exhausted > 100, (stats, exhausted)


# ---------------------------------------------------------------- data shards


def test_each_data_shard_gives_its_slots_only_its_own_pages_by_hand():
  """2 shards of 4 pages and 2 slots: shard 1 owns slots 2, 3 and pages 4..7. Its fork, pin and growth
  stay there; when it runs out, shard 0's free pages do not help and only shard 1 is preempted."""
  pool = PagePool(n_pages=8, page_size=4, n_slots=4, max_pages_per_seq=3, n_shards=2)
  assert pool.admit("a", 6, shard=1) == 2  # pages 4, 5 (page 5 half full)
  assert pool.fork(2, "a2") == (3, (5, 6))  # the child shares page 4, copies 5 into 6
  np.testing.assert_array_equal(pool.table(), [[-1] * 3, [-1] * 3, [4, 5, -1], [4, 6, -1]])
  assert pool.admit("b", 3) == 0 and pool.table()[0, 0] == 0  # shard 0's lowest slot and page
  assert (pool.n_free_pages(0), pool.n_free_pages(1), pool.n_free_pages()) == (3, 1, 4)
  with pytest.raises(OutOfSlots, match="all 2 slots of data shard 1 busy"):
    pool.admit("c", 1, shard=1)
  with pytest.raises(OutOfPages) as err:
    pool.pin(2)  # needs a private copy of page 5, and page 7 is shard 1's last free page ...
    pool.pin(3)  # ... so the second pin finds shard 1 empty while shard 0 has 3 free pages
  assert (err.value.shard, err.value.needed, err.value.free) == (1, 1, 0)
  assert pool.pin_shard(0) == 1
  pool.check()
  assert pool.preempt_youngest(2, shard=1) == ["a2", "a"]  # b (shard 0, younger than a) is left alone
  assert pool.seq_id(0) == "b" and pool.n_free_pages(1) == 2  # pages 5, 6; the pin keeps 4 and 7
  assert pool.fork_pin(0, "a3") == (2, (7, 5))  # back in shard 1, from the pinned pages
  pool.check()


def test_admit_group_puts_a_whole_group_in_one_shard():
  """A group goes to the shard with the most free slots, then pages; a shard without room for all
  of it is skipped; if no shard has room, the pool is left as it was."""
  pool = PagePool(n_pages=8, page_size=4, n_slots=4, max_pages_per_seq=4, n_shards=2)
  empty = _snapshot(pool)
  with pytest.raises(OutOfPages) as err:  # 2 + 1 (copy) pages, then 2 more for 8 new tokens: 5 > 4
    pool.admit_group(["p", "q"], 6, reserve=8)  # fails in shard 0 after the fork, then in shard 1
  assert (err.value.shard, err.value.needed, err.value.free) == (0, 2, 1)
  _assert_same(_snapshot(pool), empty)  # includes stats: the rolled-back forks are not counted
  assert pool.admit_group(["x"], 9, reserve=0) == ([0], [], None)  # shard 0: pages 0, 1, 2
  slots, copies, pin = pool.admit_group(["g0", "g1"], 6, pin=True, reserve=2)
  assert slots == [2, 3] and pin is not None and pool.pin_shard(pin) == 1
  assert copies == [(5, 6), (5, 7)]  # the fork's and the pin's private copies of the partial page
  before = _snapshot(pool)
  with pytest.raises(OutOfSlots, match="no data shard has 2 free slots"):
    pool.admit_group(["h0", "h1"], 1)
  with pytest.raises(OutOfPages) as err:
    pool.admit_group(["h0"], 5)  # shard 0 has a slot but 1 free page; shard 1 has no slot
  assert (err.value.shard, err.value.needed) == (0, 2)
  _assert_same(_snapshot(pool), before)
  pool.check()


def test_shard_counts_must_divide_the_pool():
  with pytest.raises(ValueError, match="n_pages=10 and n_slots=4 must be multiples of the data shards"):
    PagePool(n_pages=10, page_size=4, n_slots=4, max_pages_per_seq=3, n_shards=4)


def test_a_prefill_wave_of_new_prompts_sends_only_the_pages_its_bucket_can_touch():
  """uploads.prefill_arrays: a wave of new prompts (start 0) in bucket T gets ceil(T / S) page columns rounded
  up to a power of two (its attention then costs T x T, not T x max_len); a wave that continues a slot
  (start > 0) attends to its earlier positions and gets all M. The pages it keeps are the prompt's own."""
  from jaxrl_topo.rollout import uploads
  from jaxrl_topo.rollout.host_state import _Wave

  pool = PagePool(n_pages=80, page_size=16, n_slots=2, max_pages_per_seq=34)
  table = np.arange(34, dtype=np.int32) + 3

  def wave(n_prompt, start=0):
    return _Wave(prompt_ids=[1] * n_prompt, slots=[0], seq_ids=[0], max_new_tokens=4, stop_ids=(), copies=[],
                 table_M=table, later=[], start=start)

  def width(waves, T):
    arrays, _ = uploads.prefill_arrays(pool, waves, T, 0, 2, np.zeros(2, np.int64), 0)
    return arrays[3]  # table_GM

  np.testing.assert_array_equal(width([wave(20)], 32), table[None, :2])  # 32 tokens: 2 pages of 16
  assert width([wave(40)], 64).shape[1] == 4
  assert width([wave(40)], 48).shape[1] == 4  # 3 pages, rounded up to a power of two
  assert width([wave(500)], 512).shape[1] == 32
  assert width([wave(530)], 544).shape[1] == 34  # never past M
  assert width([wave(20), wave(8, start=30)], 32).shape[1] == 34  # a continuation: every page
