"""Batch generation from a JSONL file of prompts: the library behind `launchers/generate.py`.

Input lines are {"prompt": "text"} (chat template applied when chat=True) or {"prompt_ids": [ints]}.
Output lines, in input order: completion_ids (stop token included when one ended the sequence),
text, logprobs (rollout/sampling.py convention), finish_reason ("stop" or "length").

Generation runs on the paged rollout engine (engine.py): `batch_size` decode slots refilled as
sequences finish, prompt lengths bucketed to powers of two, so the whole file compiles a handful
of programs. `impl="dense"` keeps the reference decoder (dense.py) for tests and comparison.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tqdm
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_topo.data.pipeline import read_jsonl
from jaxrl_topo.models import hf_io
from jaxrl_topo.models.tokenizer import Tokenizer, read_eos_token_ids
from jaxrl_topo.rollout.dense import DecodeConfig, bucket_length, generate_dense
from jaxrl_topo.rollout.engine import EngineConfig, Request, RolloutEngine
from jaxrl_topo.rollout.engine_config import check_fields, engine_options
from jaxrl_topo.rollout.paged import check_read
from jaxrl_topo.rollout.requests import stop_string_end
from jaxrl_topo.rollout.sampling import SamplingConfig
from jaxrl_topo.topology.rules import ROLLOUT_RULES, make_mesh

_MIN_BUCKET = 8


def read_prompts(path: str, tokenizer: Tokenizer | None, chat: bool, vocab_size: int | None = None) -> list[list[int]]:
  """Token ids per line; errors name the line. `vocab_size`: ids outside [0, vocab_size) are refused. Output line i
  answers prompt line i, so a blank line between prompts is refused (blank lines at the end are not)."""
  rows = read_jsonl(path)
  for i, (where, _) in enumerate(rows, 1):
    if int(where.rsplit(":", 1)[1]) != i:
      raise ValueError(f"{path}:{i}: a blank line between prompts (output line i answers prompt line i): delete it")
  prompts = [_prompt_ids(row, tokenizer, chat, where, vocab_size) for where, row in rows]
  if not prompts:
    raise ValueError(f"{path}: no prompts")
  return prompts


def _prompt_ids(row: Any, tokenizer: Tokenizer | None, chat: bool, where: str, vocab_size: int | None) -> list[int]:
  if not isinstance(row, dict) or ("prompt" in row) == ("prompt_ids" in row):
    raise ValueError(f"{where}: each line needs exactly one of 'prompt' (text) or 'prompt_ids' (ints)")
  if "prompt_ids" in row:
    ids = row["prompt_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
      raise ValueError(f"{where}: prompt_ids must be a list of ints")
    if ids and vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
      bad = next(i for i in ids if not 0 <= i < vocab_size)
      raise ValueError(f"{where}: prompt_ids holds {bad}; token ids must lie in [0, {vocab_size}) for this model")
  else:
    if tokenizer is None:
      raise ValueError(f"{where}: a text prompt needs tokenizer.json in the model directory")
    text = row["prompt"]
    if not isinstance(text, str):
      raise ValueError(f"{where}: 'prompt' must be a string, got {type(text).__name__} {json.dumps(text)[:40]}")
    ids = (tokenizer.apply_chat_template_ids([{"role": "user", "content": text}]) if chat
           else tokenizer.encode(text))
  if not ids:
    raise ValueError(f"{where}: empty prompt")
  return ids


def check_out_file(path: str, flag: str = "--out") -> None:
  """Raises, writing nothing, unless `path` can be written as a file: not a directory, its parent a directory
  (or one that can be made) that is writable; where the parent exists, the file is opened to be sure (and removed
  again if it was new, so nothing is left written)."""
  if os.path.isdir(path):
    raise IsADirectoryError(f"{flag}={path} is a directory; it names the output file (e.g. {flag}=DIR/out.jsonl)")
  if os.path.exists(path) and not os.access(path, os.W_OK):
    raise PermissionError(f"{flag}={path} is not writable")
  hf_io.check_parent(path, flag)
  if os.path.isdir(os.path.dirname(os.path.abspath(path))):  # try it: os.access says yes to root, and to /proc
    existed = os.path.exists(path)  # (a dangling link: no; the file made is its target, removed, the link kept)
    try:
      with open(path, "a"):
        pass
    except OSError as e:
      raise OSError(f"{flag}={path} cannot be written: {e.strerror}") from None
    if not existed:
      os.remove(os.path.realpath(path))
  elif any(len(name.encode()) > 255 for name in path.split(os.sep)):  # its folders are made later
    raise OSError(f"{flag}={path}: a name in it is longer than 255 bytes")


def check_sizes(batch_size: int, data: int, tensor: int, name=lambda n: n) -> None:
  """batch_size, data and tensor positive, batch_size a multiple of data; `name` spells a setting (a flag)."""
  for key, value in (("batch_size", batch_size), ("data", data), ("tensor", tensor)):
    if value < 1:
      raise ValueError(f"{name(key)}={value} must be >= 1")
  if batch_size % data:
    raise ValueError(f"{name('batch_size')}={batch_size} must be a multiple of {name('data')}={data}")


@dataclasses.dataclass(frozen=True)
class Completion:
  completion_ids: list[int]
  logprobs: list[float]
  finish_reason: str


def generate_ids(graphdef, params, prompts: Sequence[Sequence[int]], decode: DecodeConfig, *, seed: int = 0,
                 batch_size: int = 8, vocab_size: int | None = None, mesh=None, progress: bool = False,
                 impl: str = "paged", page_size: int = 16, read: str = "auto",
                 engine: Mapping[str, Any] | None = None, stop_strings: Sequence[str] = (),
                 detokenize=None) -> list[Completion]:
  """Completions for `prompts` in order; sequence i samples with keys from (seed, i, position).

  impl="paged" runs the rollout engine (continuous batching over `batch_size` slots, a KV pool
  big enough that nothing is ever preempted; `read`: its paged decode read, EngineConfig.impl;
  `engine`: other EngineConfig knobs by name, e.g. {"kv_dtype": "bfloat16", "min_pack_rows": 4});
  impl="dense" the reference decoder in fixed batches. Both draw the same keys, so they give the same tokens.
  `stop_strings`: a completion ends right after the shortest prefix whose text (`detokenize(ids)`) holds one
  (finish_reason "stop"); the engine retires it there and frees its slot, the dense decoder cuts it afterwards.
  No prompts: no completions (as RolloutEngine.run([])). A prompt whose length + decode.max_new_tokens passes the
  model's position limit (max_position_embeddings) is refused before anything compiles."""
  engine = engine_knobs(engine)
  if impl not in ("paged", "dense"):
    raise ValueError(f"impl={impl!r}; expected 'paged' or 'dense'")
  stop_strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
  if stop_strings and (detokenize is None or not all(stop_strings)):
    raise ValueError(f"stop_strings={stop_strings!r}: each must be non-empty, and they need detokenize= (the text "
                     "of a completion)")
  if not prompts:
    return []
  cfg = nnx.merge(graphdef, params).cfg
  for i, p in enumerate(prompts):
    if not len(p):
      raise ValueError(f"prompt {i} is empty")
    if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
      raise ValueError(f"prompt {i}: token ids must lie in [0, {vocab_size})")
    if cfg.max_position and len(p) + decode.max_new_tokens > cfg.max_position:
      raise ValueError(f"prompt {i}: its {len(p)} tokens + max_new_tokens {decode.max_new_tokens} > the model's "
                       f"position limit {cfg.max_position} (max_position_embeddings)")
  if impl == "paged":
    return _generate_paged(cfg, graphdef, params, prompts, decode, seed=seed, n_slots=batch_size, mesh=mesh,
                           progress=progress, page_size=page_size, read=read, engine=engine, stops=stop_strings,
                           detokenize=detokenize)
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a bucket
  batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
  key = jax.random.key(seed)
  batch_sharding = NamedSharding(mesh, PartitionSpec("data")) if mesh is not None else None
  out: dict[int, Completion] = {}
  for idx in tqdm.tqdm(batches, desc="generate", unit="batch", disable=not progress):
    T = bucket_length(max(len(prompts[i]) for i in idx), _MIN_BUCKET)
    rows = np.full((batch_size, T), decode.pad_id, np.int32)
    lens = np.ones((batch_size,), np.int32)  # dummy rows: one pad token
    seq_ids = np.full((batch_size,), -1, np.int32)
    for r, i in enumerate(idx):
      rows[r, : len(prompts[i])], lens[r], seq_ids[r] = prompts[i], len(prompts[i]), i
    args = [jax.device_put(a, batch_sharding) for a in (rows, lens, seq_ids)]
    toks, lps, n, stopped = jax.device_get(generate_dense(graphdef, params, *args, key, decode=decode))
    for r, i in enumerate(idx):
      ids, cut = toks[r, : n[r]].tolist(), None
      if stop_strings:
        cut = stop_string_end(ids, 0, stop_strings, detokenize)
      out[i] = Completion(ids[:cut], lps[r, : n[r]].tolist()[:cut], "stop" if stopped[r] or cut else "length")
  return [out[i] for i in range(len(prompts))]


