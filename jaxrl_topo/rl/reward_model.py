"""A learned reward model: our Transformer backbone plus a linear scoring head, on a mesh.

  score(sequence) = h[last real token] . score_D      h = final-norm hidden state (models/transformer.py)

Checkpoint format: a Hugging Face `*ForSequenceClassification` directory with `num_labels=1`
(Qwen2ForSequenceClassification, LlamaForSequenceClassification, Qwen3...). It holds the backbone
as `model.*` tensors (no `lm_head`) plus `score.weight` [1, D] with no bias; transformers pools at
the rightmost non-pad token. Here a sequence's length is given explicitly (lists of ids), so the
pooled position is `len - 1` even when the sequence's last id happens to equal `pad_token_id`.

Placement: the backbone loads through hf_io with the caller's `rules` (each device reads only its
own shards); `score_D` is replicated. `score` right-pads to a power-of-two length bucket (>= 16),
cuts the sequences into fixed `batch_size` chunks (the last padded with dummy rows), and runs one
jit per model whose batch dimension lives on the rules' `batch` axes when they divide
`batch_size`, and is replicated otherwise. Compiles are bounded by the number of length buckets.
Letters: N sequences, B rows per call, T bucketed length, D hidden.

  rm = RewardModel.load("/ckpt/rm", mesh, ROLLOUT_RULES, batch_size=32)
  scores_N = rm.score([prompt_ids + completion_ids, ...])   # float32 numpy, same on every process
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from jaxrl_topo.models import hf_io
from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.models.fresh import CHAR_EOS
from jaxrl_topo.models.model import init_params
from jaxrl_topo.models.tokenizer import CHATML_TEMPLATE, build_char_tokenizer, save_tokenizer_dir
from jaxrl_topo.rollout.dense import bucket_length
from jaxrl_topo.topology.hostcomm import to_host
from jaxrl_topo.topology.rules import Rules, logical_to_spec

SCORE_NAME = "score.weight"  # HF's name for the [num_labels, D] head
_MIN_BUCKET = 16  # rows are padded to the next power of two of the longest, at least this (few programs)
_ARCHITECTURES = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
                  "qwen3": "Qwen3ForSequenceClassification"}


def _batch_spec(mesh: Mesh, rules: Rules, batch_size: int) -> PartitionSpec:
  """The rules' `batch` axes for the row dim when they divide `batch_size`; else replicated."""
  axes = logical_to_spec(("batch",), rules, mesh)[0]
  ways = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ())]))
  return PartitionSpec(axes) if axes is not None and batch_size % ways == 0 else PartitionSpec(None)


def score_rows(graphdef, params, score_D, tokens_BT, last_B):
  """Score of each row: hidden state at position last_B[b], dotted with score_D in float32."""
  B, T = tokens_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  # Right padding + a causal mask: real tokens never attend to the pad after them, so no segment ids.
  h_BTD, _ = nnx.merge(graphdef, params).hidden(tokens_BT, positions_BT)
  h_BD = h_BTD[jnp.arange(B), last_B].astype(jnp.float32)
  return jnp.einsum("BD,D->B", h_BD, score_D, precision=jax.lax.Precision.HIGHEST)


def _make_score_fn(graphdef, params, mesh: Mesh, rules: Rules, batch_size: int):
  """(jitted (params, score_D, tokens_BT, last_B) -> scores_B, tokens sharding, per-row sharding)."""
  spec = _batch_spec(mesh, rules, batch_size)
  rows_BT, rows_B = NamedSharding(mesh, PartitionSpec(spec[0], None)), NamedSharding(mesh, spec)
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  fn = jax.jit(lambda p, w, t, last: score_rows(graphdef, p, w, t, last),
               in_shardings=(param_shardings, NamedSharding(mesh, PartitionSpec()), rows_BT, rows_B),
               out_shardings=rows_B)
  return fn, rows_BT, rows_B


