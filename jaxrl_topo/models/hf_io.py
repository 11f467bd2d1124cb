"""Hugging Face checkpoint directories in and out: config.json + *.safetensors (sharded or not).

Loading goes tensor by tensor: each checkpoint tensor is read on the host once, viewed in our
layout (a transpose/reshape, no copy), and each device receives only its own slice through
`jax.make_array_from_callback`. No device ever holds a replicated copy, and host memory peaks at
one tensor. Only safetensors are read: no pickle, no remote code, no hub.

Name mapping (ours <-> HF), with the layout change each needs:
  embed_tokens                      model.embed_tokens.weight         same [V, D]
  layers.i.self_attn.{q,k,v}_proj   ...{q,k,v}_proj.weight            [D, n, H] <- [n*H, D]
  layers.i.self_attn.o_proj         ...o_proj.weight                  [N, H, D] <- [D, N*H]
  layers.i.mlp.*_proj, lm_head      ....weight                        [in, out] <- [out, in]
  norms, o_proj.bias                ....weight / .bias                same
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxrl_topo.models.config import ModelConfig, from_hf_dict, to_hf_dict
from jaxrl_topo.models.model import Params, abstract_model, nest, param_shardings
from jaxrl_topo.topology.rules import ActivationSharding, Rules

_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed here


class CheckpointError(ValueError):
  """A checkpoint does not match the config: names the tensor."""


# --- layout transforms: HF array -> our view, and back ----------------------------------------


def _to_ours(path: tuple, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  leaf, owner = path[-1], path[-2] if len(path) > 1 else None
  if leaf == "kernel" and owner in ("q_proj", "k_proj", "v_proj"):
    D, n, H = shape
    return hf.reshape(n, H, D).transpose(2, 0, 1)
  if leaf == "kernel" and owner == "o_proj":
    N, H, D = shape
    return hf.reshape(D, N, H).transpose(1, 2, 0)
  if leaf == "bias" and owner in ("q_proj", "k_proj", "v_proj"):
    return hf.reshape(shape)
  if leaf == "kernel" or path == ("lm_head",):
    return hf.T
  return hf


def _to_hf(path: tuple, ours: np.ndarray) -> np.ndarray:
  leaf, owner = path[-1], path[-2] if len(path) > 1 else None
  if leaf == "kernel" and owner in ("q_proj", "k_proj", "v_proj"):
    D, n, H = ours.shape
    return ours.transpose(1, 2, 0).reshape(n * H, D)
  if leaf == "kernel" and owner == "o_proj":
    N, H, D = ours.shape
    return ours.transpose(2, 0, 1).reshape(D, N * H)
  if leaf == "bias" and owner in ("q_proj", "k_proj", "v_proj"):
    return ours.reshape(-1)
  if leaf == "kernel" or path == ("lm_head",):
    return ours.T
  return ours


def hf_name(path: tuple) -> str:
  """Our param path -> HF tensor name, e.g. ("layers", 0, "mlp", "up_proj", "kernel")."""
  if path == ("lm_head",):
    return "lm_head.weight"
  parts = ["weight" if p == "kernel" else str(p) for p in path]
  if path == ("embed_tokens",):
    parts.append("weight")
  return "model." + ".".join(parts)


def _hf_shape(path: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
  return _to_hf(path, np.empty(shape, np.int8)).shape


def _flat(tree: Params, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
  out = []
  for key, value in tree.items():
    out += _flat(value, prefix + (key,)) if isinstance(value, dict) else [(prefix + (key,), value)]
  return out


# --- reading ------------------------------------------------------------------------------------


# config.json keys read as numbers: (kind, required). Checked before from_hf_dict so that a bad value is named.
_HF_NUMBERS = {"vocab_size": (int, True), "hidden_size": (int, True), "num_hidden_layers": (int, True),
               "num_attention_heads": (int, True), "intermediate_size": (int, True),
               "num_key_value_heads": (int, False), "head_dim": (int, False), "max_position_embeddings": (int, False),
               "rms_norm_eps": (float, False), "rope_theta": (float, False)}


def read_json(path: str) -> Any:
  """The parsed file; a file that is not JSON is a ValueError naming it."""
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from None


def _check_numbers(d: dict, path: str) -> None:
  for key, (kind, required) in _HF_NUMBERS.items():
    value = d.get(key)
    if value is None:
      if required:
        raise ValueError(f"{path}: no {key!r} (a Hugging Face config.json needs it)")
      continue
    ok = isinstance(value, int | float if kind is float else int) and not isinstance(value, bool)
    if not ok or not value > 0:
      raise ValueError(f"{path}: {key}={json.dumps(value)} must be a positive {kind.__name__}")


def read_config(model_dir: str, **overrides) -> ModelConfig:
  """The ModelConfig of `model_dir`'s config.json; a broken file or bad value is a ValueError naming it."""
  path = os.path.join(model_dir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{model_dir}: no config.json (expected a local Hugging Face model directory)")
  d = read_json(path)
  if not isinstance(d, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(d).__name__}")
  _check_numbers(d, path)
  try:
    return from_hf_dict(d, **overrides)
  except KeyError as e:
    raise ValueError(f"{path}: no {e.args[0]!r} (a Hugging Face config.json needs it)") from None
  except (ValueError, TypeError) as e:
    raise ValueError(f"{path}: {str(e).removeprefix('config.json: ')}") from None


def _open(file: str):
  """safe_open, with a truncated or corrupt file named in a CheckpointError."""
  try:
    return safe_open(file, framework="numpy")
  except SafetensorError as e:
    raise CheckpointError(f"{file}: not a readable safetensors file ({e}); is it truncated?") from None


def tensor_files(model_dir: str) -> dict[str, str]:
  """HF tensor name -> safetensors file holding it. Reads only the headers, so it also checks each file is whole."""
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.isfile(index):
    doc = read_json(index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index}: no 'weight_map' object")
    files = {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
    for file in sorted(set(files.values())):
      if not os.path.isfile(file):
        raise FileNotFoundError(f"{index} names {file}, which does not exist")
      with _open(file):
        pass
    return files
  files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
  if not files:
    pickles = [f for f in _PICKLE_FILES if os.path.exists(os.path.join(model_dir, f))]
    hint = f"; found {pickles}, which are pickle files and are never loaded: convert them" if pickles else ""
    raise FileNotFoundError(f"{model_dir}: no *.safetensors weights{hint}")
  out = {}
  for file in files:
    with _open(os.path.join(model_dir, file)) as f:
      out.update({name: os.path.join(model_dir, file) for name in f.keys()})  # noqa: SIM118
  return out


def _check_names(expected: dict[str, tuple], files: dict[str, str], cfg: ModelConfig,
                 ignore: tuple[str, ...] = ()) -> None:
  present = {n for n in files if not n.endswith(_IGNORED_SUFFIXES) and n not in ignore}
  if cfg.tie_embeddings:
    present.discard("lm_head.weight")  # some tied checkpoints store the shared matrix twice
  missing = sorted(set(expected) - present)
  unexpected = sorted(present - set(expected))
  if missing:
    raise CheckpointError(f"checkpoint is missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                          f"that the config ({cfg.family}, {cfg.n_layers} layers) needs")
  if unexpected:
    raise CheckpointError(f"checkpoint has unexpected tensor(s) {unexpected[:5]}"
                          f"{' ...' if len(unexpected) > 5 else ''} that the config does not use")


def load_params(model_dir: str, cfg: ModelConfig, mesh: Mesh | None = None, rules: Rules | None = None, *,
                ignore: tuple[str, ...] = ()):
  """(graphdef, params) from `model_dir`'s safetensors, each device getting only its own shards.
  `ignore`: tensor names another reader takes (e.g. a reward model's `score.weight`)."""
  sharding = ActivationSharding(mesh, rules) if mesh is not None else None
  graphdef, abstract = abstract_model(cfg, sharding)
  shardings = (param_shardings(abstract, mesh, rules) if mesh is not None
               else jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract.shapes))
  expected = {hf_name(p): (p, sds) for p, sds in _flat(abstract.shapes)}
  files = tensor_files(model_dir)
  _check_names(expected, files, cfg, ignore)
  leaves = {}
  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(_open(f)) for f in sorted(set(files.values()))}
    for name, (path, sds) in expected.items():
      handle = handles[files[name]]
      got = tuple(handle.get_slice(name).get_shape())
      want = _hf_shape(path, sds.shape)
      if got != want:
        raise CheckpointError(f"tensor {name!r} has shape {got} in the checkpoint; the config needs {want}")
      view = _to_ours(path, handle.get_tensor(name), sds.shape)
      sharding_ = _at(shardings, path)
      leaves[path] = jax.make_array_from_callback(  # dtype: a process may hold none of the shards
          sds.shape, sharding_, lambda idx, v=view, dt=sds.dtype: np.ascontiguousarray(v[idx]).astype(dt),
          dtype=sds.dtype)
  return graphdef, nest(leaves.items())


def _at(tree: Params, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def load_model(model_dir: str, mesh: Mesh | None = None, rules: Rules | None = None, **cfg_overrides):
  """(cfg, graphdef, params) for a local HF directory; `cfg_overrides` e.g. dtype="float32"."""
  cfg = read_config(model_dir, **cfg_overrides)
  graphdef, params = load_params(model_dir, cfg, mesh, rules)
  return cfg, graphdef, params


# --- writing ------------------------------------------------------------------------------------


def check_parent(path: str, flag: str) -> None:
  """Raises, writing nothing, unless the nearest existing ancestor of `path` is a writable directory (so that
  the missing ones can be made)."""
  parent = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise NotADirectoryError(f"{flag}={path}: {parent} is a file, not a directory")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise PermissionError(f"{flag}={path}: {parent} is not writable")


def is_model_dir(path: str) -> bool:
  names = os.listdir(path) if os.path.isdir(path) else []
  return "config.json" in names and any(n.endswith(".safetensors") for n in names)


def check_out_dir(path: str, flag: str = "--out", *, replace_model: bool = False) -> None:
  """Raises, writing nothing, unless `path` can become a model directory: absent or empty, or (`replace_model`)
  a model directory already (config.json + *.safetensors), whose model save_model then replaces."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise FileExistsError(f"{flag}={path} is a file, not a directory; nothing was written")
  if not os.path.isdir(path):
    check_parent(path, flag)
    first = os.path.abspath(path)  # the outermost folder to make: try it (os.access says yes to root, and to /proc)
    while not os.path.exists(os.path.dirname(first)):
      first = os.path.dirname(first)
    try:
      os.mkdir(first)
    except FileExistsError:  # another process of this run probes it too
      return
    except OSError as e:
      raise OSError(f"{flag}={path} cannot be written: {e.strerror}") from None
    with contextlib.suppress(OSError):  # (or removes it first)
      os.rmdir(first)
    return
  if os.listdir(path) and not (replace_model and is_model_dir(path)):
    what = " and holds no model to replace" if replace_model else ""
    raise FileExistsError(f"{flag}={path} already exists and is not empty{what}; nothing was written: choose a new "
                          "directory (or empty that one first)")
  if not os.access(path, os.W_OK | os.X_OK):
    raise PermissionError(f"{flag}={path} is not writable")


def _host_array(x: jax.Array) -> np.ndarray:
  """The full value on the host; every process must call this for arrays spanning processes."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# A model directory's tokenizer: tokenizer.json (what Tokenizer.from_dir reads), its config, special tokens, chat
# template, and generation_config.json (EOS ids).
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens", "chat_template", "generation_config")


def tokenizer_files(model_dir: str) -> list[str]:
  """The names of `model_dir`'s tokenizer files (TOKENIZER_PREFIXES)."""
  return sorted(f for f in os.listdir(model_dir) if f.startswith(TOKENIZER_PREFIXES))


def save_model(model_dir: str, cfg: ModelConfig, params: Params, *, dtype: str | None = None,
               max_shard_bytes: int = 4 << 30, bos_token_id: int | None = None,
               eos_token_id: int | list[int] | None = None,
               progress: Callable[[str], None] | None = None, tokenizer_dir: str | None = None) -> None:
  """Writes `params` as an HF directory that `transformers` loads. Call from every process;
  process 0 writes. `dtype` defaults to cfg.param_dtype. `tokenizer_dir`: a model directory whose tokenizer files
  (tokenizer*.json, special tokens, chat template, generation_config.json: `tokenizer_files`) are copied in last,
  so `Tokenizer.from_dir(model_dir)` (generate, serve) loads the saved policy; without it, no tokenizer is written.
  `model_dir` must be absent, empty or a model directory (whose model this one replaces): anything else (a run's
  workdir, say) is refused with nothing written."""
  if tokenizer_dir is not None and not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
    raise FileNotFoundError(f"tokenizer_dir={tokenizer_dir}: no tokenizer.json there; nothing was written")
  dtype = dtype or cfg.param_dtype
  np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
  tensors = {}
  for path, x in _flat(params):
    tensors[hf_name(path)] = np.ascontiguousarray(_to_hf(path, _host_array(x))).astype(np_dtype)
    if progress:
      progress(hf_name(path))
  if jax.process_index() != 0:
    return
  check_out_dir(model_dir, "save_model: model_dir", replace_model=True)  # after the gather: no process waits on us
  os.makedirs(model_dir, exist_ok=True)
  shards: list[dict[str, np.ndarray]] = [{}]
  for name, t in tensors.items():
    if shards[-1] and sum(a.nbytes for a in shards[-1].values()) + t.nbytes > max_shard_bytes:
      shards.append({})
    shards[-1][name] = t
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  for file, shard in zip(names, shards, strict=True):
    _atomic(os.path.join(model_dir, file), lambda p, s=shard: save_file(s, p, metadata={"format": "pt"}))
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {n: f for f, s in zip(names, shards, strict=True) for n in s}}
    _write_json(os.path.join(model_dir, "model.safetensors.index.json"), index)
  _drop_stale_weights(model_dir, names)
  hf_cfg = to_hf_dict(dataclasses.replace(cfg, param_dtype=dtype), bos_token_id=bos_token_id,
                      eos_token_id=eos_token_id)
  _write_json(os.path.join(model_dir, "config.json"), hf_cfg)
  if eos_token_id is not None or bos_token_id is not None:
    gen = {k: v for k, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)) if v is not None}
    _write_json(os.path.join(model_dir, "generation_config.json"), gen)
  if tokenizer_dir is not None and os.path.realpath(tokenizer_dir) != os.path.realpath(model_dir):
    for name in tokenizer_files(tokenizer_dir):
      shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(model_dir, name))


def _drop_stale_weights(model_dir: str, names: list[str]) -> None:
  """The weight files of the model this save replaced: other shards, an index that one file no longer needs."""
  keep = set(names) | ({"model.safetensors.index.json"} if len(names) > 1 else set())
  for f in os.listdir(model_dir):
    if (f.endswith(".safetensors") or f == "model.safetensors.index.json") and f not in keep:
      os.remove(os.path.join(model_dir, f))


def _atomic(path: str, write: Callable[[str], None]) -> None:
  """Writes through a temporary name, so an interrupted save never leaves a torn file under `path`."""
  tmp = path + ".tmp"
  write(tmp)
  os.replace(tmp, path)


def _write_json(path: str, obj: Any) -> None:
  def write(p):
    with open(p, "w") as f:
      json.dump(obj, f, indent=2)
  _atomic(path, write)
