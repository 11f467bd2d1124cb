"""Decode attention over the paged pool as one Pallas kernel: pages are read in place, no gather copy.

Grid (B rows, K KV heads). Program (b, k) walks row b's pages 0 .. pos_b // S through the page table
(C = `pages_per_trip` pages of S keys per trip, each read straight out of the [L, P, S, K, H] pool at
(layer, page, :, k, :)),
keeping an online (flash-style) fp32 softmax for the G = N / K query heads that share KV head k.
A row with pos < 0 (an idle slot) makes no trips and returns zeros. Keys past pos are masked.
Alphabet as in paged.py: L layers, P pages, S slots per page, K KV heads, G query heads per KV head,
H head dim, B rows, M pages per row.

On GPU (Triton lowering) the block dims must be powers of two and large enough for `tl.dot` (>= 16).
A group's query heads load as Gp = max(16, next power of two of G) rows, the rows past G masked to zero on
load and left out of the store (Qwen2.5's G = 7 runs as 16 rows; decode attention is bound by reading K/V, not
by these rows' FLOPs); S and H must be powers of two >= 16 themselves, which `supported` checks, the engine falling
back to the XLA path otherwise. As in the XLA reads, q.k runs in the query's dtype (K cast to it) and p.v in
the pool's (p cast to it), with fp32 accumulation; fp32 operands at full precision, never tf32, so fp32
log-probs stay within 1e-5 of the trainer's. On CPU the kernel runs in Pallas interpret mode, which is how
tests check it against the reference read.
"""

from __future__ import annotations

import functools
import logging
import traceback

import jax
import jax.numpy as jnp

try:
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover  (an install without Pallas: "auto" picks the XLA read)
  pl = plgpu = None

_MASKED = -1e30
# Keys one loop trip reads x head dim, and Triton warps per program. 4 pages of 16 slots at head_dim 64
# (Qwen2.5-0.5B) with 2 warps decoded fastest on an H200 (benchmarks/RESULTS.md: the engine's batch-256 step 2.64 ms
# against 2.75 ms at 4 pages with Pallas' default 4 warps and 2.96 ms at 8 pages; dense 3.4 ms). An H100 had
# favoured 8 pages in a one-layer read with the earlier kernel (192 / 204 / 254 / 316 µs for 8 / 4 / 2 / 1).
# Larger pages or heads take fewer pages per trip, so a trip's K and V blocks (which live in registers) stay that
# size; that scaling is a rule, not a measurement.
TRIP_ELEMENTS = 4 * 16 * 64
NUM_WARPS = 2
# Programs a row's trips are divided over (decode_attention's `splits`); 1 = one program walks the whole row. At
# batch 256 on an H200, 2 and 3 splits were slower (engine step 2.67 / 2.70 ms against 2.60: the 512 programs
# already fill the GPU, and the merge costs); few rows with long contexts are where splits should pay (unmeasured).
SPLITS = 1


def supported(cfg, page_size: int, backend: str | None = None) -> bool:
  """Shapes the GPU kernel accepts (interpret mode accepts all)."""
  backend = backend or jax.default_backend()
  if pl is None:
    return False
  if backend != "gpu":
    return True
  pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
  return pow2(page_size) and pow2(cfg.head_dim)


