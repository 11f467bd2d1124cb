"""LoRA on our model's projections: W_eff = W + (alpha / r) * A @ B, base W frozen.

Adapters are a separate small pytree keyed like the params (`layers.i.self_attn.q_proj`), so
the base weights stay the reference policy: no second copy is ever made. The delta is merged into
the kernel inside the step (one transient kernel-sized buffer per projection); B starts at zero,
so before the first update the adapted policy *is* the base policy.
Kernels are [in..., out...]: q/k/v [D | N, H], o_proj [N, H | D], mlp [D | F] / [F | D].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl_topo.train.config import LoraConfig


def _n_in_dims(owner: str) -> int:
  return 2 if owner == "o_proj" else 1


def _targets(params, cfg: LoraConfig):
  """(path, kernel) for every kernel whose projection name is in cfg.targets."""
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    if keys[-1] == "kernel" and len(keys) > 1 and keys[-2] in cfg.targets:
      out.append((tuple(keys[:-1]), leaf))
  if not out:
    raise ValueError(f"LoRA targets {cfg.targets} match no kernel in the params")
  return out


def init_lora(params, cfg: LoraConfig, key: jax.Array) -> dict:
  """{"layers.0.self_attn.q_proj": {"a": [in, r], "b": [r, out]}, ...}; a ~ N(0, 1/in), b = 0."""
  adapters = {}
  for i, (path, kernel) in enumerate(_targets(params, cfg)):
    k = _n_in_dims(path[-1])
    d_in, d_out = math.prod(kernel.shape[:k]), math.prod(kernel.shape[k:])
    a = jax.random.normal(jax.random.fold_in(key, i), (d_in, cfg.rank), jnp.float32) / math.sqrt(d_in)
    adapters[".".join(map(str, path))] = {"a": a, "b": jnp.zeros((cfg.rank, d_out), jnp.float32)}
  return adapters


def merge_lora(params, adapters: dict, cfg: LoraConfig):
  """The params with every adapted kernel replaced by W + (alpha/r) A B (in W's dtype)."""
  def one(path, leaf):
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    name = ".".join(map(str, keys[:-1]))
    if keys[-1] != "kernel" or name not in adapters:
      return leaf
    ad = adapters[name]
    delta = (ad["a"] @ ad["b"]).reshape(leaf.shape) * (cfg.alpha / cfg.rank)
    return (leaf.astype(jnp.float32) + delta).astype(leaf.dtype)
  return jax.tree_util.tree_map_with_path(one, params)
