"""Logical axis names -> mesh axes, one rule set per role (STYLE H6).

Model code names what each dimension *is* (`embed`, `heads`, ...); a rule set says where each name
lives on a mesh. A rule maps a name to a mesh axis, a tuple of mesh axes, or None (replicated).
Mesh axes a rule names but the mesh lacks are dropped, so one rule set serves `fsdp=8` and
`fsdp=4 x tensor=2` alike. A logical name with no rule at all is an error: a new parameter is
never replicated by accident (STYLE anti-pattern 4).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Trainer: FSDP shards every weight's `embed` dim; `tensor` (if the mesh has it) splits heads/mlp/vocab.
TRAIN_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
    ("cache_length", None),
)

# Rollout: weights whole on each data replica, tensor-parallel inside it; decode slots over `data`.
ROLLOUT_RULES: Rules = tuple((name, {"batch": "data", "embed": None}.get(name, axes)) for name, axes in TRAIN_RULES)

# Every mesh axis a rule set places tensors on.
MESH_AXES = ("data", "fsdp", "tensor")


def make_mesh(axes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with Auto (GSPMD) axes over `devices` (default: all), e.g. {"fsdp": 4, "tensor": 2}. Axes are named
  from MESH_AXES: no rule would place anything on another name, so every tensor would be whole on each device."""
  for name in axes:
    if name not in MESH_AXES:
      near = difflib.get_close_matches(str(name), MESH_AXES, n=1)
      raise ValueError(f"mesh axis {name!r} is none of {MESH_AXES}" + (f" (did you mean {near[0]!r}?)" if near else "")
                       + ": the sharding rules place nothing on another name, so every tensor would be replicated")
  devices = list(jax.devices() if devices is None else devices)
  size = int(np.prod(list(axes.values()))) if axes else 1
  if size != len(devices):
    raise ValueError(f"mesh axes {axes} need {size} devices, got {len(devices)}")
  grid = np.asarray(devices, dtype=object).reshape(tuple(axes.values()))
  return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def logical_to_spec(names: Sequence[str | None], rules: Rules, mesh: Mesh) -> PartitionSpec:
  """PartitionSpec for a tensor whose dims carry `names`; raises on unknown names or reuse of an axis."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name in names:
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(f"no sharding rule for logical axis {name!r}; rules cover {sorted(table)}")
    target = table[name]
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    axes = tuple(a for a in axes if a in mesh.shape and a not in used)
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


# Logical axes replicated, not refused, where their size does not divide over their mesh axes: a GQA model's few
# KV heads under a wider `tensor` axis (2 KV heads at tensor=4). Each tensor shard then computes every KV
# head (a small projection) and its query heads read theirs; other axes must divide.
REPLICATE_IF_UNEVEN = frozenset({"kv_heads"})


def fit_spec(names: Sequence[str | None], spec: PartitionSpec, mesh: Mesh, shape: Sequence[int],
             what: str | None) -> PartitionSpec:
  """`spec` with REPLICATE_IF_UNEVEN dims that do not divide replicated; another such dim raises, naming `what`
  (None: left to JAX)."""
  out = list(spec) + [None] * (len(shape) - len(spec))
  for dim, (size, axes) in enumerate(zip(shape, out, strict=True)):
    if axes is None:
      continue
    ways = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
    if size % ways:
      if names[dim] in REPLICATE_IF_UNEVEN:
        out[dim] = None
        continue
      if what is None:
        continue
      raise ValueError(f"{what}: dim {dim} ({names[dim]}={size}) does not divide over mesh axes {axes} "
                       f"({ways} ways); choose a mesh whose axis sizes divide it")
  return PartitionSpec(*out)


def named_sharding(names: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None,
                   what: str = "tensor") -> NamedSharding:
  """NamedSharding for `names`; with `shape`, checks each sharded dim divides evenly, naming `what` (KV heads
  that do not are replicated instead: REPLICATE_IF_UNEVEN)."""
  spec = logical_to_spec(names, rules, mesh)
  if shape is not None:
    spec = fit_spec(names, spec, mesh, shape, what)
  return NamedSharding(mesh, spec)


def constrain(x: jax.Array, names: Sequence[str | None], sharding: ActivationSharding | None) -> jax.Array:
  """Pins an activation's layout inside jit; identity when no sharding is configured."""
  if sharding is None:
    return x
  spec = logical_to_spec(names, sharding.rules, sharding.mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, fit_spec(names, spec, sharding.mesh,
                                                                                   x.shape, None)))


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
  """(mesh, rules) for activation constraints inside the model. Hashable: part of the static graph."""

  mesh: Mesh
  rules: Rules