def _put(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """Host array -> global device array; every process holds the whole of `x`, each feeds its shards."""
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _pad_chunks(sequences: list[list[int]], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [C, B, T] int32, last [C, B] int32): right-padded with 0, dummy rows at the end."""
  lengths = [len(s) for s in sequences]
  if min(lengths) == 0:
    raise ValueError(f"cannot score an empty sequence (sequence {lengths.index(0)} has no tokens)")
  C = -(-len(sequences) // batch_size)
  tokens = np.zeros((C * batch_size, bucket_length(max(lengths), _MIN_BUCKET)), np.int32)
  last = np.zeros(C * batch_size, np.int32)  # dummy rows read position 0 and are dropped
  for i, seq in enumerate(sequences):
    tokens[i, :len(seq)] = seq
    last[i] = len(seq) - 1
  return tokens.reshape(C, batch_size, -1), last.reshape(C, batch_size)


@dataclasses.dataclass
class RewardModel:
  """Backbone (graphdef, params) + head score_D; `score` maps token-id sequences to floats."""

  graphdef: object
  params: dict  # backbone params (our nested dict layout), on `mesh` with `rules`
  score_D: jax.Array  # [d_model] float32, replicated on `mesh`
  cfg: ModelConfig  # tie_embeddings=True: the backbone has no lm_head tensor
  mesh: Mesh
  rules: Rules
  batch_size: int = 32  # sequences per jitted call (padded up; a fixed shape so nothing recompiles)
  _jit: tuple = dataclasses.field(init=False, repr=False)  # (score fn, tokens sharding, per-row sharding)

  def __post_init__(self):
    if self.batch_size <= 0:
      raise ValueError(f"RewardModel.batch_size={self.batch_size} must be positive")
    self._jit = _make_score_fn(self.graphdef, self.params, self.mesh, self.rules, self.batch_size)

  @classmethod
  def load(cls, model_dir: str, mesh: Mesh, rules: Rules, *, dtype: str = "float32",
           batch_size: int = 32) -> RewardModel:
    """From an HF SequenceClassification directory; `dtype` is the compute dtype of the backbone."""
    # A reward model has no LM head: tying makes the backbone's param tree (and hf_io's expected
    # tensors) exactly the `model.*` ones, whatever the checkpoint says about tied embeddings.
    cfg = hf_io.read_config(model_dir, dtype=dtype, tie_embeddings=True)
    files = hf_io.tensor_files(model_dir)
    score_D = _read_score(model_dir, files, cfg.d_model)
    try:
      graphdef, params = hf_io.load_params(model_dir, cfg, mesh, rules, ignore=(SCORE_NAME,))
    except hf_io.CheckpointError as e:
      raise hf_io.CheckpointError(f"{model_dir}: {e}") from e
    score_D = _put(score_D, NamedSharding(mesh, PartitionSpec()))
    return cls(graphdef, params, score_D, cfg, mesh, rules, batch_size)

  def score(self, sequences: list[list[int]]) -> np.ndarray:
    """[N] float32 host array, one score per token-id sequence (prompt + completion)."""
    if not sequences:
      return np.zeros(0, np.float32)
    fn, rows_BT, rows_B = self._jit
    tokens_CBT, last_CB = _pad_chunks(sequences, self.batch_size)
    out = [fn(self.params, self.score_D, _put(t_BT, rows_BT), _put(last_B, rows_B))
           for t_BT, last_B in zip(tokens_CBT, last_CB, strict=True)]  # all chunks dispatched, then one read
    return np.concatenate(to_host(out))[:len(sequences)].astype(np.float32)


def _read_score(model_dir: str, files: dict[str, str], d_model: int) -> np.ndarray:
  """score.weight [1, D] as a float32 [D] host vector; ValueError naming what is wrong."""
  if SCORE_NAME not in files:
    raise ValueError(f"{model_dir}: no {SCORE_NAME!r} tensor; a reward model is an HF *ForSequenceClassification "
                     "checkpoint with num_labels=1")
  with safe_open(files[SCORE_NAME], framework="numpy") as f:
    w = f.get_tensor(SCORE_NAME)
  if w.shape != (1, d_model):
    raise ValueError(f"{model_dir}: {SCORE_NAME!r} has shape {w.shape}; a scalar reward head needs (1, {d_model})")
  return np.asarray(w[0], np.float32)


def write_reward_model(path: str, cfg: ModelConfig, *, seed: int = 0) -> None:
  """A random-init reward model directory in the HF SequenceClassification format (for tests and demos).

  Backbone and tokenizer as models/fresh.py writes them (char tokenizer, ChatML template), no
  lm_head, plus `score.weight` ~ N(0, 1/D) so scores are O(1). Call from every process.
  """
  tok = build_char_tokenizer()
  if tok.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
    raise ValueError(f"the char tokenizer needs vocab_size >= {tok.get_vocab_size(with_added_tokens=True)}, "
                     f"the config has {cfg.vocab_size}")
  backbone_cfg = dataclasses.replace(cfg, tie_embeddings=True)  # no lm_head tensor is created
  key = jax.random.key(seed)
  _, params = init_params(backbone_cfg, jax.random.fold_in(key, 0))
  score_D = np.asarray(jax.random.normal(jax.random.fold_in(key, 1), (cfg.d_model,))) * cfg.d_model ** -0.5
  pad_id = tok.token_to_id("<pad>")
  hf_io.save_model(path, backbone_cfg, params, max_shard_bytes=1 << 62,  # one file, so the head joins it
                   bos_token_id=tok.token_to_id("<bos>"), eos_token_id=[tok.token_to_id(t) for t in CHAR_EOS])
  if jax.process_index() != 0:
    return
  _add_score_head(path, score_D, pad_id, tie_embeddings=cfg.tie_embeddings)
  save_tokenizer_dir(path, tok, chat_template=CHATML_TEMPLATE, bos_token="<bos>", eos_token=CHAR_EOS[0],
                     pad_token="<pad>", unk_token="<unk>")


def _add_score_head(path: str, score_D: np.ndarray, pad_id: int, *, tie_embeddings: bool) -> None:
  """Adds score.weight to the single safetensors file and makes config.json a SequenceClassification one."""
  weights = os.path.join(path, "model.safetensors")
  tensors = load_file(weights)
  tensors[SCORE_NAME] = score_D.reshape(1, -1).astype(tensors["model.embed_tokens.weight"].dtype)
  save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
  os.replace(weights + ".tmp", weights)
  with open(os.path.join(path, "config.json")) as f:
    hf_cfg = json.load(f)
  hf_cfg.update(architectures=[_ARCHITECTURES[hf_cfg["model_type"]]], num_labels=1, id2label={"0": "LABEL_0"},
                label2id={"LABEL_0": 0}, pad_token_id=pad_id, tie_word_embeddings=tie_embeddings)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)
