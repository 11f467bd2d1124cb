"""Bytes moved per RL step, predicted from a run's config: the analytical twin of TransferPlan's accounting.

Every figure comes from the model code's own parameter shapes and logical axes (`abstract_model`, nothing
allocated) and the run's topology and rule sets, so it works for clusters and models far too big to build.
Bytes are exact integers; 1 GB = 1e9 bytes. What moves in one step, and the model used for each:

  weight sync      trainer -> rollout, once per step.
                     full  = n_params x itemsize(dtype)
                     delta = changed_frac x full (TransferPlan sends whole changed buckets: changed_frac is the
                             expected fraction of bucket bytes that changed, not of values)
                     lora  = adapter params x itemsize, adapters = sum over targeted kernels of r x (d_in + d_out),
                             d_in/d_out from the real kernel shapes (o_proj: d_in = N*H); the engine keeps them fp32.
                   `sync_plan_bytes` reproduces TransferPlan's full-sync accounting exactly: per rollout device the
                   bytes of its shards in the ROLLOUT_RULES layout; a colocated leaf whose dtype and device layout
                   are unchanged is aliased (zero-copy) and costs 0. `lora_sync_plan_bytes` likewise: the
                   adapters are replicated fp32 on both meshes, so colocated (one device list) they alias: 0 a step.
  rollout payload  rollout -> host -> trainer: the trainer batch (one sequence per row, padded to P + C tokens, as
                   the loop lays it out), with its on-policy token mask and per-sequence rewards. An upper bound: every
                   prompt and completion at its length limit.
  collectives      per trainer rank per step, ring algorithms (a rank sends what it receives):
                     all-gather of a W-byte tensor over N ranks    (N-1)/N x W    (each rank lacks N-1 shards)
                     reduce-scatter of W bytes                     (N-1)/N x W
                     all-reduce (reduce-scatter + all-gather)      2 (N-1)/N x W
                   fsdp (TRAIN_RULES): per microbatch, every fsdp-sharded weight is all-gathered twice (forward, and
                   again for the backward as ZeRO-3 does: an upper bound if XLA keeps the forward copy alive), its
                   gradient reduce-scattered over fsdp and the shard all-reduced over `data`; weights not sharded
                   over fsdp (q/k norms) all-reduce their gradients over the data x fsdp batch ranks. W is the
                   rank's tensor-parallel slice. allreduce: plain data parallelism, 2 (R-1)/R x G over R = data x
                   fsdp ranks, nothing gathered. LoRA: the frozen base is still gathered; only adapter gradients
                   (replicated) are all-reduced. Reference (kl_coef > 0): one more forward gather per microbatch.
                   Critic: separate = a second backbone (its gathers and gradient reductions) plus its old-values
                   forward; shared = the policy forward for old values (one gather) and the [D] head's all-reduce.
Not modelled: tensor-parallel activation collectives (trainer and decode), optimizer state (it never moves),
dynamic-sampling extra rounds, checkpoints. Collectives are assumed to run inside the microbatch scan (GSPMD does
not hoist them), so they scale with run.n_micro.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.models.model import abstract_model
from jaxrl_topo.topology.carve import TopologyConfig
from jaxrl_topo.topology.rules import ROLLOUT_RULES, TRAIN_RULES, Rules, fit_spec, logical_to_spec
from jaxrl_topo.train.config import CRITICS, LoraConfig
from jaxrl_topo.train.lora import _n_in_dims  # one source of truth for how adapters split a kernel

SYNC_MODES = ("full", "delta", "lora")
SCHEMES = ("fsdp", "allreduce")


# ---------------------------------------------------------------- parameter leaves and shards


@dataclasses.dataclass(frozen=True)
class Leaf:
  path: tuple  # e.g. ("layers", 0, "mlp", "up_proj", "kernel")
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]  # logical axis names, one per dim

  @property
  def size(self) -> int:
    return math.prod(self.shape)


@functools.lru_cache(maxsize=16)
def param_leaves(cfg: ModelConfig) -> tuple[Leaf, ...]:
  """Every parameter's shape and logical axes, read from the model code (nothing allocated)."""
  _, abstract = abstract_model(cfg)
  out = []
  key = lambda k: getattr(k, "key", getattr(k, "idx", k))
  jax.tree_util.tree_map_with_path(
      lambda path, sds, axes: out.append(Leaf(tuple(map(key, path)), tuple(sds.shape), tuple(axes))),
      abstract.shapes, abstract.axes)  # `shapes` first: each axes tuple arrives whole
  return tuple(out)


