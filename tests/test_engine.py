"""The paged rollout engine against the dense reference decoder and the trainer's log-probs.

Every comparison is token for token: the engine and `generate_ids` draw each token with the key
(seed, sequence id, position), so even sampled outputs must match exactly, whatever the slot,
batch composition, prefix sharing or preemption history.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
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
  # tail_chunk=5, max_chunk=0: chunks keep one length, so the tests that count chunks (weight updates) mean
  # what they say.
  defaults = dict(n_slots=4, page_size=4, n_pages=64, max_len=64, decode_chunk=5, tail_chunk=5, max_chunk=0,
                  sampling=SAMPLED, eos_ids=EOS)
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
  want = generate_ids(graphdef, params, prompts, DecodeConfig(max_new_tokens=10, sampling=greedy), batch_size=8,
                      impl="dense")
  for g, w in zip(got, want, strict=True):
    assert g.tokens == w.completion_ids, f"{family}: paged engine differs from the dense decoder"
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


@pytest.mark.parametrize("impl", ["bucketed", "fast", "reference", "window", "pallas"])
def test_sampled_engine_matches_dense_decoder(tiny, impl):
  """Rows of 2-20 prompt tokens and 12 new ones in 4-token pages: "window" grows through widths 1 to 8 pages (no
  floor: min_window_tokens=0; the default's 64 tokens would open every window at all 16 pages). "pallas", the GPU
  default, runs its kernel in Pallas interpret mode here."""
  graphdef, params = tiny
  prompts = _prompts(6, seed=2)
  floor = {"min_window_tokens": 0} if impl == "window" else {}
  got = _engine(graphdef, params, impl=impl, **floor).run([Request(p, max_new_tokens=12) for p in prompts])
  want = generate_ids(graphdef, params, prompts, DecodeConfig(max_new_tokens=12, sampling=SAMPLED, eos_ids=EOS),
                      impl="dense")
  assert [g.tokens for g in got] == [w.completion_ids for w in want]
  assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
  # 2e-5: the fp32 budget at these opinionated weights (test_engine_on_a_sharded_rollout_mesh_matches_one_device)
  np.testing.assert_allclose(np.concatenate([g.logprobs for g in got]), np.concatenate([w.logprobs for w in want]),
                             atol=2e-5)


def test_sampler_logprobs_equal_trainer_logprobs():
  """The sampler = trainer invariant: at the same weights the trainer recomputes the sampler's log-probs.

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


def test_a_non_finite_prompt_leaves_the_other_groups_of_its_wave_alone():
  """One prompt whose embedding is inf, prefilled in the same wave as a group of 4 that forks a partial page:
  the group's samples equal its samples alone. (The forks' copy once depended on the whole wave's hidden states
  being finite, so the inf prompt cancelled the copy and the forks read stale K/V as their prompt's last page.)"""
  cfg = dataclasses.replace(TINY, tie_embeddings=False)
  graphdef, params = init_params(cfg, jax.random.key(0))
  params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape), params)
  bad = 3  # token whose input embedding is inf; the group's prompt and completions never use it
  params = {**params, "embed_tokens": params["embed_tokens"].at[bad].set(jnp.inf)}
  group = Request([5, 9, 11, 13, 17, 19], n=4, max_new_tokens=8)  # 6 tokens: a partial page of 4 slots

  def run(requests):
    engine = _engine(graphdef, params, cfg, n_slots=8, sampling=SamplingConfig(greedy=True), eos_ids=())
    engine.run([Request([20 + i, 30, 40, 50, 60, 70, 80], max_new_tokens=20) for i in range(8)])  # stale pages
    return engine.run(requests)

  alone = run([group])
  assert bad not in {t for s in alone for t in s.tokens}
  mixed = run([group, Request([bad, 4, 5, 6, 7], max_new_tokens=8)])
  assert [s.tokens for s in mixed[:4]] == [s.tokens for s in alone]
  # Not bit for bit: the wave's prefill is a matmul over 2 prompts instead of 1, and XLA:CPU's kernel for the
  # other row count may round the first token's log-prob differently in the last bit (seen on one CI machine:
  # 9e-8). Stale K/V in the forks' last page moves the log-probs by orders of magnitude more.
  np.testing.assert_allclose([s.logprobs for s in mixed[:4]], [s.logprobs for s in alone], rtol=0, atol=1e-5)
  assert not np.isfinite(mixed[4].logprobs).all()  # the inf prompt itself is not finite


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
    (Request([1, 2], max_new_tokens=8, stop_ids=(999,)), r"stop_ids \(999,\) must lie in \[0, 128\)"),
    (Request([1, 2], max_new_tokens=8, stop_strings=("",)), "an empty stop string would stop every sample"),
    (Request([1, 2], max_new_tokens=8, stop_strings=("ab",)), "stop strings need an engine built with detokenize="),
    (Request([1, 2], max_new_tokens=8, max_turns=2), r"^Request.max_turns > 0 asks for an episode, .* pass turns="),
])
def test_bad_requests_are_refused_before_any_work(tiny, request_, message):
  graphdef, params = tiny
  with pytest.raises(ValueError, match=message):
    _engine(graphdef, params).run([request_])


