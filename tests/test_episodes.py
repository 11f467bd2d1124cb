"""Multi-turn episodes in the rollout engine (rollout/episodes.py): token in, token out.

A scripted environment answers every model turn with fixed tokens. The reference for every sampled
token is a fresh engine given the whole history so far as its prompt (same sequence id, so the same
sampling keys): continuing from the pages must give exactly what a full re-prefill gives.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_topo.models.model import init_params
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.rollout.engine import EngineConfig, Request, RolloutEngine
from jaxrl_topo.rollout.sampling import SamplingConfig
from jaxrl_topo.train.batch import Completion, build_batch
from jaxrl_topo.train.policy import model_fns, sequence_logprobs

TINY = get_preset("tiny")
SAMPLING = SamplingConfig(temperature=0.7, top_k=20)
EOS = (2,)
STOP = (88, 22, 61, 73)  # a model turn also ends at these (frequent ids of this model; "</calc>" stand-ins)


class Scripted:
  """Replies REPLY + [turn] to every turn, `done_after` turns -> None ("done"); records what it saw."""

  REPLY = [40, 41, 42]

  def __init__(self, done_after=10, fail_on=None):
    self.done_after, self.fail_on = done_after, fail_on
    self.ready, self.seen = [], []

  def submit(self, key, sample, turn_start):
    self.seen.append((key, list(sample.tokens[turn_start:])))
    turn = sample.turns
    if self.fail_on == turn:
      self.ready.append((key, None, "env_error"))
    elif turn >= self.done_after:
      self.ready.append((key, None, "stop"))
    else:
      self.ready.append((key, self.REPLY + [50 + turn], ""))

  def poll(self, block):
    out, self.ready = self.ready, []
    assert out or not block, "the stream blocked with no reply coming"
    return out


def _engine(params, **kw):
  graphdef, p = params
  cfg = dict(n_slots=4, page_size=4, n_pages=96, max_len=96, decode_chunk=4, tail_chunk=4, sampling=SAMPLING,
             eos_ids=EOS)
  return RolloutEngine(graphdef, TINY, p, EngineConfig(**{**cfg, **kw}))


@pytest.fixture(scope="module")
def tiny():
  graphdef, params = init_params(TINY, jax.random.key(0))
  return graphdef, jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), params)


@pytest.fixture(scope="module")
def episodes(tiny):
  """4 prompts x 2 samples, up to 3 turns, 40 tokens per episode."""
  rng = np.random.RandomState(0)
  prompts = [rng.randint(3, 96, rng.randint(3, 10)).tolist() for _ in range(4)]
  reqs = [Request(p, n=2, max_new_tokens=40, stop_ids=STOP, max_turns=3) for p in prompts]
  env = Scripted()
  eng = _engine(tiny)
  return prompts, eng.run(reqs, turns=env, seq_base=100), env, eng


def _turns(sample):
  """[(start, end)] of the model's runs of tokens."""
  m = np.asarray(sample.loss_mask)
  edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
  return list(zip(edges[::2], edges[1::2], strict=True))


def test_env_tokens_are_the_replies_masked_and_ids_are_what_was_sampled(episodes):
  prompts, samples, env, eng = episodes
  assert eng.stats["extensions"] > 0
  multi = 0
  for s in samples:
    assert len(s.tokens) == len(s.logprobs) == len(s.gen_ids) == len(s.loss_mask) <= 40
    runs = _turns(s)
    assert len(runs) == s.turns or s.finish_reason == "length"
    for t, (_, b) in enumerate(runs[:-1]):  # between two model turns: exactly the reply to the first
      assert s.tokens[b : runs[t + 1][0]] == Scripted.REPLY + [50 + t + 1]
      assert not any(s.logprobs[b : runs[t + 1][0]])
      assert s.tokens[b - 1] in EOS + STOP, "a turn ends at EOS or a stop id"
    multi += len(runs) > 1
  assert multi >= 4, "most episodes should run several turns"
  # what the environment was shown is each model turn, token for token
  for (_, r, i), turn in env.seen:
    s = samples[2 * r + i]
    assert any(s.tokens[a:b] == turn for a, b in _turns(s))