# EngineConfig's fields that generation sets itself (from the batch size, the prompts, the decode config, `read`).
_SET_HERE = ("n_slots", "page_size", "n_pages", "max_len", "min_bucket", "sampling", "eos_ids", "pad_id", "impl")


def engine_knobs(engine: Mapping[str, Any] | None) -> dict[str, Any]:
  """`engine` checked before any work: EngineConfig fields that generation leaves to the caller."""
  return engine_options(engine, _SET_HERE, "generation")


def _generate_paged(cfg, graphdef, params, prompts, decode: DecodeConfig, *, seed, n_slots, mesh, progress,
                    page_size, read: str, engine: dict[str, Any], stops: tuple[str, ...], detokenize):
  max_len = -(-(max(map(len, prompts)) + decode.max_new_tokens) // page_size) * page_size
  ecfg = EngineConfig(n_slots=n_slots, page_size=page_size, n_pages=n_slots * (max_len // page_size),
                      max_len=max_len, min_bucket=_MIN_BUCKET, sampling=decode.sampling, eos_ids=decode.eos_ids,
                      pad_id=decode.pad_id, impl=read, **engine)
  rollout = RolloutEngine(graphdef, cfg, params, ecfg, seed=seed, mesh=mesh, detokenize=detokenize)
  logging.info("rollout engine: %d slots, %d pages of %d tokens, decode read %s, KV %s", n_slots, ecfg.n_pages,
               page_size, rollout.impl, ecfg.kv_dtype or "in the compute dtype")
  bar = tqdm.tqdm(total=len(prompts), desc="generate", unit="seq", disable=not progress)

  def progress_bar(eng) -> None:
    bar.update(eng.stats["finished"] - bar.n)

  progress_bar.needs_boundaries = False  # any chunk's end will do: chunks may grow (EngineConfig.max_chunk)
  samples = rollout.run([Request(p, max_new_tokens=decode.max_new_tokens, stop_strings=stops) for p in prompts],
                        on_chunk=progress_bar)
  bar.close()
  return [Completion(s.tokens, s.logprobs, s.finish_reason) for s in samples]


def run(model_dir: str, prompts_path: str, out_path: str, *, max_new_tokens: int = 64,
        sampling: SamplingConfig = SamplingConfig(greedy=True), seed: int = 0, chat: bool = False,
        batch_size: int = 8, dtype: str = "float32", data: int = 1, tensor: int = 1, read: str = "auto",
        engine: Mapping[str, Any] | None = None, stop: Sequence[str] = (), page_size: int = 16) -> list[dict]:
  """Reads prompts, generates, writes `out_path`; returns the written rows. `engine`: EngineConfig knobs by name;
  `stop`: stop strings, each completion ending right after the first it holds (generate_ids); `page_size`: tokens
  per KV page."""
  engine = engine_knobs(engine)
  check_fields({"page_size": page_size}, "")  # EngineConfig's own check, before the model loads
  check_read(read, "read")
  DecodeConfig(max_new_tokens=max_new_tokens, sampling=sampling)  # its checks, before the model loads too
  check_sizes(batch_size, data, tensor)
  check_out_file(out_path, "out_path")
  tokenizer = Tokenizer.from_dir(model_dir) if os.path.isfile(os.path.join(model_dir, "tokenizer.json")) else None
  if stop and tokenizer is None:
    raise ValueError(f"stop strings need the text of completions: {model_dir} has no tokenizer.json")
  prompts = read_prompts(prompts_path, tokenizer, chat, hf_io.read_config(model_dir).vocab_size)
  mesh = make_mesh({"data": data, "tensor": tensor}, jax.devices()[: data * tensor]) if data * tensor > 1 else None
  cfg, graphdef, params = hf_io.load_model(model_dir, mesh, ROLLOUT_RULES if mesh else None, dtype=dtype)
  eos = tokenizer.eos_token_ids if tokenizer else read_eos_token_ids(model_dir)
  pad = tokenizer.pad_token_id if tokenizer and tokenizer.pad_token_id is not None else 0
  logging.info("model %s: %s layers, vocab %d; %d prompts; eos ids %s", model_dir, cfg.n_layers, cfg.vocab_size,
               len(prompts), eos)
  decode = DecodeConfig(max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=tuple(eos), pad_id=pad)
  completions = generate_ids(graphdef, params, prompts, decode, seed=seed, batch_size=batch_size,
                             vocab_size=cfg.vocab_size, mesh=mesh, progress=True, read=read, page_size=page_size,
                             engine=engine, stop_strings=stop, detokenize=tokenizer.decode if stop else None)
  rows = [dict(completion_ids=c.completion_ids, text=tokenizer.decode(c.completion_ids) if tokenizer else None,
               logprobs=c.logprobs, finish_reason=c.finish_reason) for c in completions]
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  with open(out_path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return rows
