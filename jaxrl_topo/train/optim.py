"""The optax chain: global-norm clipping, AdamW, warm-up + constant/cosine schedule.

Moments live in fp32 next to fp32 master params (optax keeps each moment in its param's dtype).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import optax

from jaxrl_topo.train.config import OptimConfig


def learning_rate(cfg: OptimConfig) -> optax.Schedule:
  warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps) if cfg.warmup_steps else None
  if cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(cfg.lr, cfg.total_steps - cfg.warmup_steps, alpha=cfg.final_lr_frac)
  else:
    decay = optax.constant_schedule(cfg.lr)
  return optax.join_schedules([warmup, decay], [cfg.warmup_steps]) if warmup else decay


def _matrices(params):
  """True for the parameters of 2+ dims (projections, embeddings, LoRA factors); False for norm scales and biases."""
  return jax.tree.map(lambda x: x.ndim >= 2, params)


class Optimizer(NamedTuple):
  """An optax transformation (`init`, `update`) that knows how many updates a train step makes: its schedule counts
  train steps, so `make_train_step` refuses it for a TrainConfig whose loss makes another number of them."""
  init: Callable
  update: Callable
  updates_per_step: int


def make_optimizer(cfg: OptimConfig, updates_per_step: int = 1) -> Optimizer:
  """The chain; with several optimizer updates a train step (LossConfig.updates: epochs x minibatches), the
  schedule still counts train steps (warmup_steps, total_steps): every update of a step takes that step's rate.
  Give the count the train step makes: `make_optimizer(tc.optim, tc.loss.updates)`."""
  if isinstance(updates_per_step, bool) or not isinstance(updates_per_step, numbers.Integral) or updates_per_step < 1:
    raise ValueError(f"updates_per_step={updates_per_step!r} must be an int >= 1 (LossConfig.updates)")
  updates_per_step = int(updates_per_step)  # (a NumPy integer, as LossConfig takes)
  clip = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm else []
  per_step = learning_rate(cfg)

  def per_update(count):
    return per_step(count // updates_per_step)

  adam = optax.adamw(per_step if updates_per_step == 1 else per_update, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                     weight_decay=cfg.weight_decay, mask=_matrices if cfg.weight_decay_mask == "matrices" else None)
  chain = optax.chain(*clip, adam)
  return Optimizer(chain.init, chain.update, updates_per_step)
