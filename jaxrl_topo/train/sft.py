"""A supervised warm-up: teacher-forced cross-entropy on reference completions, before RL.

RL needs a policy that is sometimes right; a random-init model on a synthetic task never is. The
warm-up takes a few steps of next-token cross-entropy on (prompt, answer) pairs from the TRAINING
split, laid out with the RL batch builder (train/batch.py) so the loss reads the same gathered
response tokens the RL loss does. It runs on the trainer mesh with its own AdamW (the RL optimizer
state starts fresh afterwards) and one jit with the params donated; `run.sft_n_micro` splits a step's rows into
microbatches scanned one at a time (less activation memory, the same step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxrl_topo.train.batch import TrainBatch
from jaxrl_topo.train.policy import PolicyFns, sequence_logprobs


def sft_loss(params, batch: TrainBatch, *, fns: PolicyFns, chunk: int) -> jax.Array:
  """Mean negative log-likelihood of the response tokens of a one-microbatch batch (temperature 1)."""
  return _nll_sum(params, _micro(batch, 0), fns=fns, chunk=chunk) / jnp.maximum(batch.mask_MBT[0].sum(), 1.0)


def _micro(batch: TrainBatch, m) -> tuple:
  """Microbatch m's (tokens, positions, segment ids, gather, targets, mask)."""
  return (batch.tokens_MRS[m], batch.positions_MRS[m], batch.segment_ids_MRS[m], batch.gather_MBT[m],
          batch.targets_MBT[m], batch.mask_MBT[m])


def _nll_sum(params, micro: tuple, *, fns: PolicyFns, chunk: int) -> jax.Array:
  tokens, positions, segments, gather_BT, targets_BT, mask_BT = micro
  logp_BT, _, _ = sequence_logprobs(fns, params, (tokens, positions, segments), gather_BT, targets_BT,
                                    temperature=1.0, chunk=chunk)
  return -(logp_BT * mask_BT).sum()


def _loss_and_grads(params, batch: TrainBatch, *, fns, chunk):
  """The mean NLL over every response token of the batch and its gradient. Several microbatches (run.sft_n_micro)
  are scanned one at a time, each one's token sum divided by the whole batch's token count, so the step equals
  the one-microbatch step up to summation order, with one microbatch's activations alive at a time."""
  if batch.mask_MBT.shape[0] == 1:  # one microbatch: no scan (the warm-up as it always ran, bit for bit)
    return jax.value_and_grad(functools.partial(sft_loss, fns=fns, chunk=chunk))(params, batch)
  total = jnp.maximum(batch.mask_MBT.sum(), 1.0)
  one = jax.value_and_grad(lambda p, micro: _nll_sum(p, micro, fns=fns, chunk=chunk) / total)

  def add(carry, m):
    loss, grads = carry
    loss_m, grads_m = one(params, _micro(batch, m))
    return (loss + loss_m, jax.tree.map(jnp.add, grads, grads_m)), None

  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  (loss, grads), _ = jax.lax.scan(add, zeros, jnp.arange(batch.mask_MBT.shape[0]))
  return loss, grads


def _step(params, opt_state, batch, *, fns, tx, chunk):
  loss, grads = _loss_and_grads(params, batch, fns=fns, chunk=chunk)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def sft_optimizer(lr: float, max_grad_norm: float, weight_decay: float = 1e-4) -> optax.GradientTransformation:
  """The warm-up's optimizer: AdamW at `lr` (decoupled `weight_decay`, optax's default 1e-4), its gradients first
  clipped to global norm `max_grad_norm` (0: none)."""
  adam = optax.adamw(lr, weight_decay=weight_decay)
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