# ---------------------------------------------------------------- weight updates under each policy


def _swap_once(params, policy, after_chunk=1):
  def on_chunk(engine):
    if engine.stats["chunks"] == after_chunk and engine.gen_id == 0:
      engine.update_weights(params, gen_id=1, policy=policy)
  return on_chunk


def test_finish_on_old_finishes_live_sequences_on_the_old_weights(tiny):
  graphdef, params = tiny
  _, new = _tiny_params(seed=7)
  requests = [Request(p, max_new_tokens=12) for p in _prompts(5, seed=11)]
  under_old = _engine(graphdef, params, n_slots=2, eos_ids=()).run(requests)
  under_new = _engine(graphdef, new, n_slots=2, eos_ids=()).run(requests)
  eng = _engine(graphdef, params, n_slots=2, eos_ids=())
  got = eng.run(requests, on_chunk=_swap_once(new, "finish_on_old"))
  tags = [set(s.gen_ids) for s in got]
  assert {0} in tags and {1} in tags, "some sequences finish on the old weights, later ones start on the new"
  for s, old, fresh, tag in zip(got, under_old, under_new, tags, strict=True):
    assert len(tag) == 1, "finish-on-old never mixes versions within a sequence"
    assert s.tokens == (old.tokens if tag == {0} else fresh.tokens)
  assert eng.gen_id == 1 and eng.stats["weight_updates"] == 1


def test_abort_and_resume_recomputes_the_prefix_under_the_new_weights(tiny):
  graphdef, params = tiny
  _, new = _tiny_params(seed=7)
  prompts = _prompts(3, seed=12)
  requests = [Request(p, max_new_tokens=14) for p in prompts]
  read = dict(eos_ids=(), impl="bucketed")  # whole chunks (a window's ends early at its edge): the swap lands at 6
  under_old = _engine(graphdef, params, **read).run(requests)
  eng = _engine(graphdef, params, **read)
  got = eng.run(requests, on_chunk=_swap_once(new, "abort_and_resume"))
  assert eng.stats["aborted"] == 3 and eng.stats["resumed"] == 3
  # Reference: the new weights continuing each prompt + the tokens sampled before the swap.
  cut = [s.gen_ids.index(1) for s in got]
  resumed = _engine(graphdef, new, **read).run(
      [Request(p + s.tokens[:c], max_new_tokens=14 - c) for p, s, c in zip(prompts, got, cut, strict=True)])
  for s, old, ref, c in zip(got, under_old, resumed, cut, strict=True):
    assert c == 1 + eng.ecfg.decode_chunk, "the swap landed after the first chunk"
    assert s.tokens[:c] == old.tokens[:c] and s.gen_ids == [0] * c + [1] * (14 - c)
    assert s.tokens[c:] == ref.tokens
    np.testing.assert_allclose(s.logprobs[c:], ref.logprobs, atol=1e-6)
  assert any(s.tokens != old.tokens for s, old in zip(got, under_old, strict=True)), "new weights must show"


@pytest.mark.parametrize("overlap", [False, True])
def test_keep_kv_swaps_at_the_next_chunk_and_bad_updates_are_refused(tiny, overlap):
  """Requested after chunk 1 is read; lands before the next chunk dispatched, which with overlap is
  chunk 3 (chunk 2 was already running on the old weights, and its tokens say so)."""
  graphdef, params = tiny
  _, new = _tiny_params(seed=7)
  eng = _engine(graphdef, params, eos_ids=(), overlap=overlap)
  got = eng.run([Request(p, max_new_tokens=16) for p in _prompts(2, seed=13)], on_chunk=_swap_once(new, "keep_kv"))
  old = 1 + 5 * (2 if overlap else 1)
  assert all(s.gen_ids == [0] * old + [1] * (16 - old) for s in got)
  with pytest.raises(ValueError, match="update policy"):
    eng.update_weights(new, gen_id=2, policy="sometimes")
  with pytest.raises(ValueError, match="gen_id must increase"):
    eng.update_weights(new, gen_id=1)


