"""The rollout engine's scheduling: chunk boundaries, chunk growth, packed rows, admission of groups as slots
free up, preemption, and what compiles. Every schedule must give the tokens of a roomier or one-at-a-time run
(sampling keys are (seed, sequence id, position), never the slot)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_engine import SAMPLED, TINY, _detok, _engine, _prompts, _tiny_params

from jaxrl_topo.rollout import engine as engine_lib
from jaxrl_topo.rollout.engine import EngineConfig, Request, RolloutEngine


@pytest.fixture(scope="module")
def tiny():
  return _tiny_params()


def test_a_chunk_ends_when_a_slot_frees_for_a_waiting_request(tiny):
  """2 slots, 32-step chunks, a short request beside a long one and a third waiting: the chunk ends at the
  step the short one finishes and the waiting one takes its slot at once, so no slot idles while a
  request waits (with the early exit off this fails: the freed slot idles for the rest of the 32-step
  chunk). Tokens equal an engine with room for all three."""
  graphdef, params = tiny
  a, b, c = _prompts(3, seed=21, max_len=10)
  requests = [Request(a, max_new_tokens=3), Request(b, max_new_tokens=40), Request(c, max_new_tokens=30)]
  eng = _engine(graphdef, params, n_slots=2, decode_chunk=4, tail_chunk=32, eos_ids=())
  got = eng.run(requests)
  want = _engine(graphdef, params, n_slots=4, eos_ids=()).run(requests)
  assert [s.tokens for s in got] == [s.tokens for s in want] and [len(s.tokens) for s in got] == [3, 40, 30]
  assert eng.stats["slot_steps_queued"] > 0
  assert eng.stats["busy_steps_queued"] == eng.stats["slot_steps_queued"], dict(eng.stats)


def test_chunks_grow_to_max_chunk_when_nobody_needs_their_boundaries(tiny):
  """One long request, nothing waiting: chunks double from tail_chunk (4) to max_chunk (32) while the row
  has that many tokens left, so 56 tokens take 3 chunks, not 14, with the same tokens and log-probs.
  With an on_chunk hook they keep tail_chunk (the hook sees every boundary). (The page guard, so a long
  chunk never preempts: test_kv_pool's test_fits_says_whether_ensure_capacity_would_find_pages.)"""
  graphdef, params = tiny
  (a, b) = _prompts(2, seed=5, max_len=6)
  one = [Request(a, max_new_tokens=56)]
  short = _engine(graphdef, params, n_slots=2, decode_chunk=4, tail_chunk=4, eos_ids=())
  want = short.run(one)
  grown = _engine(graphdef, params, n_slots=2, decode_chunk=4, tail_chunk=4, max_chunk=32, eos_ids=())
  got = grown.run(one)
  assert [s.tokens for s in got] == [s.tokens for s in want] and len(got[0].tokens) == 56
  np.testing.assert_allclose(got[0].logprobs, want[0].logprobs, atol=1e-5)  # widths differ by schedule
  assert short.stats["chunks"] >= 14 and grown.stats["chunks"] <= 4, (short.stats["chunks"], grown.stats["chunks"])
  hooked = _engine(graphdef, params, n_slots=2, decode_chunk=4, tail_chunk=4, max_chunk=32, eos_ids=())
  assert [s.tokens for s in hooked.run(one, on_chunk=lambda e: None)] == [s.tokens for s in want]
  assert hooked.stats["chunks"] == short.stats["chunks"]
  # A hook that says it needs no boundaries (a progress bar; the colocated RL loop's) lets them grow.
  seen = []
  progress = lambda e: seen.append(e.stats["tokens"])  # noqa: E731
  progress.needs_boundaries = False
  relaxed = _engine(graphdef, params, n_slots=2, decode_chunk=4, tail_chunk=4, max_chunk=32, eos_ids=())
  assert [s.tokens for s in relaxed.run(one, on_chunk=progress)] == [s.tokens for s in want]
  assert relaxed.stats["chunks"] == grown.stats["chunks"] and len(seen) == relaxed.stats["chunks"]


def test_steps_compute_only_the_live_rows_packed(tiny):
  """8 slots, one 40-token request beside seven 3-token ones: once the short ones end, the steps run on the
  one live row packed into a batch of 2, the fewest (chunks end as the live rows halve), not on all 8
  slots. Tokens and log-probs equal each request run alone. With packing off, row_steps = slot_steps and
  this fails."""
  graphdef, params = tiny
  prompts = _prompts(8, seed=31, max_len=8)
  requests = [Request(p, max_new_tokens=40 if i == 0 else 3) for i, p in enumerate(prompts)]
  eng = _engine(graphdef, params, n_slots=8, n_pages=128, decode_chunk=4, tail_chunk=8, eos_ids=())
  got = eng.run(requests)
  alone = _engine(graphdef, params, n_slots=1, decode_chunk=4, tail_chunk=8, eos_ids=())
  want = [alone.run([r], seq_base=i)[0] for i, r in enumerate(requests)]  # same sequence ids, same keys
  assert [s.tokens for s in got] == [s.tokens for s in want]
  np.testing.assert_allclose(np.concatenate([s.logprobs for s in got]), np.concatenate([s.logprobs for s in want]),
                             atol=1e-5)
  stats = eng.stats
  assert stats["busy_steps"] == 40 - 1 + 7 * 2  # every decode step after each prefill's first token
  assert stats["row_steps"] <= stats["slot_steps"] // 3, dict(stats)  # 2 rows (the fewest) of 8 for most steps
  # min_pack_rows = the slots: no smaller batch (one decode program), same tokens.
  whole = _engine(graphdef, params, n_slots=8, n_pages=128, decode_chunk=4, tail_chunk=8, eos_ids=(), min_pack_rows=8)
  assert [s.tokens for s in whole.run(requests)] == [s.tokens for s in want]
  assert whole.stats["row_steps"] == whole.stats["slot_steps"] > stats["slot_steps"] // 3, dict(whole.stats)


def test_group_samples_start_as_slots_free_up_from_the_pinned_prompt(tiny):
  """4 slots, two groups of 3: the second starts with the one free slot, its other two samples fork
  from its pinned prompt as slots free up (no second prefill of that prompt), and every token is
  what an engine with room for everything at once gives."""
  graphdef, params = tiny
  a, b = _prompts(2, seed=18, max_len=14)
  requests = [Request(a + [5, 6, 7], n=3, max_new_tokens=6), Request(b + [9, 10], n=3, max_new_tokens=12)]
  want = _engine(graphdef, params, n_slots=8, n_pages=96).run(requests)
  eng = _engine(graphdef, params)
  got = eng.run(requests)
  assert [s.tokens for s in got] == [s.tokens for s in want]
  np.testing.assert_allclose(np.concatenate([s.logprobs for s in got]),
                             np.concatenate([s.logprobs for s in want]), atol=1e-5)  # widths differ by schedule
  assert eng.stats["pinned_groups"] == 1, "the second group was admitted before three slots were free"
  assert eng.stats["prefills"] == 2 and eng.stats["forks"] == 4
  eng.pool.check()
  assert eng.pool.pins() == [] and eng.pool.stats()["used_pages"] == 0


def test_pinned_samples_awaiting_their_first_token_do_not_overbook_the_slots(tiny):
  """4 slots, four groups of 3, one-token chunks with overlap: a pinned group's samples whose first
  token is not read yet hold back more slots than are free. Admission must wait (it once admitted a
  group into slots that were not there: OutOfSlots)."""
  graphdef, params = tiny
  prompts = _prompts(4, seed=21, max_len=10)
  requests = [Request(p, n=3, max_new_tokens=m) for p, m in zip(prompts, [3, 9, 4, 7], strict=True)]
  want = _engine(graphdef, params, n_slots=12, n_pages=160).run(requests)
  eng = _engine(graphdef, params, decode_chunk=1, tail_chunk=1)
  assert [s.tokens for s in eng.run(requests)] == [s.tokens for s in want]
  assert eng.stats["pinned_groups"] >= 2
  eng.pool.check()
  assert eng.pool.pins() == [] and eng.pool.stats()["used_pages"] == 0


def test_preemption_under_a_tiny_pool_gives_the_same_outputs(tiny):
  graphdef, params = tiny
  requests = [Request(p, max_new_tokens=16) for p in _prompts(6, seed=6, max_len=12)]
  roomy = _engine(graphdef, params, n_pages=64).run(requests)
  tight_engine = _engine(graphdef, params, n_pages=12, max_len=32)
  tight = tight_engine.run(requests)
  assert tight_engine.stats["preemptions"] > 0, "the pool was meant to run out"
  assert [s.tokens for s in tight] == [s.tokens for s in roomy]
  tight_engine.pool.check()
  assert tight_engine.pool.stats()["used_pages"] == 0, "every page must be back in the pool"


def test_continuous_batching_matches_one_at_a_time(tiny):
  graphdef, params = tiny
  requests = [Request(p, max_new_tokens=n) for p, n in zip(_prompts(7, seed=7), [3, 15, 1, 9, 12, 2, 7], strict=True)]
  batched = _engine(graphdef, params, n_slots=3, tail_chunk=0).run(requests)  # 20-step chunks once the queue is empty
  alone = _engine(graphdef, params, n_slots=1).run(requests)
  assert [s.tokens for s in batched] == [s.tokens for s in alone]
  assert all(len(s.tokens) <= r.max_new_tokens for s, r in zip(batched, requests, strict=True))


def test_steady_state_compiles_nothing_new(tiny):
  """Prefill compiles once per (prompt bucket, prompts-per-wave bucket): 4 slots, 5 requests of
  different budgets give a wave of 4 and a wave of 1, whatever the prompt values."""
  graphdef, params = tiny
  eng = _engine(graphdef, params, eos_ids=())
  budgets = [6, 9, 3, 12, 7]
  eng.run([Request(p, max_new_tokens=n) for p, n in zip(_prompts(5, seed=8, max_len=15), budgets, strict=True)])
  sizes = (engine_lib.generate._cache_size(), engine_lib.prefill._cache_size())
  assert eng.stats["prefill_calls"] == 2, "one wave of four groups, then one of one"
  eng.run([Request(p, max_new_tokens=n) for p, n in zip(_prompts(5, seed=9, max_len=15), budgets, strict=True)])
  assert (engine_lib.generate._cache_size(), engine_lib.prefill._cache_size()) == sizes


def test_chunks_of_every_length_share_one_decode_program(tiny):
  """The chunk length is traced: short chunks, then chunks that grow to 60 steps for a longer straggler, run one
  `generate` program (a static length compiled one per length, late, the first time a run needed it). The bucketed
  read: the window read (the CPU default) also compiles one program per window width, and ends a chunk at its edge."""
  graphdef, params = tiny
  eng = _engine(graphdef, params, n_slots=2, eos_ids=(), tail_chunk=4, max_chunk=60, impl="bucketed")
  eng.run([Request(p, max_new_tokens=5) for p in _prompts(2, seed=8, max_len=15)])
  size = engine_lib.generate._cache_size()
  before = eng.stats["chunks"]
  got = eng.run([Request(p, max_new_tokens=n) for p, n in zip(_prompts(2, seed=9, max_len=15), (3, 50), strict=True)])
  assert [len(s.tokens) for s in got] == [3, 50]
  assert eng.stats["chunks"] - before <= 5, "chunks did not grow (4, 8, 16, 32 steps...)"
  assert engine_lib.generate._cache_size() == size, "a chunk length compiled its own program"


def test_a_tail_sends_no_chunk_that_would_run_no_step(tiny):
  """One request, nothing waiting: its first chunk (grown to 32 steps) runs it to its 20-token limit, so the loop
  dispatches nothing more: one chunk, one host read (the overlap used to send a second chunk before reading the
  first, which then ran no step: 2 chunks, 2 reads). Its prefill carries the chunk's pages: one upload, no patch
  after it (with the pages reserved after the prefill, 2 uploads). Tokens equal a run with short chunks. The bucketed
  read: a window chunk also ends at its window's edge (test_a_window_after_an_unread_chunk_...)."""
  graphdef, params = tiny
  (a,) = _prompts(1, seed=12, max_len=6)
  one = [Request(a, max_new_tokens=20)]
  eng = _engine(graphdef, params, n_slots=2, tail_chunk=8, max_chunk=32, eos_ids=(), impl="bucketed")
  got = eng.run(one)
  want = _engine(graphdef, params, n_slots=2, eos_ids=()).run(one)
  assert [s.tokens for s in got] == [s.tokens for s in want] and len(got[0].tokens) == 20
  stats = eng.stats
  assert (stats["chunks"], stats["host_reads"], stats["uploads"]) == (1, 1, 1), dict(stats)


def test_a_window_after_an_unread_chunk_is_no_wider_than_that_chunk_lets_rows_reach(tiny, monkeypatch):
  """impl "window", one request (prompt 6, 40 tokens), 4-token pages, chunks grown to 64 steps. The windows the
  chunks open, in pages: 2 (positions < 8: the chunk ends at its edge), then 4, dispatched before the first chunk
  is read: the host's count (6) lags it by up to 64 steps, but that chunk stops every row at its edge (8), so 4
  pages hold the next write. Sized from the 64 steps alone it was 16, every step of the chunk reading 4x the
  columns. Then 8 and 16, each chunk ending at its window's edge, and no fifth chunk: the fourth ends the row
  (position 45). Tokens and log-probs equal the bucketed read's. With the default floor (min_window_tokens 64: all
  16 pages of these rows) every chunk opens the one 16-page window, and the tokens are the same again."""
  graphdef, params = tiny
  one = [Request([5, 17, 42, 8, 23, 61], max_new_tokens=40)]
  windows = []
  generate = engine_lib.generate

  def spy(*args, **kw):
    windows.append(kw["window_pages"])
    return generate(*args, **kw)

  want = _engine(graphdef, params, n_slots=2, eos_ids=(), impl="bucketed").run(one)
  monkeypatch.setattr(engine_lib, "generate", spy)
  eng = _engine(graphdef, params, n_slots=2, tail_chunk=8, max_chunk=64, eos_ids=(), impl="window",
                min_window_tokens=0)
  got = eng.run(one)
  assert [s.tokens for s in got] == [s.tokens for s in want] and len(got[0].tokens) == 40
  np.testing.assert_allclose(got[0].logprobs, want[0].logprobs, atol=1e-5)
  assert windows == [2, 4, 8, 16] and eng.stats["chunks"] == 4, (windows, dict(eng.stats))
  windows.clear()
  got = _engine(graphdef, params, n_slots=2, tail_chunk=8, max_chunk=64, eos_ids=(), impl="window").run(one)
  assert [s.tokens for s in got] == [s.tokens for s in want] and windows and set(windows) == {16}, windows
  np.testing.assert_allclose(got[0].logprobs, want[0].logprobs, atol=1e-5)


def test_the_narrowest_window_is_a_power_of_two_of_pages_holding_min_window_tokens():
  pages = lambda **kw: EngineConfig(**kw).window_min_pages  # noqa: E731
  assert pages(page_size=16, max_len=512) == 4  # the default 64 tokens
  assert pages(page_size=12, max_len=512) == 8  # 6 pages rounded up: one of bucketed's widths
  assert pages(page_size=4, max_len=64) == 16 and pages(page_size=16, max_len=32) == 2  # capped at a row's pages
  assert pages(page_size=4, max_len=64, min_window_tokens=0) == 1 and pages(page_size=128, max_len=512) == 1
  with pytest.raises(ValueError, match="min_window_tokens"):
    EngineConfig(min_window_tokens=-1)


def test_a_window_is_sized_from_the_live_rows_not_an_idle_slot(tiny, monkeypatch):
  """impl "window": request X is cut by a stop string while its 32-step chunk is still unread; request Z (2-token
  prompt, 6 tokens) then takes the slot. Z's first window is 1 page, the one Z holds. The idle second slot (no
  sequence since before that chunk) once counted as if that chunk had moved it 32 tokens on: 16 pages."""
  graphdef, params = tiny
  x_prompt = [5, 17, 42]
  text = _detok(_engine(graphdef, params, n_slots=2, eos_ids=()).run([Request(x_prompt, max_new_tokens=55)])[0].tokens)
  k = next(k for k in range(14, 52) if text.find(text[k:k + 4]) == k)  # a stop string first seen at token k + 4
  z = Request([7, 9], max_new_tokens=6)
  windows = []
  generate = engine_lib.generate

  def spy(*args, **kw):
    windows.append((kw["window_pages"], eng._epoch_B.tolist()))
    return generate(*args, **kw)

  monkeypatch.setattr(engine_lib, "generate", spy)
  cfg = EngineConfig(n_slots=2, page_size=4, n_pages=64, max_len=64, decode_chunk=4, tail_chunk=8, max_chunk=32,
                     sampling=SAMPLED, eos_ids=(), impl="window", min_window_tokens=0)
  eng = RolloutEngine(graphdef, TINY, params, cfg, detokenize=_detok)
  with eng.stream(on_group=lambda tag, r, s: st.add([z], "z") if tag == "x" else None) as st:
    st.add([Request(x_prompt, max_new_tokens=55, stop_strings=(text[k:k + 4],))], "x")
    assert st.run_until("x")[0].finish_reason == "stop"
    got = st.run_until("z")
  monkeypatch.undo()
  assert got[0].tokens == _engine(graphdef, params, n_slots=2, eos_ids=(), impl="bucketed").run([z])[0].tokens
  z_windows = [w for w, epochs in windows if epochs[0] > 1]  # dispatches after Z took slot 0
  assert z_windows and z_windows[0] == 1, windows


def test_first_tokens_read_for_a_dropped_pin_are_not_kept(tiny):
  """Found by a helper's review: a weight update drops the pins (their waiting samples are prefilled afresh);
  first tokens sampled for them by a prefill read after that were stored in `first_of` for good (two entries
  left after this run, a few more per update or preemption of a long run). Now they are dropped on read."""
  graphdef, params = tiny
  new = jax.tree.map(lambda x: x * 1.01, params)
  requests = [Request(p, n=3, max_new_tokens=m) for p, m in zip(_prompts(4, seed=21, max_len=10), [3, 9, 4, 7],
                                                                 strict=True)]
  eng, chunks = _engine(graphdef, params, decode_chunk=1, tail_chunk=1), []

  def on_chunk(engine):
    chunks.append(1)
    if len(chunks) == 3:
      engine.update_weights(new, 1, "keep_kv")

  eng.run(requests, on_chunk)
  assert eng.stats["pinned_groups"] >= 2 and eng.gen_id == 1
  assert eng.first_of == {} and eng.pool.pins() == []
  eng.pool.check()
