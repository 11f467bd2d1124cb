"""TrainState and its sharded creation.

`params` is what the optimizer trains, as a dict:
  {"policy": full params | LoRA adapters, "value_head": [D] (critic="shared"),
   "critic": {"backbone": params, "value_head": [D]} (critic="separate")}
`frozen` holds the LoRA base weights, which are also the reference policy (no second copy);
`ref` holds a reference copy only for full fine-tuning with a KL term.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_topo.train.config import TrainConfig
from jaxrl_topo.train.lora import init_lora

_LORA_TAG = 1  # fold_in tag of the LoRA initialisation key


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: steps taken (rejected ones included)
  params: Any
  opt_state: Any
  frozen: Any = None
  ref: Any = None
  rejected: jax.Array | None = None  # int32 scalar: steps whose loss or gradient was not finite


def _trainable(policy_params, cfg: TrainConfig, d_model: int | None, key):
  lc = cfg.loss
  trainable = {"policy": init_lora(policy_params, cfg.lora, key) if cfg.lora.enabled else policy_params}
  if lc.critic != "none" and d_model is None:
    raise ValueError("a critic needs d_model (the value head reads the hidden states)")
  if lc.critic == "shared":
    trainable["value_head"] = jnp.zeros((d_model,), jnp.float32)
  elif lc.critic == "separate":
    trainable["critic"] = {"backbone": policy_params, "value_head": jnp.zeros((d_model,), jnp.float32)}
  return trainable


def _init(policy_params, key, *, cfg: TrainConfig, tx, d_model):
  trainable = _trainable(policy_params, cfg, d_model, key)
  frozen = policy_params if cfg.lora.enabled else None
  ref = policy_params if cfg.loss.needs_ref and not cfg.lora.enabled else None
  return TrainState(step=jnp.zeros((), jnp.int32), params=trainable, opt_state=tx.init(trainable),
                    frozen=frozen, ref=ref, rejected=jnp.zeros((), jnp.int32))


def _mesh_of(tree) -> jax.sharding.Mesh | None:
  for leaf in jax.tree.leaves(tree):
    if isinstance(getattr(leaf, "sharding", None), NamedSharding):
      return leaf.sharding.mesh
  return None


def state_shardings(abstract: TrainState, policy_shardings, tx, mesh, *, lora: bool) -> TrainState:
  """Policy-shaped leaves follow the policy params' shardings; small leaves are replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())
  params = {k: jax.tree.map(lambda _: replicated, v) for k, v in abstract.params.items()}  # adapters, heads
  if not lora:
    params["policy"] = policy_shardings
  if "critic" in params:
    params["critic"]["backbone"] = policy_shardings
  def like_policy(tree):
    return None if tree is None else policy_shardings
  opt = optax.tree_map_params(tx, lambda _, s: s, abstract.opt_state, params,
                              transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=params, opt_state=opt, frozen=like_policy(abstract.frozen),
                    ref=like_policy(abstract.ref), rejected=replicated)


def abstract_train_state(policy, cfg: TrainConfig, tx: optax.GradientTransformation, *,
                         d_model: int | None = None) -> TrainState:
  """The state create_train_state would build from `policy` (arrays or ShapeDtypeStructs with NamedShardings),
  as ShapeDtypeStructs carrying their shardings: for ahead-of-time compilation, nothing allocated."""
  key = jax.random.fold_in(jax.random.key(cfg.seed), _LORA_TAG)
  abstract = jax.eval_shape(jax.tree_util.Partial(_init, cfg=cfg, tx=tx, d_model=d_model), policy, key)
  shardings = state_shardings(abstract, jax.tree.map(lambda x: x.sharding, policy), tx, _mesh_of(policy),
                              lora=cfg.lora.enabled)
  return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, shardings)


def create_train_state(policy_params, cfg: TrainConfig, tx: optax.GradientTransformation, *,
                       d_model: int | None = None) -> TrainState:
  """Builds the state with jit(out_shardings=...) mirroring `policy_params`' own shardings, so nothing
  is materialised replicated. `policy_params` is donated (reused for the copy the state keeps)."""
  key = jax.random.fold_in(jax.random.key(cfg.seed), _LORA_TAG)
  init = jax.tree_util.Partial(_init, cfg=cfg, tx=tx, d_model=d_model)
  mesh = _mesh_of(policy_params)
  out_shardings: Any = None
  if mesh is not None:
    abstract = jax.eval_shape(init, policy_params, key)
    out_shardings = state_shardings(abstract, jax.tree.map(lambda x: x.sharding, policy_params), tx, mesh,
                                    lora=cfg.lora.enabled)
  return jax.jit(init, out_shardings=out_shardings, donate_argnums=0)(policy_params, key)