def test_keep_kv_samples_after_the_swap_under_the_new_weights():
  """Each token's sampler log-prob is the trainer's under the weights its gen_id names. The new weights differ
  from the old in the final norm only, so the K/V cached before the swap is right under both and every token must
  match to fp32. Tags without the weights behind them (the old weights kept) fail: gen-1 tokens then read the old
  weights' log-probs, which differ here by far more than the tolerance."""
  graphdef, params = _tiny_params(scale=0.1)
  new = {**params, "norm": {**params["norm"], "weight": params["norm"]["weight"] * 1.5}}
  prompts = _prompts(4, seed=21)
  samples = _engine(graphdef, params, eos_ids=()).run([Request(p, max_new_tokens=16) for p in prompts],
                                                      on_chunk=_swap_once(new, "keep_kv"))
  comps = [Completion(p, s.tokens, 0.0, s.logprobs) for p, s in zip(prompts, samples, strict=True)]
  batch = build_batch(comps, n_micro=1, rows=4, row_len=40, resp_len=16, pack=False)
  rows = (batch.tokens_MRS[0], batch.positions_MRS[0], batch.segment_ids_MRS[0])
  gen_BT = np.array([s.gen_ids for s in samples])
  assert set(gen_BT.ravel()) == {0, 1}
  sampler_BT = batch.sampler_logp_MBT[0]
  logp = {g: np.asarray(sequence_logprobs(model_fns(graphdef), w, rows, batch.gather_MBT[0], batch.targets_MBT[0],
                                          temperature=1.0, chunk=16)[0]) for g, w in ((0, params), (1, new))}
  for g in (0, 1):
    diff = np.abs(logp[g] - sampler_BT)[gen_BT == g]
    assert diff.max() < 1e-5, f"gen {g} tokens: sampler vs trainer under gen {g}'s weights: {diff.max():.2e}"
  assert np.abs(logp[0] - sampler_BT)[gen_BT == 1].max() > 1e-3, "the two weights must tell apart"


# ---------------------------------------------------------------- stop strings


def _detok(ids):
  return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_cut_at_the_token_that_completes_them(tiny):
  graphdef, params = tiny
  prompts = _prompts(3, seed=14)
  free = _engine(graphdef, params, eos_ids=()).run([Request(p, max_new_tokens=12) for p in prompts])
  stop = _detok(free[0].tokens)[5:7]  # two tokens' worth of text, spanning a chunk boundary
  eng = RolloutEngine(graphdef, TINY, params, EngineConfig(n_slots=4, page_size=4, n_pages=64, max_len=64,
                                                           decode_chunk=5, sampling=SAMPLED), detokenize=_detok)
  got = eng.run([Request(p, max_new_tokens=12, stop_strings=(stop,)) for p in prompts])
  for s, f in zip(got, free, strict=True):
    text = _detok(f.tokens)
    if stop in text:
      end = next(n for n in range(1, 13) if stop in _detok(f.tokens[:n]))
      assert (s.tokens, s.finish_reason) == (f.tokens[:end], "stop")
      assert len(s.logprobs) == len(s.gen_ids) == end
    else:
      assert (s.tokens, s.finish_reason) == (f.tokens, "length")
  assert got[0].finish_reason == "stop" and len(got[0].tokens) <= 7
  with pytest.raises(ValueError, match="detokenize"):
    _engine(graphdef, params).run([Request(prompts[0], max_new_tokens=4, stop_strings=("x",))])


def test_a_failure_inside_a_run_leaves_the_engine_as_good_as_new(tiny):
  """A hook that raises mid-run (after asking for new weights) reaches the caller, and the engine drops every
  sequence: its slots and pages are free, the update landed, and the next run gives a fresh engine's tokens under
  the new weights. Before (a new user's trial), every later run failed: "admit: seq id 0 is None or already in
  slot 0"."""
  graphdef, params = tiny
  _, new = _tiny_params(seed=7)
  requests = [Request(p, n=2, max_new_tokens=12) for p in _prompts(3, seed=31)]
  eng = _engine(graphdef, params, eos_ids=())

  def hook(engine):
    if engine.stats["chunks"] == 1:
      engine.update_weights(new, gen_id=1)
      raise RuntimeError("the hook failed")

  with pytest.raises(RuntimeError, match="the hook failed"):
    eng.run(requests, on_chunk=hook)
  assert eng.gen_id == 1 and eng.params is new
  assert eng.pool.n_free_slots() == 4 and eng.pool.n_free_pages() == 64 and not eng.pool.pins()
  again = eng.run(requests)
  want = _engine(graphdef, new, eos_ids=()).run(requests)
  assert [s.tokens for s in again] == [s.tokens for s in want] and all(set(s.gen_ids) == {1} for s in again)


