"""A supervised warm-up: teacher-forced cross-entropy on reference completions, before RL.

RL needs a policy that is sometimes right; a random-init model on a synthetic task never is. The
warm-up takes a few steps of next-token cross-entropy on (prompt, answer) pairs from the TRAINING
split, laid out with the RL batch builder (train/batch.py) so the loss reads the same gathered
response tokens the RL loss does. It runs on the trainer mesh with its own AdamW (the RL optimizer
state starts fresh afterwards) and one jit with the params donated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxrl_topo.train.batch import TrainBatch
from jaxrl_topo.train.policy import PolicyFns, sequence_logprobs


def sft_loss(params, batch: TrainBatch, *, fns: PolicyFns, chunk: int) -> jax.Array:
  """Mean negative log-likelihood of the response tokens of microbatch 0 (temperature 1)."""
  rows = (batch.tokens_MRS[0], batch.positions_MRS[0], batch.segment_ids_MRS[0])
  logp_BT, _, _ = sequence_logprobs(fns, params, rows, batch.gather_MBT[0], batch.targets_MBT[0], temperature=1.0,
                                    chunk=chunk)
  mask_BT = batch.mask_MBT[0]
  return -(logp_BT * mask_BT).sum() / jnp.maximum(mask_BT.sum(), 1.0)


def _step(params, opt_state, batch, *, fns, tx, chunk):
  loss, grads = jax.value_and_grad(functools.partial(sft_loss, fns=fns, chunk=chunk))(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def sft_optimizer(lr: float, max_grad_norm: float) -> optax.GradientTransformation:
  """The warm-up's optimizer: AdamW at `lr`, its gradients first clipped to global norm `max_grad_norm` (0: none)."""
  adam = optax.adamw(lr)
  return optax.chain(optax.clip_by_global_norm(max_grad_norm), adam) if max_grad_norm else adam


def make_sft_step(fns: PolicyFns, tx: optax.GradientTransformation, params, *, chunk: int = 1024):
  """(step(params, opt_state, batch) -> (params, opt_state, loss), opt_state): jitted, params donated;
  params and optimizer moments keep the params' shardings."""
  opt_state = jax.jit(tx.init)(params)
  sharding = jax.tree.leaves(params)[0].sharding
  if isinstance(sharding, jax.sharding.NamedSharding):  # scalars (Adam's count) replicated on the params' mesh
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    opt_state = jax.tree.map(lambda x: x if x.sharding.device_set == sharding.device_set
                             else jax.device_put(x, replicated), opt_state)
  shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
  step = jax.jit(functools.partial(_step, fns=fns, tx=tx, chunk=chunk), donate_argnums=(0, 1),
                 out_shardings=(*shardings, None))
  return step, opt_state