def test_each_turn_continues_exactly_like_a_reprefill_of_the_history(tiny, episodes):
  """Turn k+1's tokens from the pages == a fresh engine prompted with prompt + everything before it."""
  prompts, samples, _, _ = episodes
  checked = 0
  for n, s in enumerate(samples):
    runs = _turns(s)
    for a, b in runs[1:]:
      history = prompts[n // 2] + s.tokens[:a]
      ref = _engine(tiny).run([Request(history, max_new_tokens=b - a, stop_ids=STOP)], seq_base=100 + n)[0]
      assert ref.tokens == s.tokens[a:b]
      np.testing.assert_allclose(ref.logprobs, s.logprobs[a:b], atol=2e-5)
      checked += 1
  assert checked >= 4


def test_sampler_logprobs_equal_trainer_logprobs_on_episodes(tiny, episodes):
  prompts, samples, _, _ = episodes
  graphdef, params = tiny
  comps = [Completion(prompts[n // 2], s.tokens, 0.0, s.logprobs, s.loss_mask) for n, s in enumerate(samples)]
  batch = build_batch(comps, n_micro=1, rows=len(comps), row_len=64, resp_len=40, pack=False)
  rows = (batch.tokens_MRS[0], batch.positions_MRS[0], batch.segment_ids_MRS[0])
  logp, _, _ = sequence_logprobs(model_fns(graphdef), params, rows, batch.gather_MBT[0], batch.targets_MBT[0],
                                 temperature=SAMPLING.temperature, chunk=16)
  mask = batch.mask_MBT[0]
  for n, s in enumerate(samples):  # the trainer's ids are the sampled ids; env tokens carry mask 0
    assert batch.targets_MBT[0][n, : len(s.tokens)].tolist() == s.tokens
    np.testing.assert_array_equal(mask[n, : len(s.tokens)], s.loss_mask)
  assert 0 < mask.sum() < sum(len(s.tokens) for s in samples)
  on = mask > 0
  diff = np.abs(np.asarray(logp)[on] - batch.sampler_logp_MBT[0][on])
  assert diff.max() < 1e-5, f"sampler vs trainer log-prob gap {diff.max():.2e} on episodes"


def test_turn_and_token_limits_say_which(tiny):
  prompt = [5, 6, 11, 12, 13]
  eng = _engine(tiny)
  every = STOP
  reqs = [Request(prompt, n=2, max_new_tokens=60, stop_ids=every, max_turns=2)]
  turns = eng.run(reqs, turns=Scripted(), seq_base=7)
  short = eng.run([Request(prompt, n=2, max_new_tokens=8, stop_ids=every, max_turns=5)], turns=Scripted(),
                  seq_base=7)
  done = eng.run([Request(prompt, n=2, max_new_tokens=60, stop_ids=every, max_turns=5)],
                 turns=Scripted(done_after=1), seq_base=7)
  failed = eng.run([Request(prompt, n=1, max_new_tokens=60, stop_ids=every, max_turns=5)],
                   turns=Scripted(fail_on=2), seq_base=7)
  for s in turns:
    assert s.finish_reason == "turns" and s.turns == 2 and len(_turns(s)) == 2, s
  for s in short:
    assert s.finish_reason == "length" and len(s.tokens) <= 8, s
  for s in done:
    assert s.finish_reason == "stop" and s.turns == 1, s
  assert failed[0].finish_reason == "env_error" and failed[0].turns == 2
  assert eng.pool.stats()["used_pages"] == 0


def test_preempted_and_waiting_episodes_resume_to_the_same_tokens(tiny, episodes):
  prompts, roomy, _, _ = episodes
  reqs = [Request(p, n=2, max_new_tokens=40, stop_ids=STOP, max_turns=3) for p in prompts]
  eng = _engine(tiny, n_pages=24, max_len=64)
  tight = eng.run(reqs, turns=Scripted(), seq_base=100)
  assert eng.stats["preemptions"] > 0, "the pool was meant to run out"
  assert [s.tokens for s in tight] == [s.tokens for s in roomy]
  assert [s.loss_mask for s in tight] == [s.loss_mask for s in roomy]
  eng.pool.check()
  assert eng.pool.stats()["used_pages"] == 0


def test_episodes_need_a_turn_handler(tiny):
  with pytest.raises(ValueError, match="turns="):
    _engine(tiny).run([Request([5, 6], max_new_tokens=4, max_turns=2)])


@pytest.mark.parametrize("policy", ["keep_kv", "abort_and_resume"])
def test_a_weight_update_mid_episode_tags_the_tokens_after_it(tiny, policy):
  """Weights land between chunks while episodes run (some wait for their environment): each token keeps
  the gen_id it was sampled (or appended) under, non-decreasing along the episode; ids and masks stay
  consistent. abort_and_resume re-prefills live and waiting episodes, which still finish their turns."""
  graphdef, params = tiny
  new = jax.tree.map(lambda x: x * 1.01, params)
  eng = _engine(tiny)
  chunks = []

  def on_chunk(engine):
    chunks.append(1)
    if len(chunks) == 3:
      engine.update_weights(new, 1, policy)

  rng = np.random.RandomState(5)
  reqs = [Request(rng.randint(3, 96, 6).tolist(), n=2, max_new_tokens=40, stop_ids=STOP, max_turns=3)
          for _ in range(4)]
  out = eng.run(reqs, on_chunk, turns=Scripted(), seq_base=300)
  assert eng.gen_id == 1
  mixed = 0
  for s in out:
    assert len(s.tokens) == len(s.gen_ids) == len(s.loss_mask) == len(s.logprobs)
    assert all(a <= b for a, b in zip(s.gen_ids, s.gen_ids[1:], strict=False)), s.gen_ids
    mixed += 0 in s.gen_ids and 1 in s.gen_ids
    for t, (_, b) in enumerate(_turns(s)[:-1]):
      assert s.tokens[b : b + 4] == Scripted.REPLY + [51 + t]
  assert mixed > 0, "some episode should span the update"
  if policy == "abort_and_resume":
    assert eng.stats["aborted"] > 0


def _trainer_gaps(graphdef, weights: dict, prompts, out) -> dict[int, float]:
  """{gen_id: max |sampler - trainer| log-prob over the sampled tokens of that gen_id}, the trainer under it."""
  comps = [Completion(prompts[n], s.tokens, 0.0, s.logprobs, s.loss_mask) for n, s in enumerate(out)]
  batch = build_batch(comps, n_micro=1, rows=len(comps), row_len=96, resp_len=60, pack=False)
  rows = (batch.tokens_MRS[0], batch.positions_MRS[0], batch.segment_ids_MRS[0])
  gen = np.full(batch.mask_MBT[0].shape, -1)
  for n, s in enumerate(out):
    gen[n, : len(s.gen_ids)] = s.gen_ids
  gaps = {}
  for g, w in weights.items():
    logp = np.asarray(sequence_logprobs(model_fns(graphdef), w, rows, batch.gather_MBT[0], batch.targets_MBT[0],
                                        temperature=SAMPLING.temperature, chunk=16)[0])
    on = (batch.mask_MBT[0] > 0) & (gen == g)
    gaps[g] = float(np.abs(logp - batch.sampler_logp_MBT[0])[on].max())
  return gaps


class LongReply(Scripted):
  """Episode 0's first turn gets a 20-token reply (its own prefill bucket); every other turn ends the episode."""

  def submit(self, key, sample, turn_start):
    self.seen.append((key, list(sample.tokens[turn_start:])))
    self.ready.append((key, list(range(40, 60)), "") if key[1] == 0 and sample.turns == 1 else (key, None, "stop"))


def test_a_reply_landing_with_an_abort_does_not_write_through_the_freed_slot(tiny):
  """Found by a helper's review. Episode 0's reply is handled in the iteration where abort_and_resume lands: the
  reply queued a one-row prefill (episodes.extend), the abort freed the slot, and the queued prefill still went
  out, writing K/V through the slot's old page table into pages that resumed sequences now own. Episode 3's
  tokens after the update then differed from the trainer's by 1.3 in log-prob. Now a freed slot's queued turn is
  dropped (it resumes from its tokens, the reply among them): every token matches the trainer under its gen_id."""
  graphdef, params = tiny
  new = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(9), x.shape), params)
  rng = np.random.RandomState(5)
  prompts = [rng.randint(3, 96, 6).tolist() for _ in range(4)]
  env, eng = LongReply(), _engine(tiny, max_len=96, n_pages=96)

  def on_chunk(engine):
    if engine.gen_id == 0 and engine._pending is None and any(k[1] == 0 and t for k, t, _ in env.ready):
      engine.update_weights(new, 1, "abort_and_resume")

  out = eng.run([Request(p, n=1, max_new_tokens=60, stop_ids=STOP, max_turns=3) for p in prompts], on_chunk,
                turns=env, seq_base=300)
  assert eng.stats["aborted"] > 0 and sum(1 in s.gen_ids for s in out) >= 2
  gaps = _trainer_gaps(graphdef, {0: params, 1: new}, prompts, out)
  assert max(gaps.values()) < 1e-5, gaps
  eng.pool.check()


def test_finish_on_old_with_a_tight_pool_preempts_an_episode_whose_reply_is_queued(tiny):
  """Found by a helper's review. While a finish_on_old update waits, admission does not flush, so reserve() ran
  before the queued next turn of episode A went out; it preempted A (the youngest) and the turn went out anyway,
  for a free slot: 'advance: slot 1 holds no sequence'. Now the run finishes and the pool stays consistent."""
  graphdef, params = tiny
  new = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(9), x.shape), params)
  rng = np.random.RandomState(0)
  plain = Request(rng.randint(3, 96, 4).tolist(), n=1, max_new_tokens=56)
  episode = Request(rng.randint(3, 96, 4).tolist(), n=1, max_new_tokens=40, stop_ids=STOP, max_turns=8)
  eng = _engine(tiny, n_slots=2, n_pages=18, max_len=64, eos_ids=())

  def on_chunk(engine):
    if engine.gen_id == 0 and engine._pending is None:
      engine.update_weights(new, 1, "finish_on_old")

  out = eng.run([plain, episode], on_chunk, turns=Scripted(), seq_base=100)
  eng.pool.check()
  assert eng.stats["preemptions"] >= 1 and [len(s.tokens) for s in out] == [56, 40]