# ---------------------------------------------------------------- sharded rollout mesh


# the "window" case: no floor, so its windows grow from 1 page
@pytest.mark.parametrize("axes, impl, min_tokens", [({"data": 4, "tensor": 2}, "auto", 64),
                                                    ({"data": 2, "tensor": 2}, "auto", 64),
                                                    ({"data": 2, "tensor": 2}, "window", 0)])
def test_engine_on_a_sharded_rollout_mesh_matches_one_device(tiny, axes, impl, min_tokens):
  from jaxrl_topo.models.model import abstract_model, param_shardings
  from jaxrl_topo.topology.rules import ROLLOUT_RULES, make_mesh

  graphdef, params = tiny
  mesh = make_mesh(axes, jax.devices()[: axes["data"] * axes["tensor"]])
  sharded = jax.device_put(params, param_shardings(abstract_model(TINY)[1], mesh, ROLLOUT_RULES))
  requests = [Request(p, n=2, max_new_tokens=10) for p in _prompts(5, seed=15)]
  want = _engine(graphdef, params).run(requests)
  eng = RolloutEngine(graphdef, TINY, sharded, EngineConfig(n_slots=4, page_size=4, n_pages=64, max_len=64,
                                                            decode_chunk=5, sampling=SAMPLED, eos_ids=EOS,
                                                            impl=impl, min_window_tokens=min_tokens), mesh=mesh)
  got = eng.run(requests)
  sizes = (engine_lib.generate._cache_size(), engine_lib.prefill._cache_size())
  # The same batch again compiles nothing; "window" compiles one chunk program per (rows, window width) pair it
  # meets, so another order of the batch may meet a pair this one did not.
  eng.run(requests[::-1] if impl == "auto" else requests)
  assert (engine_lib.generate._cache_size(), engine_lib.prefill._cache_size()) == sizes, "steady state recompiled"
  assert [s.tokens for s in got] == [s.tokens for s in want]
  # Observed max |diff| 1.06e-5 (data=4, tensor=2; bucketed read): sharded matmuls sum in another
  # order at these opinionated weights (logits ~3x a trained model's); 2e-5 is the fp32 budget here.
  np.testing.assert_allclose(np.concatenate([s.logprobs for s in got]),
                             np.concatenate([s.logprobs for s in want]), atol=2e-5)
  spec = eng.state.cache.k_LPSKH.sharding.spec
  assert tuple(spec)[3] == "tensor" and eng.state.last_B.sharding.spec[0] == "data"
  assert len(eng.state.cache.k_LPSKH.sharding.device_set) == axes["data"] * axes["tensor"]
  with pytest.raises(ValueError, match="multiple of the mesh's data axis"):
    RolloutEngine(graphdef, TINY, sharded, EngineConfig(n_slots=3), mesh=mesh)
  # Weights elsewhere (a new user's trial: the trainer's layout) are refused at once, naming the leaf; before, the
  # engine was built and its first call failed in JAX's words ("Received incompatible devices for jitted ...").
  with pytest.raises(ValueError, match=r"^RolloutEngine: params\['embed_tokens'\] lies on devices \[7\], "
                                       r"the engine's mesh on \[0, "):
    RolloutEngine(graphdef, TINY, jax.device_put(params, jax.devices()[7]), EngineConfig(n_slots=4), mesh=mesh)


def test_jetstream_shaped_pieces_drive_one_sequence(tiny):
  """insert / generate / free by hand give the same tokens as run()."""
  graphdef, params = tiny
  prompt = _prompts(1, seed=16)[0]
  want = _engine(graphdef, params, eos_ids=()).run([Request(prompt, max_new_tokens=11)])[0]
  eng = _engine(graphdef, params, eos_ids=())
  slot, tok, lp = eng.insert(prompt, 0, max_new_tokens=11)
  tokens, logprobs = [tok], [lp]
  while eng.host.active_B[slot]:
    toks, lps, emitted = eng.generate()
    tokens += toks[emitted[:, slot], slot].tolist()
    logprobs += lps[emitted[:, slot], slot].tolist()
  eng.free(slot)
  assert tokens == want.tokens and np.allclose(logprobs, want.logprobs)
  assert eng.pool.stats()["used_pages"] == 0


