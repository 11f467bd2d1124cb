"""The model as (graphdef, params): split once, pure functions of plain pytrees after that.

`params` is a nested dict of arrays (`nnx.to_pure_dict` layout: {"layers": {0: {...}}, ...}).
Everything downstream (train step, rollout engine, weight sync, checkpoints) sees only that dict;
`nnx.merge(graphdef, params)` happens inside the jitted function.

  graphdef, abstract = abstract_model(cfg)                     # shapes + logical names, no memory
  graphdef, params = init_params(cfg, key, mesh, TRAIN_RULES)  # born sharded (STYLE H7)
  logits_BTV, cache = forward(graphdef, params, tokens_BT, positions_BT, segment_ids_BT, cache)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.models.transformer import Transformer
from jaxrl_topo.topology.rules import ActivationSharding, Rules, named_sharding

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class AbstractParams:
  """Per-parameter shape/dtype and logical axis names, as two dicts in the params layout."""

  shapes: Params  # leaves: jax.ShapeDtypeStruct
  axes: Params  # leaves: tuple[str, ...]; map with `shapes` first so each tuple arrives whole


def nest(flat) -> Params:
  """{path tuple: leaf} pairs -> the nested params dict."""
  out: Params = {}
  for path, value in flat:
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def abstract_model(cfg: ModelConfig, sharding: ActivationSharding | None = None, remat: str | bool = "none"):
  """(graphdef, AbstractParams) without allocating anything."""
  model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), sharding, remat))
  graphdef, state = nnx.split(model, nnx.Param)
  flat = list(nnx.to_flat_state(state))
  shapes = nest([(p, jax.ShapeDtypeStruct(v.shape, v.dtype)) for p, v in flat])
  axes = nest([(p, tuple(v.get_metadata()["logical_axes"])) for p, v in flat])
  return graphdef, AbstractParams(shapes=shapes, axes=axes)


def param_shardings(abstract: AbstractParams, mesh: Mesh, rules: Rules) -> Params:
  """NamedSharding per parameter; raises naming the parameter if a sharded dim doesn't divide."""
  def one(path, sds, axes):
    return named_sharding(axes, rules, mesh, sds.shape, what=jax.tree_util.keystr(path))
  return jax.tree_util.tree_map_with_path(one, abstract.shapes, abstract.axes)


def init_params(cfg: ModelConfig, key: jax.Array, mesh: Mesh | None = None, rules: Rules | None = None, *,
                compiled: bool = True):
  """(graphdef, params) with params created already sharded on `mesh` (nothing replicated first).

  `compiled=False` (no mesh) builds them op by op instead of as one program: each random draw compiles once per
  parameter shape, shared by every layer. One program for Qwen2.5-0.5B took 48-62 s to compile on an H200; use it
  where only the shapes matter (benchmarks). Its values differ from the compiled init's in the last bits."""
  if not compiled and mesh is not None:
    raise ValueError("init_params(compiled=False) builds unsharded params; give no mesh, or compiled=True")
  sharding = ActivationSharding(mesh, rules) if mesh is not None else None
  graphdef, abstract = abstract_model(cfg, sharding)

  def init(key):
    return nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(params=key), sharding), nnx.Param))

  if not compiled:
    return graphdef, init(key)
  out_shardings = param_shardings(abstract, mesh, rules) if mesh is not None else None
  return graphdef, jax.jit(init, out_shardings=out_shardings)(key)


def forward(graphdef, params: Params, tokens_BT, positions_BT, segment_ids_BT=None, cache=None):
  """(logits_BTV float32, cache) — a pure function of arrays; call it inside your own jit. The shapes are checked
  as it traces (nothing runs): token ids [B, T], and positions (segment ids) of that shape or one that broadcasts
  to it."""
  shape = jnp.shape(tokens_BT)
  if len(shape) != 2:
    raise ValueError(f"forward: tokens must be [batch, time] token ids, got shape {shape}")
  for name, x in (("positions", positions_BT), ("segment_ids", segment_ids_BT)):
    fits = x is None or (len(jnp.shape(x)) == 2 and all(a in (1, b) for a, b in zip(jnp.shape(x), shape, strict=True)))
    if not fits:
      raise ValueError(f"forward: {name} has shape {jnp.shape(x)}, tokens {shape}: give one per token")
  return nnx.merge(graphdef, params)(tokens_BT, positions_BT, segment_ids_BT, cache)


def make_apply_fn(graphdef) -> Callable[..., jax.Array]:
  """`apply_fn(params, tokens, positions, segment_ids) -> logits`, the signature the train step takes."""
  def apply_fn(params, tokens_BT, positions_BT, segment_ids_BT):
    return forward(graphdef, params, tokens_BT, positions_BT, segment_ids_BT)[0]
  return apply_fn


def cast_params(params: Params, dtype) -> Params:
  """Every floating leaf cast to `dtype` (e.g. fp32 master weights -> bf16 rollout copy)."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

