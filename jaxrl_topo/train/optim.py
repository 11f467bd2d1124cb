"""The optax chain: global-norm clipping, AdamW, warm-up + constant/cosine schedule.

Moments live in fp32 next to fp32 master params (optax keeps each moment in its param's dtype).
"""

from __future__ import annotations

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


def make_optimizer(cfg: OptimConfig, updates_per_step: int = 1) -> optax.GradientTransformation:
  """The chain; with several optimizer updates a train step (rl.epochs x rl.minibatches), the schedule still
  counts train steps (warmup_steps, total_steps): every update of a step takes that step's rate."""
  clip = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm else []
  per_step = learning_rate(cfg)

  def per_update(count):
    return per_step(count // updates_per_step)

  adam = optax.adamw(per_step if updates_per_step == 1 else per_update, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                     weight_decay=cfg.weight_decay, mask=_matrices if cfg.weight_decay_mask == "matrices" else None)
  return optax.chain(*clip, adam)