def test_kv_heads_replicate_when_the_tensor_axis_exceeds_them(tiny):
  """tiny has 2 KV heads; at tensor=4 every tensor shard keeps both (no error), and the outputs are
  one device's. Params are replicated here: their own tensor layout is the model's business."""
  from jaxrl_topo.topology.rules import make_mesh

  graphdef, params = tiny
  mesh = make_mesh({"data": 2, "tensor": 4}, jax.devices()[:8])
  replicated = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  requests = [Request(p, n=2, max_new_tokens=8) for p in _prompts(3, seed=17)]
  want = _engine(graphdef, params).run(requests)
  ecfg = EngineConfig(n_slots=4, page_size=4, n_pages=64, max_len=64, decode_chunk=5, sampling=SAMPLED, eos_ids=EOS)
  eng = RolloutEngine(graphdef, TINY, replicated, ecfg, mesh=mesh)
  got = eng.run(requests)
  assert [s.tokens for s in got] == [s.tokens for s in want]
  k = eng.state.cache.k_LPSKH
  assert "tensor" not in tuple(k.sharding.spec)
  assert k.sharding.shard_shape(k.shape)[3] == TINY.n_kv_heads, "each device holds every KV head"


def test_kv_dtype_sets_the_pool_dtype(tiny):
  """rollout.kv_dtype: a bfloat16 pool holds half the bytes of the fp32 default, and decodes."""
  graphdef, params = tiny
  fp32, bf16 = _engine(graphdef, params), _engine(graphdef, params, kv_dtype="bfloat16")
  assert fp32.state.cache.k_LPSKH.dtype == np.float32 and bf16.state.cache.k_LPSKH.dtype == jax.numpy.bfloat16
  assert bf16.state.cache.k_LPSKH.nbytes * 2 == fp32.state.cache.k_LPSKH.nbytes
  got = bf16.run([Request(p, max_new_tokens=6) for p in _prompts(2, seed=19)])
  assert all(len(s.tokens) >= 1 and all(0 <= t < TINY.vocab_size for t in s.tokens) for s in got)


# ---------------------------------------------------------------- a new user's trial: errors before any work


def test_requests_and_engine_config_take_plain_python_values_or_say_what_they_need():
  """Before: stop_strings="=QQ" was iterated per character (a sample stopped at "="); prompt_ids="text" failed
  with "'<' not supported between 'str' and 'int'"; EngineConfig(eos_ids=5) failed after compiling ("argument of
  type 'int' is not iterable") and a list of eos ids was unhashable (a static argument of the jitted programs)."""
  assert Request([1, 2], stop_strings="=QQ").stop_strings == ("=QQ",)  # one str: one stop string
  assert Request([1, 2], stop_strings=["a", "b"], stop_ids=7).stop_strings == ("a", "b")
  assert Request([1, 2], stop_ids=7).stop_ids == (7,) and Request(np.array([1, 2])).stop_ids == ()
  with pytest.raises(ValueError, match=r"^Request.prompt_ids must be a sequence of ints \(token ids\), got str 'text'"):
    Request("text")
  with pytest.raises(ValueError, match="Request.prompt_ids must be a sequence of ints"):
    Request([1.5, 2.0])
  with pytest.raises(ValueError, match="^Request.stop_strings must be a str or a sequence of str, got"):
    Request([1], stop_strings=("a", 3))
  # Before (a new user's trial): "'float' object cannot be interpreted as an integer" from the scheduler, and
  # "'<=' not supported between instances of 'str' and 'int'".
  with pytest.raises(ValueError, match=r"^Request.n must be an int, got float 2.5$"):
    Request([1], n=2.5)
  with pytest.raises(ValueError, match=r"^Request.max_new_tokens must be an int, got str '8'$"):
    Request([1], max_new_tokens="8")
  assert Request([1], n=np.int64(2)).n == 2 and type(Request([1], n=np.int64(2)).n) is int
  assert EngineConfig(eos_ids=5).eos_ids == (5,)
  ecfg = EngineConfig(eos_ids=[2, np.int64(3)])
  assert ecfg.eos_ids == (2, 3) and type(ecfg.eos_ids[1]) is int and hash(ecfg)
  with pytest.raises(ValueError, match=r"^EngineConfig.eos_ids='2' must be a token id or a sequence of token ids"):
    EngineConfig(eos_ids="2")
  with pytest.raises(ValueError, match=r"^EngineConfig.eos_ids=\(2.0,\) must be a token id"):
    EngineConfig(eos_ids=(2.0,))