class Slow(Scripted):
  """Replies only when the stream would otherwise block (an environment slower than the decoder)."""

  def __init__(self):
    super().__init__()
    self.held = []

  def poll(self, block):
    self.held += self.ready
    self.ready = []
    if not block:
      return []
    out, self.held = self.held, []
    return out


def test_a_request_waits_behind_parked_episodes_instead_of_failing(tiny):
  """Found by a helper's review. Two episodes parked for a slow environment held 14 of 16 pages, nothing was
  live, and a queued 28-token prompt raised 'request 3 does not fit the empty pool'. Now the parked episodes
  are preempted (as reserve() does): they resume from their tokens when the replies come."""
  graphdef, params = tiny
  rng = np.random.RandomState(0)
  turn = [Request(rng.randint(3, 96, 8).tolist(), max_new_tokens=40, stop_strings=("|",), max_turns=2)
          for _ in range(2)]
  short = Request(rng.randint(3, 96, 4).tolist(), max_new_tokens=2)
  long_prompt = Request(rng.randint(3, 96, 28).tolist(), max_new_tokens=8)
  ecfg = EngineConfig(n_slots=3, page_size=4, n_pages=16, max_len=64, decode_chunk=4, tail_chunk=4, max_chunk=0,
                      sampling=SAMPLING, eos_ids=())
  eng = RolloutEngine(graphdef, TINY, params, ecfg,  # a model turn ends after 12 tokens
                      detokenize=lambda ids: "a" * len(ids) + ("|" if len(ids) >= 12 else ""))
  out = eng.run([*turn, short, long_prompt], turns=Slow(), seq_base=0)
  assert [(len(s.tokens), s.finish_reason) for s in out] == [(28, "turns"), (28, "turns"), (2, "length"),
                                                             (8, "length")]
  assert eng.stats["preemptions"] >= 1
  eng.pool.check()


def test_env_tokens_get_advantage_zero(episodes):
  """The algorithms' advantages are 0 wherever the loss mask is: environment tokens never get credit."""
  from jaxrl_topo.rl import advantages as adv_lib
  _, samples, _, _ = episodes
  T = max(len(s.tokens) for s in samples)
  mask = np.zeros((len(samples), T), np.float32)
  for n, s in enumerate(samples):
    mask[n, : len(s.tokens)] = s.loss_mask
  rewards = np.arange(len(samples), dtype=np.float32)
  for name, fn in adv_lib.ADVANTAGE_FNS.items():
    adv = np.asarray(fn(rewards, 2, mask))
    assert not adv[mask == 0].any(), name
    assert adv[mask > 0].any(), name
