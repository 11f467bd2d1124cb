"""The paged rollout engine against the dense reference decoder and the trainer's log-probs.

Every comparison is token for token: the engine and `generate_ids` draw each token with the key
(seed, sequence id, position), so even sampled outputs must match exactly, whatever the slot,
batch composition, prefix sharing or preemption history.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hf_fixtures import FAMILY_CASES, make_hf_model

from jaxrl_topo.models import hf_io
from jaxrl_topo.models.model import init_params
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.rollout import engine as engine_lib
from jaxrl_topo.rollout.dense import DecodeConfig
from jaxrl_topo.rollout.engine import EngineConfig, Request, RolloutEngine
from jaxrl_topo.rollout.generate import generate_ids
from jaxrl_topo.rollout.sampling import SamplingConfig
from jaxrl_topo.train.batch import Completion, build_batch
from jaxrl_topo.train.policy import model_fns, sequence_logprobs

TINY = get_preset("tiny")
SAMPLED = SamplingConfig(temperature=1.0, top_p=0.9)
EOS = (2,)


def _tiny_params(seed=0, scale=0.3):
  graphdef, params = init_params(TINY, jax.random.key(seed))
  # Larger weights than the init's std 0.02, so the model is opinionated and a wrong token shows.
  return graphdef, jax.tree.map(lambda x: x + scale * jax.random.normal(jax.random.key(seed + 1), x.shape), params)


def _prompts(n, seed=0, max_len=20, vocab=96):
  rng = np.random.RandomState(seed)
  return [rng.randint(3, vocab, rng.randint(1, max_len)).tolist() for _ in range(n)]


def _engine(graphdef, params, cfg=TINY, **kw):
  defaults = dict(n_slots=4, page_size=4, n_pages=64, max_len=64, decode_chunk=5, sampling=SAMPLED, eos_ids=EOS)
  return RolloutEngine(graphdef, cfg, params, EngineConfig(**{**defaults, **kw}))


@pytest.fixture(scope="module")
def tiny():
  return _tiny_params()


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_greedy_engine_matches_dense_decoder(family, tmp_path):
  model = make_hf_model(family, seed=4)
  model.save_pretrained(str(tmp_path))
  cfg, graphdef, params = hf_io.load_model(str(tmp_path), dtype="float32")
  prompts = _prompts(5, seed=1)
  greedy = SamplingConfig(greedy=True)
  eng = _engine(graphdef, params, cfg, sampling=greedy, eos_ids=())
  got = eng.run([Request(p, max_new_tokens=10) for p in prompts])
  want = generate_ids(graphdef, params, prompts, DecodeConfig(max_new_tokens=10, sampling=greedy), batch_size=8)
  for g, w in zip(got, want, strict=True):
    assert g.tokens == w.completion_ids, f"{family}: paged engine differs from the dense decoder"
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_sampled_engine_matches_dense_decoder(tiny, impl):
  graphdef, params = tiny
  prompts = _prompts(6, seed=2)
  got = _engine(graphdef, params, impl=impl).run([Request(p, max_new_tokens=12) for p in prompts])
  want = generate_ids(graphdef, params, prompts, DecodeConfig(max_new_tokens=12, sampling=SAMPLED, eos_ids=EOS))
  assert [g.tokens for g in got] == [w.completion_ids for w in want]
  assert [g.finish_reason for g in got] == [w.finish_reason for w in want]


def test_sampler_logprobs_equal_trainer_logprobs():
  """The invariant of DESIGN §6: at the same weights the trainer recomputes the sampler's log-probs.

  Observed max |Δ| 2.4e-6 (fast) / 3.8e-6 (reference) at weight noise 0.1. The gap is fp32 rounding
  of incremental (prefill + decode) vs one-pass attention, and grows with the logits: at noise 0.3
  (logits ~3x larger) it reached 1.6e-5 with both attention paths, so it is not the paged read."""
  graphdef, params = _tiny_params(scale=0.1)
  sampling = SamplingConfig(temperature=0.7, top_k=20)
  prompts = _prompts(6, seed=3)
  samples = _engine(graphdef, params, sampling=sampling).run([Request(p, max_new_tokens=10) for p in prompts])
  comps = [Completion(p, s.tokens, 0.0, s.logprobs) for p, s in zip(prompts, samples, strict=True)]
  batch = build_batch(comps, n_micro=1, rows=6, row_len=32, resp_len=10, pack=False)
  rows = (batch.tokens_MRS[0], batch.positions_MRS[0], batch.segment_ids_MRS[0])
  logp, _, _ = sequence_logprobs(model_fns(graphdef), params, rows, batch.gather_MBT[0], batch.targets_MBT[0],
                                 temperature=0.7, chunk=16)
  mask = batch.mask_MBT[0] > 0
  diff = np.abs(np.asarray(logp)[mask] - batch.sampler_logp_MBT[0][mask])
  assert diff.max() < 1e-5, f"sampler vs trainer log-prob gap {diff.max():.2e} (fp32 must agree to 1e-5)"


def test_grpo_group_shares_prefill_and_matches_unshared(tiny):
  graphdef, params = tiny
  prompt = _prompts(1, seed=5, max_len=14)[0] + [7, 8, 9]  # >= one full page plus a partial one
  shared = _engine(graphdef, params)
  got = shared.run([Request(prompt, n=4, max_new_tokens=8)])
  unshared = _engine(graphdef, params).run([Request(prompt, max_new_tokens=8) for _ in range(4)])
  assert [s.tokens for s in got] == [s.tokens for s in unshared]
  assert shared.stats["prefills"] == 1 and shared.stats["forks"] == 3
  assert len({tuple(s.tokens) for s in got}) > 1, "samples of a group should differ (independent keys)"


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
  batched = _engine(graphdef, params, n_slots=3).run(requests)
  alone = _engine(graphdef, params, n_slots=1).run(requests)
  assert [s.tokens for s in batched] == [s.tokens for s in alone]
  assert all(len(s.tokens) <= r.max_new_tokens for s, r in zip(batched, requests, strict=True))


def test_steady_state_compiles_nothing_new(tiny):
  graphdef, params = tiny
  eng = _engine(graphdef, params)
  eng.run([Request(p, max_new_tokens=6) for p in _prompts(4, seed=8, max_len=15)])  # warm: buckets 16
  sizes = (engine_lib.generate._cache_size(), engine_lib.prefill._cache_size())
  eng.run([Request(p, max_new_tokens=6) for p in _prompts(5, seed=9, max_len=15)])  # new values, same buckets
  assert (engine_lib.generate._cache_size(), engine_lib.prefill._cache_size()) == sizes


def test_stop_ids_and_gen_id_tags(tiny):
  graphdef, params = tiny
  prompts = _prompts(3, seed=10)
  first = _engine(graphdef, params, eos_ids=()).run([Request(p, max_new_tokens=12) for p in prompts])
  stop = first[0].tokens[4]
  eng = _engine(graphdef, params, eos_ids=())
  swaps = []

  def on_chunk(engine):
    if not swaps:
      engine.update_weights(params, gen_id=1)  # same values, new version: only the tags change
      swaps.append(engine.stats["chunks"])

  got = eng.run([Request(p, max_new_tokens=12, stop_ids=(stop,)) for p in prompts], on_chunk=on_chunk)
  assert got[0].tokens == first[0].tokens[: first[0].tokens.index(stop) + 1] and got[0].finish_reason == "stop"
  for s in got:
    assert s.gen_ids[0] == 0 and s.gen_ids == sorted(s.gen_ids), "tags are per token and never go back"
  assert any(1 in s.gen_ids for s in got), "tokens sampled after the swap carry the new gen_id"
  with pytest.raises(ValueError, match="gen_id must increase"):
    eng.update_weights(params, gen_id=1)


@pytest.mark.parametrize("request_, message", [
    (Request([1, 2], max_new_tokens=100), "request 0: prompt 2 \\+ max_new_tokens 100 > max_len 64"),
    (Request([1, 2], n=5, max_new_tokens=8), "n=5 samples need as many decode slots"),
    (Request([], max_new_tokens=3), "non-empty prompt"),
    (Request([1, 500], max_new_tokens=8), "token ids must lie in"),
])
def test_bad_requests_are_refused_before_any_work(tiny, request_, message):
  graphdef, params = tiny
  with pytest.raises(ValueError, match=message):
    _engine(graphdef, params).run([request_])