def as_dtype(dtype: Any) -> jnp.dtype:
  """A dtype name ("bfloat16") or object as a dtype; unknown names raise ValueError."""
  try:
    return jnp.dtype(dtype)
  except TypeError:
    raise ValueError(f"unknown dtype {dtype!r}") from None


def itemsize(dtype: Any) -> int:
  return as_dtype(dtype).itemsize


def _check_axes(axes: Mapping[str, int], what: str) -> dict[str, int]:
  axes = dict(axes)
  for name, size in axes.items():
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
      raise ValueError(f"{what}: axis {name!r} has size {size!r}; sizes must be positive ints")
  return axes


def _names(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(leaf: Leaf, rules: Rules, axes: dict[str, int]) -> tuple:
  """The leaf's PartitionSpec entries as the engine places it: KV heads fewer than their axis replicated."""
  # logical_to_spec and fit_spec read only `mesh.shape`, so any cluster size works without devices.
  mesh = types.SimpleNamespace(shape=axes)
  return tuple(fit_spec(leaf.axes, logical_to_spec(leaf.axes, rules, mesh), mesh, leaf.shape, None))


def shard_shape(leaf: Leaf, rules: Rules, axes: dict[str, int]) -> tuple[int, ...]:
  """The per-device shape of `leaf` on a mesh of `axes`; raises, like the engine would, if a dim doesn't divide
  (KV heads fewer than their axis are replicated, as topology/rules.py places them)."""
  out = []
  for dim, (size, entry) in enumerate(zip(leaf.shape, _spec(leaf, rules, axes), strict=True)):
    ways = math.prod(axes[a] for a in _names(entry))
    if size % ways:
      raise ValueError(f"{'.'.join(map(str, leaf.path))}: dim {dim} ({leaf.axes[dim]}={size}) does not divide over "
                       f"mesh axes {entry} ({ways} ways) of mesh {axes}")
    out.append(size // ways)
  return tuple(out)


def per_device_shard_bytes(model_cfg: ModelConfig, axes: Mapping[str, int], rules: Rules, dtype: Any) -> int:
  """Parameter bytes each device holds on a mesh of `axes` under `rules` (all devices hold the same: even splits)."""
  axes = _check_axes(axes, "per_device_shard_bytes")
  return sum(math.prod(shard_shape(leaf, rules, axes)) for leaf in param_leaves(model_cfg)) * itemsize(dtype)


# ---------------------------------------------------------------- weight sync


def lora_adapter_params(model_cfg: ModelConfig, rank: int, targets: Sequence[str]) -> int:
  """sum over targeted kernels of rank x (d_in + d_out), as train/lora.py's init_lora shapes them."""
  if not isinstance(rank, int) or rank <= 0:
    raise ValueError(f"lora rank={rank!r} must be a positive int")
  kernels = [leaf for leaf in param_leaves(model_cfg)
             if leaf.path[-1] == "kernel" and len(leaf.path) > 1 and leaf.path[-2] in targets]
  if not kernels:
    raise ValueError(f"LoRA targets {tuple(targets)} match no kernel of the model")
  k = lambda leaf: _n_in_dims(leaf.path[-2])
  return sum(rank * (math.prod(leaf.shape[:k(leaf)]) + math.prod(leaf.shape[k(leaf):])) for leaf in kernels)


def sync_bytes(n_params: float, *, dtype: Any = "bfloat16", mode: str = "full", changed_frac: float | None = None,
               n_adapter_params: float | None = None) -> float:
  """The sync formulas on counts: full = n x itemsize; delta = changed_frac x full; lora = adapters x itemsize."""
  if mode not in SYNC_MODES:
    raise ValueError(f"sync mode={mode!r}; expected one of {SYNC_MODES}")
  if mode == "lora":
    if n_adapter_params is None:
      raise ValueError("mode='lora' needs the adapter parameter count")
    return n_adapter_params * itemsize(dtype)
  full = n_params * itemsize(dtype)
  return full if mode == "full" else check_frac(changed_frac) * full


def check_frac(changed_frac: float | None) -> float:
  if changed_frac is None or not 0.0 <= changed_frac <= 1.0:
    raise ValueError(f"mode='delta' needs changed_frac in [0, 1], got {changed_frac!r}")
  return changed_frac


def weight_sync_bytes(model_cfg: ModelConfig, *, dtype: Any = "bfloat16", mode: str = "full",
                      changed_frac: float | None = None, lora_rank: int | None = None,
                      lora_targets: Sequence[str] | None = None) -> int:
  """Total bytes per sync of `model_cfg` (every leaf once; see `sync_plan_bytes` for aliasing and per device)."""
  n_adapter = None
  if mode == "lora":
    targets = LoraConfig().targets if lora_targets is None else tuple(lora_targets)
    n_adapter = lora_adapter_params(model_cfg, lora_rank, targets)
  n = sum(leaf.size for leaf in param_leaves(model_cfg))
  return round(sync_bytes(n, dtype=dtype, mode=mode, changed_frac=changed_frac, n_adapter_params=n_adapter))


def lora_sync_plan_bytes(model_cfg: ModelConfig, topology: TopologyConfig, lora_rank: int,
                         lora_targets: Sequence[str] | None = None) -> int:
  """TransferPlan's bytes_total for a sync.mode=lora sync (runtime/sync.py): the fp32 adapters, replicated on the
  trainer (train/state.py) and sent replicated to the rollout mesh. Colocated, carve() builds both meshes over
  one device list, so every adapter is aliased (same sharding and dtype) and nothing moves."""
  if topology.colocated:
    return 0
  return weight_sync_bytes(model_cfg, dtype="float32", mode="lora", lora_rank=lora_rank, lora_targets=lora_targets)


def _layout(leaf: Leaf, rules: Rules, axes: dict[str, int]) -> tuple:
  """Per dim, the (size, stride) of each mesh axis splitting it: equal layouts on one device list = same shards."""
  names = list(axes)
  stride = {a: math.prod(axes[b] for b in names[i + 1:]) for i, a in enumerate(names)}  # row-major device grid
  return tuple(tuple((axes[a], stride[a]) for a in _names(e) if axes[a] > 1) for e in _spec(leaf, rules, axes))


def sync_plan_bytes(model_cfg: ModelConfig, topology: TopologyConfig, *, src_dtype: Any = None,
                    dst_dtype: Any = None) -> dict[str, int]:
  """TransferPlan's full-sync accounting, predicted: {"total", "per_rollout_device", "aliased_params"}.

  `total` = plan.bytes_total (destination bytes, each element once, aliased leaves excluded);
  `per_rollout_device` = every value of plan.bytes_per_device. Defaults: fp32 master weights -> the compute dtype.
  """
  src, dst = as_dtype(src_dtype or model_cfg.param_dtype), as_dtype(dst_dtype or model_cfg.dtype)
  t_axes, r_axes = dict(topology.trainer_axes), dict(topology.rollout_axes)
  total = per_device = aliased = 0
  for leaf in param_leaves(model_cfg):
    shard_shape(leaf, TRAIN_RULES, t_axes)  # raises, as TransferPlan would, on a mesh a dim does not divide over
    dst_shard = shard_shape(leaf, ROLLOUT_RULES, r_axes)
    # carve() builds colocated meshes over the same device list: identical (size, stride) splits alias.
    if topology.colocated and src == dst and _layout(leaf, TRAIN_RULES, t_axes) == _layout(leaf, ROLLOUT_RULES,
                                                                                           r_axes):
      aliased += leaf.size
      continue
    total += leaf.size
    per_device += math.prod(dst_shard)
  size = dst.itemsize
  return {"total": total * size, "per_rollout_device": per_device * size, "aliased_params": aliased}


# ---------------------------------------------------------------- rollout payload


def rollout_payload_bytes(batch_prompts: int, group_size: int, prompt_len: int, completion_len: int) -> dict[str, int]:
  """Itemised bytes of one step's trajectories as the trainer receives them; N = prompts x group, S = P + C."""
  for name, v in (("batch_prompts", batch_prompts), ("group_size", group_size), ("prompt_len", prompt_len),
                  ("completion_len", completion_len)):
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
      raise ValueError(f"rollout_payload_bytes: {name}={v!r} must be a positive int")
  N, S, C = batch_prompts * group_size, prompt_len + completion_len, completion_len
  i32, f32 = itemsize("int32"), itemsize("float32")
  items = {
      "token_ids": N * S * i32,  # tokens_MRS: each row holds its prompt and completion
      "sampler_logp": N * C * f32,  # mu, one per response token
      "loss_mask": N * C * f32,  # mask_MBT is float32
      # onpolicy_MBT, float32: the tokens sampled under the step's own weights (from each token's gen_id, which
      # stays on the host)
      "onpolicy_mask": N * C * f32,
      "rewards": N * f32,
      "row_layout": (2 * N * S + 2 * N * C) * i32,  # positions + segment ids per row; targets + gather index
  }
  return {**items, "total": sum(items.values())}


# ---------------------------------------------------------------- trainer collectives


def ring_all_gather(nbytes: float, n: int) -> float:
  """Bytes each of n ranks receives gathering an nbytes tensor: the n-1 shards it lacks."""
  return (n - 1) / n * nbytes


ring_reduce_scatter = ring_all_gather  # each rank sends (n-1)/n of its nbytes


def ring_all_reduce(nbytes: float, n: int) -> float:
  """Reduce-scatter then all-gather: 2 (n-1)/n x nbytes per rank."""
  return 2 * ring_all_gather(nbytes, n)


def _rank_elements(model_cfg: ModelConfig, axes: dict[str, int]) -> tuple[int, int, int]:
  """Per trainer rank: (gathered, shard) elements of fsdp-sharded weights, and elements of the other weights."""
  gathered = shard = other = 0
  unsharded = {**axes, "fsdp": 1}  # the tensor slice a rank computes with
  for leaf in param_leaves(model_cfg):
    n = math.prod(shard_shape(leaf, TRAIN_RULES, unsharded))
    if axes.get("fsdp", 1) > 1 and any("fsdp" in _names(e) for e in _spec(leaf, TRAIN_RULES, axes)):
      gathered, shard = gathered + n, shard + math.prod(shard_shape(leaf, TRAIN_RULES, axes))
    else:
      other += n
  return gathered, shard, other


def _batch_ranks(axes: dict[str, int]) -> tuple[int, int]:
  return axes.get("data", 1), axes.get("data", 1) * axes.get("fsdp", 1)


def _check_scheme(scheme: str) -> None:
  if scheme not in SCHEMES:
    raise ValueError(f"scheme={scheme!r}; expected one of {SCHEMES}")


def gradient_collective_bytes(model_cfg: ModelConfig, trainer_axes: Mapping[str, int], grad_dtype: Any = "float32",
                              scheme: str = "fsdp", *, param_dtype: Any = None, n_micro: int = 1,
                              lora_rank: int | None = None, lora_targets: Sequence[str] | None = None
                              ) -> dict[str, int]:
  """Per rank per step, itemised. fsdp: 2 x n_micro x (W - W/N) gathered (W = the rank's tensor slice of fsdp-sharded
  weights, param dtype), n_micro x (G - G/N) reduce-scattered, G/N all-reduced over data (2 (D-1)/D), and the
  remaining weights' gradients all-reduced over R = data x fsdp. allreduce: n_micro x 2 (R-1)/R x G."""
  _check_scheme(scheme)
  axes = _check_axes(trainer_axes, "trainer_axes")
  p, g = itemsize(param_dtype or model_cfg.param_dtype), itemsize(grad_dtype)
  gathered, shard, other = _rank_elements(model_cfg, axes)
  n_data, n_batch = _batch_ranks(axes)
  gather = (gathered - shard) * p if scheme == "fsdp" else 0
  if lora_rank:  # adapters are replicated: their gradients all-reduce over every batch rank
    targets = LoraConfig().targets if lora_targets is None else tuple(lora_targets)
    scatter, reduce = 0, ring_all_reduce(lora_adapter_params(model_cfg, lora_rank, targets) * g, n_batch)
  elif scheme == "fsdp":
    scatter, reduce = (gathered - shard) * g, ring_all_reduce(shard * g, n_data) + ring_all_reduce(other * g, n_batch)
  else:
    scatter, reduce = 0, ring_all_reduce((gathered + other) * g, n_batch)
  items = {"all_gather_fwd": n_micro * gather, "all_gather_bwd": n_micro * gather, "reduce_scatter": n_micro * scatter,
           "all_reduce": round(n_micro * reduce)}
  return {**items, "total": sum(items.values())}


def reference_collective_bytes(model_cfg: ModelConfig, trainer_axes: Mapping[str, int], *, kl_coef: float,
                               scheme: str = "fsdp", param_dtype: Any = None, n_micro: int = 1) -> int:
  """The reference log-prob forward: one more all-gather of the weights per microbatch under fsdp, if kl_coef > 0."""
  _check_scheme(scheme)
  if kl_coef <= 0 or scheme != "fsdp":
    return 0
  gathered, shard, _ = _rank_elements(model_cfg, _check_axes(trainer_axes, "trainer_axes"))
  return n_micro * (gathered - shard) * itemsize(param_dtype or model_cfg.param_dtype)


def critic_collective_bytes(model_cfg: ModelConfig, trainer_axes: Mapping[str, int], critic: str, *,
                            scheme: str = "fsdp", param_dtype: Any = None, grad_dtype: Any = "float32",
                            n_micro: int = 1, epochs: int = 1) -> dict[str, int]:
  """none: 0. shared: the old-values policy forward (a gather) + the [D] head's all-reduce. separate: a second
  backbone's full gradient traffic (`gradient_collective_bytes`) + its old-values forward + the head. The old
  values are read once a step; the gradients (head, backbone) flow in each of `epochs` passes."""
  if critic not in CRITICS:
    raise ValueError(f"critic={critic!r}; expected one of {CRITICS}")
  if critic == "none":
    return {"total": 0}
  axes = _check_axes(trainer_axes, "trainer_axes")
  forward = reference_collective_bytes(model_cfg, axes, kl_coef=1.0, scheme=scheme, param_dtype=param_dtype,
                                       n_micro=n_micro)
  head = round(n_micro * epochs * ring_all_reduce(model_cfg.d_model * itemsize(grad_dtype), _batch_ranks(axes)[1]))
  backbone = 0
  if critic == "separate":
    backbone = gradient_collective_bytes(model_cfg, axes, grad_dtype, scheme, param_dtype=param_dtype,
                                         n_micro=n_micro * epochs)["total"]
  items = {"backbone": backbone, "old_values_forward": forward, "value_head": head}
  return {**items, "total": sum(items.values())}