def test_sequences_past_the_models_position_limit_are_refused_before_any_work(tiny):
  """tiny's max_position_embeddings is 512. Before: EngineConfig(max_len=4096) generated 600 tokens (positions past
  the limit, silently) and generate_ids took a 570-token prompt. A max_len the limit rounded up to a page passes (a
  run's prompt + completion in whole pages); each request is then held to the limit itself."""
  graphdef, params = tiny
  with pytest.raises(ValueError, match=r"^EngineConfig.max_len=4096 > the model's position limit 512 "
                                       r"\(max_position_embeddings\): lower max_len to 512 or less$"):
    _engine(graphdef, params, max_len=4096, n_pages=2048)
  cfg = dataclasses.replace(TINY, max_position=30)  # not a whole number of 4-token pages
  eng = RolloutEngine(graphdef, cfg, params, EngineConfig(n_slots=4, page_size=4, n_pages=64, max_len=32))
  with pytest.raises(ValueError, match=r"^request 0: prompt 28 \+ max_new_tokens 3 > the model's position limit 30 "):
    eng.run([Request([5] * 28, max_new_tokens=3)])
  with pytest.raises(ValueError, match="max_len=36 > the model's position limit 30"):
    RolloutEngine(graphdef, cfg, params, EngineConfig(n_slots=4, page_size=4, n_pages=64, max_len=36))
  decode = DecodeConfig(max_new_tokens=16)
  for impl in ("paged", "dense"):
    with pytest.raises(ValueError, match=r"^prompt 1: its 570 tokens \+ max_new_tokens 16 > the model's position "
                                         r"limit 512 \(max_position_embeddings\)$"):
      generate_ids(graphdef, params, [[5, 6], [5] * 570], decode, impl=impl)
    assert generate_ids(graphdef, params, [], decode, impl=impl) == []  # as engine.run([]); was "max() arg is empty"
  assert _engine(graphdef, params).run([]) == []


def test_update_weights_refuses_params_the_engine_cannot_run_naming_the_leaf(tiny):
  """Before: a mis-shaped or incomplete tree, another dtype, or weights on other devices were taken, and failed
  (or silently recompiled) at the engine's next chunk; now update_weights refuses them from their metadata."""
  graphdef, params = tiny
  eng = _engine(graphdef, params)
  layer = "['layers'][0]['mlp']['up_proj']['kernel']"

  def changed(**layer0_mlp):
    new = jax.tree.map(lambda x: x, params)
    new["layers"][0]["mlp"] = {**new["layers"][0]["mlp"], **layer0_mlp}
    return new

  cases = [
      (changed(up_proj={"kernel": jnp.zeros((64, 64))}),
       f"update_weights: {layer} is float32 [64, 64] in the new params, float32 [64, 128] in the engine's"),
      (changed(up_proj={"kernel": params["layers"][0]["mlp"]["up_proj"]["kernel"].astype(jnp.bfloat16)}),
       f"update_weights: {layer} is bfloat16 [64, 128] in the new params, float32 [64, 128] in the engine's"),
      ({k: v for k, v in params.items() if k != "norm"}, "update_weights: the new params lack ['norm']['weight']"),
      (changed(extra={"kernel": jnp.zeros(3)}),
       "update_weights: the new params hold ['layers'][0]['mlp']['extra']['kernel'], which the engine's do not"),
      (jax.device_put(params, jax.devices()[1]),
       "update_weights: ['embed_tokens'] lies on devices [1] in the new params, on [0] in the engine's"),
  ]
  for new, says in cases:
    with pytest.raises(ValueError) as err:
      eng.update_weights(new, gen_id=1)
    assert str(err.value).startswith(says), str(err.value)
  assert eng.gen_id == 0 and eng.params is params and eng.stats["weight_updates"] == 0
  eng.update_weights(jax.tree.map(lambda x: x * 1.01, params), gen_id=1)  # same tree, shapes, dtypes, devices
  assert eng.gen_id == 1