def default_pages_per_trip(page_size: int, head_dim: int) -> int:
  """Pages one loop trip reads when the caller names none: TRIP_ELEMENTS keys x head dim, 1 to 8 pages."""
  return max(1, min(8, TRIP_ELEMENTS // (page_size * head_dim)))


def padded_group(G: int) -> int:
  """Query rows per program: G padded to a power of two >= 16 (the smallest `tl.dot` operand)."""
  return max(16, 1 << (G - 1).bit_length())


def _kernel(table_ref, pos_ref, q_ref, k_ref, v_ref, *out_refs, layer: int, page_size: int, pages_per_trip: int,
            splits: int):
  b, kh = pl.program_id(0), pl.program_id(1)
  S, C, M = page_size, pages_per_trip, table_ref.shape[1]
  pos = pos_ref[b]
  # The group's G query heads load as Gp rows, the rows past G masked to zero (and never stored): padding in
  # registers, where a pad and a slice of q and out in HBM cost two small XLA kernels a layer (5.5% of a GPU step).
  G, H = q_ref.shape[2], q_ref.shape[3]
  Gp = padded_group(G)
  rows = jnp.arange(Gp) < G
  q_GH = plgpu.load(q_ref.at[b, kh, pl.ds(0, Gp), :], mask=rows[:, None],
                     other=jnp.zeros((), q_ref.dtype))
  n_trips = jnp.where(pos >= 0, (pos // S) // C + 1, 0)
  # split s of `splits` walks trips [s * per, (s + 1) * per) of the row's (at most ceil(M / C)); past n_trips, none
  max_trips = -(-M // C)
  per = -(-max_trips // splits)
  lo = 0 if splits == 1 else pl.program_id(2) * per
  hi = n_trips if splits == 1 else jnp.minimum(n_trips, lo + per)

  def trip(j, carry):
    # C pages per trip, unrolled: their table entries and K/V loads are independent, so the GPU has C pages'
    # loads in flight at once instead of one (a trip is two dependent memory round trips: table, then page).
    m_G, l_G, acc_GH = carry
    ids = [table_ref[b, jnp.minimum(j * C + c, M - 1)] for c in range(C)]
    k_SH = [k_ref[layer, jnp.maximum(page, 0), :, kh, :] for page in ids]
    v_SH = [v_ref[layer, jnp.maximum(page, 0), :, kh, :] for page in ids]
    # masks slots past pos, pages past M (the clamped index re-reads page M - 1) and unassigned pages (page 0 read)
    keep_S = [((j * C + c) * S + jnp.arange(S) <= pos) & (j * C + c < M) & (page >= 0)
              for c, page in enumerate(ids)]
    s_GS = [jnp.where(keep[None, :], _dot(q_GH, k.astype(q_GH.dtype).T) * H**-0.5, _MASKED)
            for k, keep in zip(k_SH, keep_S, strict=True)]
    m_new_G = functools.reduce(jnp.maximum, [s.max(axis=1) for s in s_GS], m_G)
    p_GS = [jnp.where(keep[None, :], jnp.exp(s - m_new_G[:, None]), 0.0) for s, keep in zip(s_GS, keep_S, strict=True)]
    scale_G = jnp.exp(m_G - m_new_G)
    l_new_G = l_G * scale_G + sum(p.sum(axis=1) for p in p_GS)
    # masked values zeroed as well: a stale or unassigned page's non-finite value would make 0 * inf = NaN
    v_SH = [jnp.where(keep[:, None], v, jnp.zeros((), v.dtype)) for v, keep in zip(v_SH, keep_S, strict=True)]
    acc_GH = acc_GH * scale_G[:, None] + sum(_dot(p.astype(v.dtype), v) for p, v in zip(p_GS, v_SH, strict=True))
    return m_new_G, l_new_G, acc_GH

  init = (jnp.full((Gp,), _MASKED, jnp.float32), jnp.zeros((Gp,), jnp.float32), jnp.zeros((Gp, H), jnp.float32))
  m_G, l_G, acc_GH = jax.lax.fori_loop(lo, hi, trip, init)
  if splits == 1:
    out_GH = (acc_GH / jnp.where(l_G > 0, l_G, 1.0)[:, None]).astype(out_refs[0].dtype)
    plgpu.store(out_refs[0].at[b, kh, pl.ds(0, Gp), :], out_GH, mask=rows[:, None])
  else:  # this split's running max, sum and unnormalised values, merged across splits by `_merge_splits`
    m_ref, l_ref, acc_ref = out_refs
    s = pl.program_id(2)
    plgpu.store(m_ref.at[b, kh, s, pl.ds(0, Gp)], m_G, mask=rows)
    plgpu.store(l_ref.at[b, kh, s, pl.ds(0, Gp)], l_G, mask=rows)
    plgpu.store(acc_ref.at[b, kh, s, pl.ds(0, Gp), :], acc_GH, mask=rows[:, None])


def _merge_splits(m_BKsG, l_BKsG, acc_BKsGH):
  """The splits' partial softmaxes as one (flash-decoding's merge): out_BKGH, fp32. A split that made no trips
  holds m = _MASKED, l = 0, acc = 0 and weighs exp(_MASKED - max) = 0; an idle row's every split does, giving 0."""
  m_BK1G = m_BKsG.max(axis=2, keepdims=True)
  w_BKsG = jnp.exp(m_BKsG - m_BK1G)
  l_BKG = (w_BKsG * l_BKsG).sum(axis=2)
  acc_BKGH = (w_BKsG[..., None] * acc_BKsGH).sum(axis=2)
  return acc_BKGH / jnp.where(l_BKG > 0, l_BKG, 1.0)[..., None]


def _dot(a, b):
  """a @ b with fp32 accumulation; fp32 operands at full precision (no tf32)."""
  return jnp.dot(a, b, preferred_element_type=jnp.float32,
                 precision=jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None)


@functools.partial(jax.jit, static_argnames=("layer", "page_size", "interpret", "pages_per_trip", "num_warps",
                                             "splits"))
def decode_attention(q_BNH, k_LPSKH, v_LPSKH, table_BM, pos_B, *, layer: int, page_size: int,
                     interpret: bool | None = None, pages_per_trip: int | None = None, num_warps: int | None = None,
                     splits: int | None = None):
  """out_BNH: each row's query attending over its positions 0..pos_B (pos_B < 0: zeros). pages_per_trip and
  num_warps (Triton's warps per program) default to the measured best above; benchmarks/pallas_check.py sweeps
  both. `splits` > 1 divides each row's trips over that many programs (grid (B, K, splits)), merged afterwards
  in XLA: more programs in flight, each with fewer dependent trips (flash-decoding)."""
  B, N, H = q_BNH.shape
  K = k_LPSKH.shape[3]
  pages_per_trip = pages_per_trip or default_pages_per_trip(page_size, H)
  num_warps = num_warps or NUM_WARPS
  splits = max(1, min(splits or SPLITS, -(-table_BM.shape[1] // pages_per_trip)))  # no more splits than trips
  interpret = jax.default_backend() != "gpu" if interpret is None else interpret
  G = N // K
  q_BKGH = q_BNH.reshape(B, K, G, H)  # query head n = k * G + g (GQA's grouping)
  grid = (B, K) if splits == 1 else (B, K, splits)
  whole = lambda x: pl.BlockSpec(x.shape, lambda *ids: (0,) * len(x.shape))  # noqa: E731
  if splits == 1:
    out_shape = jax.ShapeDtypeStruct(q_BKGH.shape, q_BNH.dtype)
  else:
    out_shape = (jax.ShapeDtypeStruct((B, K, splits, G), jnp.float32),) * 2 + (
        jax.ShapeDtypeStruct((B, K, splits, G, H), jnp.float32),)
  out = pl.pallas_call(
      functools.partial(_kernel, layer=layer, page_size=page_size, pages_per_trip=pages_per_trip, splits=splits),
      out_shape=out_shape,
      grid=grid,
      in_specs=[whole(table_BM), whole(pos_B), whole(q_BKGH), whole(k_LPSKH), whole(v_LPSKH)],
      out_specs=whole(out_shape) if splits == 1 else tuple(whole(o) for o in out_shape),
      interpret=interpret,
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps),
  )(table_BM, pos_B, q_BKGH, k_LPSKH, v_LPSKH)
  out_BKGH = out if splits == 1 else _merge_splits(*out).astype(q_BNH.dtype)
  return out_BKGH.reshape(B, N, H)


# Errors in the trial that mean our own code is wrong (a bad call, a missing name): raised, never read as
# "this GPU cannot run the kernel", which once turned the kernel off on every GPU without a word. JAX's Pallas
# lowering raises some of these types too (an assert, "cannot splat a tensor"), so where one was raised counts.
_CODE_ERRORS = (TypeError, AttributeError, NameError, KeyError, IndexError, AssertionError)
_LOWERING_CODE = ("/jax/_src/pallas/", "/jax/experimental/pallas/", "/jax/_src/interpreters/mlir", "/triton/",
                  "/jaxlib/")


def _our_bug(e: Exception) -> bool:
  """A code error raised outside JAX's Pallas / Triton lowering (where a GPU limitation would surface)."""
  if not isinstance(e, _CODE_ERRORS):
    return False
  frames = traceback.extract_tb(e.__traceback__)
  where = frames[-1].filename.replace("\\", "/") if frames else ""
  return not any(part in where for part in _LOWERING_CODE)


def resolve_impl(impl: str, cfg, page_size: int, backend: str | None = None) -> str:
  """EngineConfig.impl "auto": "window" on CPU (paged.py); on GPU the Pallas kernel when it imports, its shape
  limits allow and a one-row trial compiles and agrees with the XLA read; else "bucketed" (XLA), with a warning
  saying why when the trial failed or disagreed. `backend` (default: JAX's) lets a CPU test take the GPU branch, the
  trial then running in interpret mode."""
  if impl != "auto":
    return impl
  backend = backend or jax.default_backend()
  if backend == "cpu":
    return "window"
  if backend != "gpu" or not supported(cfg, page_size, backend):
    return "bucketed"
  try:
    from jaxrl_topo.rollout.paged import _decode_bucketed

    L, K, N, H = 1, cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
    k = jax.random.normal(jax.random.key(0), (L, 2, page_size, K, H), jnp.dtype(cfg.dtype))
    q = jax.random.normal(jax.random.key(1), (1, N, H), jnp.dtype(cfg.dtype))
    table, pos = jnp.asarray([[1, 0]], jnp.int32), jnp.asarray([page_size + 1], jnp.int32)
    got = decode_attention(q, k, -k, table, pos, layer=0, page_size=page_size)
    want = _decode_bucketed(q, k, -k, 0, table, pos, page_size, fold_heads=False)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
  except Exception as e:  # noqa: BLE001  (a lowering or compile failure means: not on this GPU)
    if _our_bug(e):
      raise
    logging.warning("rollout: the Pallas decode kernel failed its trial on this %s (%s: %s); decode reads "
                    "through XLA (bucketed)", backend, type(e).__name__, e)
    return "bucketed"
  if not err <= 2e-2:
    logging.warning("rollout: the Pallas decode kernel's trial differs from the XLA read by %.3g (> 2e-2); "
                    "decode reads through XLA (bucketed)", err)
    return "bucketed"
  return "pallas"
