"""Mixed precision and rematerialisation in the train step: what changes and what must not."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import train_fixtures as fx

from jaxrl_topo.models.model import abstract_model, init_params
from jaxrl_topo.train.batch import build_batch
from jaxrl_topo.train.config import LossConfig, OptimConfig, TrainConfig
from jaxrl_topo.train.optim import make_optimizer
from jaxrl_topo.train.policy import model_fns
from jaxrl_topo.train.state import create_train_state
from jaxrl_topo.train.step import train_step

CFG = TrainConfig(loss=LossConfig(group_size=4), optim=OptimConfig(lr=1e-3))


def _batch():
  comps = fx.ragged_completions(8, fx.TINY.vocab_size, seed=3)
  return build_batch(comps, n_micro=2, rows=4, row_len=12, resp_len=6, pack=False)


def _step(model_cfg, remat: bool, tx):
  graphdef, _ = abstract_model(model_cfg, remat=remat)
  _, params = init_params(model_cfg, jax.random.key(0))
  state = create_train_state(params, CFG, tx)
  fn = jax.jit(lambda s, b: train_step(s, b, fns=model_fns(graphdef), cfg=CFG, tx=tx))
  return fn, state


def test_remat_changes_nothing_but_the_program():
  """Per-block remat: the jaxpr holds a checkpoint per block, and gradients equal the plain step's."""
  batch = _batch()
  plain_fn, plain_state = _step(fx.TINY, False, fx.GRAD_TX)
  remat_fn, remat_state = _step(fx.TINY, True, fx.GRAD_TX)
  jaxpr = str(jax.make_jaxpr(remat_fn)(remat_state, batch))
  n_remat = jaxpr.count("remat") + jaxpr.count("checkpoint")
  assert n_remat >= fx.TINY.n_layers, f"expected a checkpoint per block, found {n_remat}: remat is not applied"
  assert str(jax.make_jaxpr(plain_fn)(plain_state, batch)).count("remat") < n_remat
  _, want = plain_fn(plain_state, batch)
  new_remat, got = remat_fn(remat_state, batch)
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
  np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-5)


def test_bf16_compute_keeps_fp32_master_weights_and_moments():
  """dtype=bfloat16 computes in bf16 (the loss moves) while params and Adam moments stay fp32."""
  tx = make_optimizer(CFG.optim)
  batch = _batch()
  fp32_fn, fp32_state = _step(fx.TINY, False, tx)
  bf16_fn, bf16_state = _step(dataclasses.replace(fx.TINY, dtype="bfloat16"), False, tx)
  _, want = fp32_fn(fp32_state, batch)
  new_state, got = bf16_fn(bf16_state, batch)
  assert got["step_ok"] == 1.0
  dtypes = {x.dtype for x in jax.tree.leaves((new_state.params, new_state.opt_state)) if x.ndim > 0}
  assert dtypes == {jnp.dtype(jnp.float32)}, f"master weights / moments must stay fp32, got {dtypes}"
  # bf16 rounding (2^-9 relative per op) moves the gradient by ~1e-3 relative; fp32 runs agree to ~1e-6.
  rel = abs(float(got["grad_norm"]) / float(want["grad_norm"]) - 1)
  assert 1e-5 < rel < 0.05, f"bf16 vs fp32 grad norm differ by {rel:.2e} (relative): bf16 not used, or broken"
