"""Paged KV cache: fast == bucketed (heads folded or not) == window == reference == a numpy softmax over the
valid tokens; paged == dense == full forward."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_topo.models.layers import DenseKVCache
from jaxrl_topo.models.model import forward, init_params
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.rollout import pallas_paged
from jaxrl_topo.rollout.paged import PagedKVCache
from jaxrl_topo.rollout.pallas_paged import resolve_impl

CFG = get_preset("tiny")
_forward = jax.jit(forward, static_argnums=0)  # one compile per (cache type, shapes), shared across tests


@pytest.fixture(scope="module")
def model():
  return init_params(CFG, jax.random.key(0))


def _shuffled_table(rng, pages_needed, n_pages, max_pages):
  """Rows get pages in a random (non-contiguous) order; some rows get one spare page they never fill."""
  perm = iter(rng.permutation(n_pages).tolist())
  table = np.full((len(pages_needed), max_pages), -1, np.int32)
  for b, n in enumerate(pages_needed):
    n_assigned = min(max_pages, n + (b % 2))
    table[b, :n_assigned] = [next(perm) for _ in range(n_assigned)]
  return table


def _numpy_attention(q_BNH, k_PSKH, v_PSKH, table_BM, pos_B):
  """softmax over exactly the tokens 0..pos of each row, read page by page in float64."""
  B, N, H = q_BNH.shape
  S, K = k_PSKH.shape[1], k_PSKH.shape[2]
  out = np.zeros((B, N, H))
  for b in range(B):
    ks = np.stack([k_PSKH[table_BM[b, p // S], p % S] for p in range(pos_B[b] + 1)])  # [len, K, H]
    vs = np.stack([v_PSKH[table_BM[b, p // S], p % S] for p in range(pos_B[b] + 1)])
    for n in range(N):
      logits = ks[:, n // (N // K)] @ q_BNH[b, n] / np.sqrt(H)
      w = np.exp(logits - logits.max())
      out[b, n] = (w / w.sum()) @ vs[:, n // (N // K)]
  return out


# Each page size twice and each group size at least once, not the whole 3 x 4 grid (a case is six reads, the
# Pallas kernel interpreted among them): one page per token to pages longer than some rows; MHA to MQA.
@pytest.mark.parametrize("page_size, group", [(1, 1), (1, 8), (4, 2), (4, 4), (16, 1), (16, 8)])
def test_fast_decode_matches_reference_and_numpy(page_size, group):
  """Ragged lengths, shuffled pages, garbage everywhere that is not a valid token: none of it leaks."""
  rng = np.random.default_rng(page_size * 10 + group)
  lengths = np.array([1, 5, 17, 33])  # tokens cached after this step, the new one included
  N, H, L = 8, 16, 2
  K = N // group
  S = page_size
  M = -(-40 // S)
  pages_needed = -(-lengths // S)
  P = int(pages_needed.sum()) + 4 + 7
  shape = (L, P, S, K, H)
  k_pool = rng.normal(size=shape).astype(np.float32) * 3  # stale garbage, overwritten only where valid
  v_pool = rng.normal(size=shape).astype(np.float32) * 3
  table = _shuffled_table(rng, pages_needed, P, M)
  q = rng.normal(size=(4, 1, N, H)).astype(np.float32)
  k_new = rng.normal(size=(4, 1, K, H)).astype(np.float32)
  v_new = rng.normal(size=(4, 1, K, H)).astype(np.float32)
  pos = (lengths - 1)[:, None].astype(np.int32)

  def run(impl, fold_heads=True):
    cache = PagedKVCache(k_LPSKH=jnp.asarray(k_pool), v_LPSKH=jnp.asarray(v_pool), table_BM=jnp.asarray(table),
                         page_size=S, impl=impl, block_tokens=8,  # 8 keys/block: several loop trips
                         fold_heads=fold_heads)
    if impl == "window":  # a power of two (or M) of pages covering every row's position, as a chunk opens it
      n = min(M, 1 << (int((table >= 0).sum(axis=1).max()) - 1).bit_length())
      opened = lambda c: c.open_window(n, jnp.float32, jnp.asarray(pos[:, 0]))  # noqa: E731
      return jax.jit(lambda c: opened(c).attend(1, q, k_new, v_new, pos))(cache)
    return jax.jit(lambda c: c.attend(1, q, k_new, v_new, pos))(cache)

  (fast, fast_cache), (ref, ref_cache), (buck, buck_cache) = run("fast"), run("reference"), run("bucketed")
  window, window_cache = run("window")
  unfolded, unfolded_cache = run("bucketed", fold_heads=False)  # bucketed where KV heads are split over devices
  pallas, pallas_cache = run("pallas")  # the GPU kernel, in Pallas interpret mode on CPU
  k_want, v_want = k_pool.copy(), v_pool.copy()
  for b in range(4):
    k_want[1, table[b, pos[b, 0] // S], pos[b, 0] % S] = k_new[b, 0]
    v_want[1, table[b, pos[b, 0] // S], pos[b, 0] % S] = v_new[b, 0]
  for cache in (fast_cache, ref_cache, buck_cache, unfolded_cache, pallas_cache, window_cache):  # layer 1's new slots
    np.testing.assert_array_equal(cache.k_LPSKH, k_want)
    np.testing.assert_array_equal(cache.v_LPSKH, v_want)
  want = _numpy_attention(q[:, 0], k_want[1], v_want[1], table, pos[:, 0])
  np.testing.assert_allclose(ref[:, 0], want, atol=2e-5, rtol=0)
  np.testing.assert_allclose(fast[:, 0], want, atol=2e-5, rtol=0)
  np.testing.assert_allclose(fast, ref, atol=2e-5, rtol=0)
  np.testing.assert_allclose(buck[:, 0], want, atol=2e-5, rtol=0)
  np.testing.assert_allclose(unfolded[:, 0], want, atol=2e-5, rtol=0)
  np.testing.assert_allclose(pallas[:, 0], want, atol=2e-5, rtol=0)
  np.testing.assert_allclose(window[:, 0], want, atol=2e-5, rtol=0)
  # The window holds what the pool holds at every position up to each row's, the new token included.
  for b in range(4):
    k_win_KWH = np.asarray(window_cache.window_k[1])[b].transpose(0, 2, 1)  # keys held [K, H, W]
    for x_want, x_win_KWH in ((k_want, k_win_KWH), (v_want, np.asarray(window_cache.window_v[1])[b])):
      rows = np.stack([x_want[1, table[b, p // S], p % S] for p in range(pos[b, 0] + 1)])  # [len, K, H]
      np.testing.assert_array_equal(x_win_KWH[:, : pos[b, 0] + 1].transpose(1, 0, 2), rows)


@pytest.mark.parametrize("impl", ["reference", "fast", "bucketed"])
def test_unassigned_pages_drop_writes(impl):
  """A row with no pages writes nothing (not to page 0, not to page P-1); a half-paged row writes its page only."""
  S, P = 4, 6
  k_pool = jax.random.normal(jax.random.key(1), (CFG.n_layers, P, S, CFG.n_kv_heads, CFG.head_dim))
  table = np.array([[-1, -1], [3, -1]], np.int32)
  cache = PagedKVCache(k_LPSKH=k_pool, v_LPSKH=-k_pool, table_BM=jnp.asarray(table), page_size=S, impl=impl)
  T = 3 * S  # positions 0..11: row 1 has a page for 0..3 only; 8..11 are past M*S = 8
  new = jnp.ones((2, T, CFG.n_kv_heads, CFG.head_dim))
  q = jnp.ones((2, T, CFG.n_heads, CFG.head_dim))
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  _, got = jax.jit(lambda c: c.attend(0, q, new, 2 * new, positions))(cache)
  want_k = np.asarray(k_pool).copy()
  want_k[0, 3] = 1.0
  np.testing.assert_array_equal(got.k_LPSKH, want_k)
  want_v = -np.asarray(k_pool)
  want_v[0, 3] = 2.0
  np.testing.assert_array_equal(got.v_LPSKH, want_v)
  only_unassigned = cache.replace(table_BM=jnp.full((2, 2), -1, jnp.int32))
  _, got = jax.jit(lambda c: c.attend(1, q, new, new, positions))(only_unassigned)
  np.testing.assert_array_equal(got.k_LPSKH, k_pool)
  np.testing.assert_array_equal(got.v_LPSKH, -k_pool)


def _decode_steps(graphdef, params, cache, prompts_BT, lens_B, steps_BN):
  """Prefill right-padded prompts, then feed steps_BN one token at a time; logits of every prediction."""
  B, T = prompts_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  logits_BTV, cache = _forward(graphdef, params, prompts_BT, positions_BT, None, cache)
  out = [np.take_along_axis(np.asarray(logits_BTV), (lens_B - 1)[:, None, None], axis=1)[:, 0]]
  for i in range(steps_BN.shape[1]):
    logits_B1V, cache = _forward(graphdef, params, steps_BN[:, i:i + 1], (lens_B + i)[:, None], None, cache)
    out.append(np.asarray(logits_B1V[:, 0]))
  return np.stack(out, axis=1), cache


def _full_forward(graphdef, params, prompts_BT, lens_B, steps_BN):
  """The same predictions from one causal forward over prompt + continuation (no cache)."""
  B, n = steps_BN.shape
  seqs = np.zeros((B, prompts_BT.shape[1] + n), np.int32)
  for b in range(B):
    seqs[b, :lens_B[b] + n] = np.concatenate([prompts_BT[b, :lens_B[b]], steps_BN[b]])
  positions = np.broadcast_to(np.arange(seqs.shape[1], dtype=np.int32), seqs.shape)
  logits = np.asarray(_forward(graphdef, params, seqs, positions)[0])
  return np.stack([logits[b, lens_B[b] - 1:lens_B[b] + n] for b in range(B)])


def _ragged_case(seed, T=12, n_new=6):
  rng = np.random.default_rng(seed)
  lens = np.array([3, 12, 1, 7], np.int32)
  prompts = rng.integers(1, CFG.vocab_size, (4, T)).astype(np.int32)
  prompts[np.arange(T)[None, :] >= lens[:, None]] = 0  # right padding
  return rng, prompts, lens, rng.integers(1, CFG.vocab_size, (4, n_new)).astype(np.int32)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("impl", ["reference", "fast", "bucketed", "pallas"])
def test_paged_model_matches_dense_and_full_forward(model, page_size, impl):
  graphdef, params = model
  rng, prompts, lens, steps = _ragged_case(0)
  n_new = steps.shape[1]
  dense, _ = _decode_steps(graphdef, params, DenseKVCache.zeros(CFG, 4, 12 + n_new), prompts, lens, steps)
  M = -(-(12 + n_new) // page_size)
  P = 4 * M + 3
  table = _shuffled_table(rng, -(-(lens + n_new) // page_size), P, M)
  cache = PagedKVCache.zeros(CFG, P, page_size, M, 4, impl=impl, block_tokens=8)
  garbage = jax.random.normal(jax.random.key(2), cache.k_LPSKH.shape)
  cache = cache.replace(k_LPSKH=garbage, v_LPSKH=-garbage, table_BM=jnp.asarray(table))
  paged, _ = _decode_steps(graphdef, params, cache, prompts, lens, steps)
  full = _full_forward(graphdef, params, prompts, lens, steps)
  np.testing.assert_allclose(dense, full, atol=2e-5, rtol=0)
  np.testing.assert_allclose(paged, dense, atol=2e-5, rtol=0)


@pytest.mark.parametrize("impl", ["reference", "fast", "bucketed"])
def test_shared_prompt_pages_decode_as_if_unshared(model, impl):
  """GRPO prefix sharing: two rows read the same physical prompt pages, each writes its own pages."""
  graphdef, params = model
  S, n_new, L = 4, 6, 10  # prompt: pages 0-1 full (shared), page 2 partial (copied per row)
  rng = np.random.default_rng(3)
  prompt = rng.integers(1, CFG.vocab_size, (1, L)).astype(np.int32)
  steps = rng.integers(1, CFG.vocab_size, (2, n_new)).astype(np.int32)
  one = PagedKVCache.zeros(CFG, 9, S, 4, 1, impl=impl).replace(table_BM=jnp.asarray([[5, 2, 7, -1]], jnp.int32))
  positions = jnp.arange(L, dtype=jnp.int32)[None]
  _, one = _forward(graphdef, params, prompt, positions, None, one)
  k, v = one.k_LPSKH.at[:, 0].set(one.k_LPSKH[:, 7]), one.v_LPSKH.at[:, 0].set(one.v_LPSKH[:, 7])  # copy-on-write
  shared = one.replace(k_LPSKH=k, v_LPSKH=v, table_BM=jnp.asarray([[5, 2, 7, 1], [5, 2, 0, 8]], jnp.int32))
  lens = np.full((2,), L, np.int32)
  got = []
  for i in range(n_new):
    logits_B1V, shared = _forward(graphdef, params, steps[:, i:i + 1], (lens + i)[:, None], None, shared)
    got.append(np.asarray(logits_B1V[:, 0]))
  prompts = np.repeat(prompt, 2, axis=0)
  want = _full_forward(graphdef, params, prompts, lens, steps)[:, 1:]
  np.testing.assert_allclose(np.stack(got, axis=1), want, atol=2e-5, rtol=0)
  for pool_before, pool_after in ((one.k_LPSKH, shared.k_LPSKH), (one.v_LPSKH, shared.v_LPSKH)):
    np.testing.assert_array_equal(pool_after[:, np.array([5, 2])], pool_before[:, np.array([5, 2])])
  assert not np.array_equal(shared.k_LPSKH[:, 7], shared.k_LPSKH[:, 0])  # the two rows diverged in page 2


def test_decode_step_compiles_once_and_donates(model):
  graphdef, params = model
  rng, prompts, lens, steps = _ragged_case(4, n_new=3)
  cache = PagedKVCache.zeros(CFG, 24, 4, 6, 4, impl="fast")
  cache = cache.replace(table_BM=jnp.asarray(_shuffled_table(rng, -(-(lens + 3) // 4), 24, 6)))
  positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (4, 12))
  _, cache = _forward(graphdef, params, prompts, positions, None, cache)

  @chex.assert_max_traces(n=1)
  def decode(params, cache, tok_B1, pos_B1):
    return forward(graphdef, params, tok_B1, pos_B1, None, cache)

  decode = jax.jit(decode, donate_argnums=1)
  got = []
  for i in range(3):  # new tokens and positions each step, same shapes: one trace
    old = cache
    logits_B1V, cache = decode(params, cache, jnp.asarray(steps[:, i:i + 1]), jnp.asarray(lens + i)[:, None])
    assert old.k_LPSKH.is_deleted()  # donated: the step reused the pool's buffer
    got.append(np.asarray(logits_B1V[:, 0]))
  want = _full_forward(graphdef, params, prompts, lens, steps)[:, 1:]
  np.testing.assert_allclose(np.stack(got, axis=1), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("impl, fold_heads", [("fast", False), ("bucketed", False), ("bucketed", True),
                                              ("pallas", False), ("window", False)])
def test_an_idle_row_writes_nothing_and_reads_nothing(impl, fold_heads):
  """Position -1 (an idle decode slot): the pool is unchanged and the row's output is zero, while
  the live row beside it attends as usual."""
  S, P = 4, 6
  k_pool = jax.random.normal(jax.random.key(3), (CFG.n_layers, P, S, CFG.n_kv_heads, CFG.head_dim))
  cache = PagedKVCache(k_LPSKH=k_pool, v_LPSKH=-k_pool, table_BM=jnp.asarray([[2, 4], [1, 3]], jnp.int32),
                       page_size=S, impl=impl, fold_heads=fold_heads)
  q = jax.random.normal(jax.random.key(4), (2, 1, CFG.n_heads, CFG.head_dim))
  new = jnp.ones((2, 1, CFG.n_kv_heads, CFG.head_dim))
  opened = (lambda c: c.open_window(2, jnp.float32, jnp.asarray([0, 5]))) if impl == "window" else (lambda c: c)
  out, got = jax.jit(lambda c: opened(c).attend(1, q, new, new, jnp.asarray([[-1], [5]], jnp.int32)))(cache)
  if impl == "window":  # the idle row's window is as gathered; the live row's has the new token at column 5
    np.testing.assert_array_equal(got.window_k[1][0], jnp.asarray(k_pool)[1, jnp.asarray([2, 4])].reshape(
        2 * S, CFG.n_kv_heads, CFG.head_dim).transpose(1, 2, 0))  # keys held [K, H, W]
    np.testing.assert_array_equal(got.window_k[1][1, :, :, 5], 1.0)
  want_k = np.asarray(k_pool).copy()
  want_k[1, 3, 1] = 1.0  # only the live row's position 5 = page 3, slot 1
  np.testing.assert_array_equal(got.k_LPSKH, want_k)
  np.testing.assert_array_equal(out[0], 0.0)
  ref, _ = jax.jit(lambda c: c.replace(impl="reference").attend(1, q, new, new, jnp.asarray([[-1], [5]], jnp.int32)))(
      cache)
  np.testing.assert_allclose(out[1], ref[1], atol=2e-5, rtol=0)


@pytest.mark.parametrize("impl, fold_heads, T", [("fast", False, 1), ("bucketed", False, 1), ("bucketed", True, 1),
                                                 ("pallas", False, 1), ("window", False, 1), ("reference", False, 1),
                                                 ("reference", False, 3)])
def test_a_non_finite_value_a_row_cannot_see_leaves_it_untouched(impl, fold_heads, T):
  """Stale slots past a row's position and page 0 (read for unassigned pages) hold other sequences' K/V. An inf
  or NaN there gets weight exactly 0, yet 0 * inf = NaN would poison every row reading the page: the output
  must equal, bit for bit, the one over a finite pool (decode T = 1, and prefill T = 3 through reference)."""
  S, P, L, K, H = 4, 6, CFG.n_layers, CFG.n_kv_heads, CFG.head_dim
  k_pool = jax.random.normal(jax.random.key(5), (L, P, S, K, H))
  v_pool = jax.random.normal(jax.random.key(6), (L, P, S, K, H))
  table = jnp.asarray([[2, 3, -1, -1], [4, -1, -1, -1]], jnp.int32)  # row 0 at position 6, row 1 at 2
  pos = jnp.asarray([[6], [2]], jnp.int32) + (jnp.arange(T) - (T - 1))[None, :]
  q = jax.random.normal(jax.random.key(7), (2, T, CFG.n_heads, H))
  new = jax.random.normal(jax.random.key(8), (2, T, K, H))
  opened = (lambda c: c.open_window(2, jnp.float32, pos[:, 0])) if impl == "window" else (lambda c: c)

  def read(k, v):
    cache = PagedKVCache(k_LPSKH=k, v_LPSKH=v, table_BM=table, page_size=S, impl=impl, fold_heads=fold_heads)
    return np.asarray(jax.jit(lambda c: opened(c).attend(1, q, new, new, pos)[0])(cache))

  # Row 0's slot 3 of page 3 and row 1's of page 4 are past their positions; page 0 is nobody's here.
  bad_v = v_pool.at[1, 3, 3].set(jnp.nan).at[1, 4, 3].set(jnp.inf).at[1, 0].set(-jnp.inf)
  bad_k = k_pool.at[1, 3, 3].set(jnp.inf).at[1, 0].set(jnp.nan)
  want, got = read(k_pool, v_pool), read(bad_k, bad_v)
  assert np.isfinite(want).all()
  np.testing.assert_array_equal(got, want)


def test_auto_read_on_gpu_takes_the_kernel_when_its_trial_agrees():
  """resolve_impl's GPU branch, its trial run in interpret mode: a trial that cannot call the XLA read it
  compares against (any exception there means "bucketed") would silently turn the GPU kernel off."""
  cfg = dataclasses.replace(CFG, n_heads=16, n_kv_heads=1, head_dim=16)  # shapes the GPU kernel accepts
  assert resolve_impl("auto", cfg, 16, backend="gpu") == "pallas"
  assert resolve_impl("auto", cfg, 16, backend="cpu") == "window"
  qwen_group = dataclasses.replace(cfg, n_heads=14, n_kv_heads=2)  # G = 7: query rows padded to 16
  assert resolve_impl("auto", qwen_group, 16, backend="gpu") == "pallas"
  assert resolve_impl("auto", cfg, 12, backend="gpu") == "bucketed"  # pages of 12 slots: not a power of two
  assert resolve_impl("auto", dataclasses.replace(cfg, head_dim=8), 16, backend="gpu") == "bucketed"  # H < 16


def test_the_kernel_masks_unassigned_pages_and_pages_past_the_table():
  """The Pallas kernel (interpret mode) against the XLA reads where the table has a hole below the row's position
  (-1: page 0, here inf, is read in its place) and where the position lies past the table's M pages (the clamped
  index would re-read page M - 1)."""
  S, P, H = 4, 6, CFG.head_dim
  k = jax.random.normal(jax.random.key(0), (1, P, S, 1, H))
  v = jax.random.normal(jax.random.key(1), (1, P, S, 1, H))
  q = jax.random.normal(jax.random.key(2), (1, 1, 2, H))
  new = jnp.ones((1, 1, 1, H))

  def read(impl, table, pos, v_pool):
    cache = PagedKVCache(k_LPSKH=k, v_LPSKH=v_pool, table_BM=jnp.asarray([table], jnp.int32), page_size=S, impl=impl)
    return np.asarray(cache.attend(0, q, new, new, jnp.asarray([[pos]], jnp.int32))[0])

  for table, pos in (([2, -1, 3], 9), ([2, 3], 9)):
    want = read("bucketed", table, pos, v.at[0, 0].set(jnp.inf))
    assert np.isfinite(want).all()
    np.testing.assert_allclose(read("pallas", table, pos, v.at[0, 0].set(jnp.inf)), want, atol=2e-5, rtol=0)


def test_auto_read_raises_our_bugs_and_names_why_it_falls_back(monkeypatch, caplog):
  """A trial that fails because our code is wrong (a TypeError raised outside JAX's lowering) is raised, not read as
  "no kernel on this GPU"; a lowering failure or a disagreeing kernel falls back to bucketed with a warning that
  says why."""
  cfg = dataclasses.replace(CFG, n_heads=16, n_kv_heads=1, head_dim=16)

  def fails(exc):
    def trial(*args, **kwargs):
      raise exc
    return trial

  monkeypatch.setattr(pallas_paged, "decode_attention", fails(TypeError("unexpected keyword argument")))
  with pytest.raises(TypeError, match="unexpected keyword"):
    resolve_impl("auto", cfg, 16, backend="gpu")
  # The same type raised inside JAX's Triton lowering (it asserts and raises TypeError on shapes it cannot
  # lower) is a limit of this GPU: the fallback, with the reason.
  lowering = {}
  exec(compile("def trial(*args, **kwargs):\n  raise TypeError('cannot splat a tensor')\n",
               "/site-packages/jax/_src/pallas/triton/lowering.py", "exec"), lowering)
  monkeypatch.setattr(pallas_paged, "decode_attention", lowering["trial"])
  with caplog.at_level("WARNING"):
    assert resolve_impl("auto", cfg, 16, backend="gpu") == "bucketed"
  assert "TypeError: cannot splat a tensor" in caplog.text
  caplog.clear()
  monkeypatch.setattr(pallas_paged, "decode_attention", fails(NotImplementedError("no Triton lowering for x")))
  with caplog.at_level("WARNING"):
    assert resolve_impl("auto", cfg, 16, backend="gpu") == "bucketed"
  assert "NotImplementedError: no Triton lowering for x" in caplog.text
  caplog.clear()
  monkeypatch.setattr(pallas_paged, "decode_attention", lambda q, *args, **kwargs: jnp.zeros_like(q) + 1.0)
  with caplog.at_level("WARNING"):
    assert resolve_impl("auto", cfg, 16, backend="gpu") == "bucketed"
  assert "differs from the XLA read" in caplog.text


@pytest.mark.parametrize("dtype, atol, pages_per_trip, splits", [
    (jnp.float32, 2e-5, None, None), (jnp.bfloat16, 3e-2, None, None), (jnp.float32, 2e-5, 1, None),
    (jnp.float32, 2e-5, 3, None), (jnp.float32, 2e-5, 1, 3), (jnp.bfloat16, 3e-2, 2, 2)])
def test_pallas_kernel_pads_an_odd_group_and_reads_the_pool_dtype(dtype, atol, pages_per_trip, splits):
  """Qwen2.5's grouping (14 query heads over 2 KV heads, G = 7, run as 16 padded rows), ragged rows and an
  idle one, in the pool's dtype: fp32 at full precision, bf16 operands with fp32 accumulation. Pages per
  loop trip: the default (8 here), 1, and 3 (rows of 5 table entries: the last trip runs past the table).
  Split rows: 5 trips over 3 programs (row 1's 3 trips leave its last program none), 3 trips over 2."""
  from jaxrl_topo.rollout.pallas_paged import decode_attention

  rng = np.random.default_rng(7)
  N, K, H, S, M = 14, 2, 16, 4, 5
  lengths = np.array([1, 9, 20, 0])  # 0: an idle slot (position -1)
  table = _shuffled_table(rng, -(-lengths // S), 24, M)
  k_pool = rng.normal(size=(2, 24, S, K, H)).astype(np.float32)
  v_pool = rng.normal(size=(2, 24, S, K, H)).astype(np.float32)
  q = rng.normal(size=(4, N, H)).astype(np.float32)
  cast = lambda x: jnp.asarray(x).astype(dtype)  # noqa: E731
  got = decode_attention(cast(q), cast(k_pool), cast(v_pool), jnp.asarray(table), jnp.asarray(lengths - 1, jnp.int32),
                         layer=1, page_size=S, pages_per_trip=pages_per_trip, splits=splits)
  assert got.dtype == dtype and got.shape == (4, N, H)
  exact = lambda x: np.asarray(cast(x).astype(jnp.float32), np.float64)  # noqa: E731  (the inputs the kernel saw)
  want = _numpy_attention(exact(q)[:3], exact(k_pool)[1], exact(v_pool)[1], table[:3], lengths[:3] - 1)
  np.testing.assert_allclose(np.asarray(got[:3], np.float32), want, atol=atol, rtol=0)
  np.testing.assert_array_equal(np.asarray(got[3], np.float32), 0.0)


def test_pallas_kernel_takes_the_group_unpadded():
  """The kernel loads a group's 7 query heads as 16 masked rows and stores only the 7: the program holds no pad
  of q and no slice of the output (two XLA kernels a layer on a GPU, 5.5% of the step before)."""
  from jaxrl_topo.rollout.pallas_paged import decode_attention

  q, pool = jnp.zeros((2, 14, 16)), jnp.zeros((1, 4, 4, 2, 16))
  table, pos = jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32)
  text = str(jax.make_jaxpr(functools.partial(decode_attention, layer=0, page_size=4))(q, pool, pool, table, pos))
  assert "pallas_call" in text
  assert " pad[" not in text and " slice[" not in text, text


def test_a_window_reads_bucketeds_width_whatever_its_own():
  """A decode step through open windows of 4, 8 and 16 pages (16-token pages; rows at positions 40-63, i.e. 3-4
  pages: `bucketed` reads 4) gives the same output bit for bit: the step reads the window's first 4 pages (a
  switch; the 4-page window at its own width, `window_full`, with no switch). Reading every column of the 8- and
  16-page windows instead (`window_full=True` on them), the outputs differed from the 4-page read in the last bits
  on XLA:CPU (8 rows, head_dim 64: the softmax's sum and the p.v dot over 128+ columns round otherwise)."""
  B, S, M, L, K, N, H = 8, 16, 16, 1, 2, 4, 64
  k_pool = jax.random.normal(jax.random.key(11), (L, B * M, S, K, H))
  v_pool = jax.random.normal(jax.random.key(12), (L, B * M, S, K, H))
  table = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
  pos = jax.random.randint(jax.random.key(13), (B, 1), 40, 64)
  q = jax.random.normal(jax.random.key(14), (B, 1, N, H))
  new = jax.random.normal(jax.random.key(15), (B, 1, K, H))
  cache = PagedKVCache(k_LPSKH=k_pool, v_LPSKH=v_pool, table_BM=table, page_size=S, impl="window")

  def step(n: int, full: bool):
    opened = cache.open_window(n, jnp.float32, pos[:, 0]).replace(window_full=full)
    return np.asarray(jax.jit(lambda c: c.attend(0, q, new, new, pos)[0])(opened))

  want = step(4, full=True)  # the window at its own width
  np.testing.assert_array_equal(step(4, full=False), want)
  for n in (8, 16):
    np.testing.assert_array_equal(step(n, full=False), want)
