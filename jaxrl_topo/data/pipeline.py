"""Prompt pipelines: JSONL, Parquet or a built-in task -> tokenized, sharded, shuffled batches (grain).

Loading is eager. Every row is read, validated and tokenized once, before the first step, so a bad
row, or an overlong prompt under overlong="error", fails at setup with its `file:line` (for Parquet,
the 1-based row number stands in for the line). The overlong counts are also exact from the start,
and the same in every epoch. RL prompt sets fit in host memory; tokenizing 10^5 short prompts takes
seconds. Filtering overlong prompts inside grain would also have broken fixed batch sizes: a filtered
MapDataset yields holes.

Iteration is a grain MapDataset, index-based throughout, so the iterator state is one integer:
  source -> shuffle(seed) -> repeat() -> [process_index::process_count] -> batch(batch_size)
The shuffle is global and changes each epoch (grain folds the epoch into the seed). Sharding takes
every process_count-th element of that one global stream, so:
  * processes see disjoint elements, and together they cover every epoch exactly;
  * the prompts of global step t (all processes' batches together) are global stream elements
    [t*B*P, (t+1)*B*P) for B = batch_size and P = process_count. The data order does not depend on
    how many processes read it.
State: `{"next_index": batch position, "layout": [...]}`, JSON-serialisable for orbax. Restoring into a
pipeline with another seed, shard layout, batch size or prompt count raises instead of silently
reading different data.

Batch items are dicts: "prompt_ids" (list[int]), "prompt" (the text, before any chat template or
truncation), "answer" (str), "source_row" (0-based row in the source), then every other field of the
row (for tasks: "task", and for countdown "numbers", "target"). An item without "prompt_ids" is the
metadata that `tasks.task_reward` expects.
"""

import copy
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import grain
from absl import logging

from jaxrl_topo.data import tasks
from jaxrl_topo.models.tokenizer import Tokenizer

OVERLONG_MODES = ("skip", "truncate", "error")
RESERVED_FIELDS = ("prompt_ids", "prompt", "answer", "source_row")
# Data lives in memory: reader threads would only contend for the GIL, and prefetch would run ahead
# of the checkpointed position.
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptDataConfig:
  """Where prompts come from and how they are tokenized and batched."""

  source: str  # a .jsonl or .parquet path, or a built-in task name (tasks.TASK_NAMES)
  eval_source: str | None = None  # held-out file; None with a task source: the task's held-out split
  task: tasks.TaskConfig | None = None  # knobs of a task source; default TaskConfig(name=source)
  prompt_field: str = "prompt"  # row field holding the prompt text
  answer_field: str | None = "answer"  # row field holding the reference answer; None: rows have none ("")
  batch_size: int = 8  # prompts per step, per process
  seed: int = 0  # shuffle seed; each epoch is reshuffled from it
  max_prompt_len: int = 256  # tokens, after the chat template
  overlong: str = "skip"  # longer prompts: "skip", "truncate" (keep the last max_prompt_len tokens), "error"
  chat_template: bool = False  # wrap each prompt as one user turn of the tokenizer's chat template
  # text added to every prompt, after a blank line, before the chat template: e.g. how to write the answer so the
  # reward finds it ("" = none). Episodes (env.fn) take their first prompt from the environment instead
  instruction: str = ""

  def __post_init__(self):
    if self.overlong not in OVERLONG_MODES:
      raise ValueError(f"overlong must be one of {OVERLONG_MODES}, got {self.overlong!r}.")
    if self.batch_size < 1 or self.max_prompt_len < 1:
      raise ValueError(f"Need batch_size, max_prompt_len >= 1, got batch_size={self.batch_size}, "
                       f"max_prompt_len={self.max_prompt_len}.")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}.")
    if self.source not in tasks.TASK_NAMES and not _is_file_source(self.source):
      raise ValueError(f"source {self.source!r} is neither a .jsonl/.parquet path nor a task in {tasks.TASK_NAMES}.")
    if self.task is not None and self.task.name != self.source:
      if not _is_file_source(self.source):
        raise ValueError(f"task.name {self.task.name!r} does not match source {self.source!r}: another built-in "
                         f"task needs both (--config.data.source={self.source} --config.data.task.name={self.source}); "
                         "the other data.task.* knobs keep the config's values")
      # A task config (configs/grpo_task.py) with --config.data.source=FILE: the file's rows are the prompts.
      logging.warning("data.source=%r names a data file: data.task (built-in task %r) is not used", self.source,
                      self.task.name)
      object.__setattr__(self, "task", None)

  @property
  def is_task(self) -> bool:
    return self.source in tasks.TASK_NAMES


@dataclasses.dataclass(frozen=True)
class PromptStats:
  """What loading did to the rows: kept = rows - skipped; truncated prompts are among the kept."""

  n_rows: int
  n_kept: int
  n_skipped: int
  n_truncated: int


@dataclasses.dataclass(frozen=True)
class PromptSet:
  examples: list[dict[str, Any]]  # in source order, overlong prompts already skipped or truncated
  stats: PromptStats


def _is_file_source(path: str) -> bool:
  return path.endswith((".jsonl", ".parquet"))


# ---------------------------------------------------------------------------------------------------
# Reading: (location, row) pairs; the location names file:line in every later error.


def read_jsonl(path: str) -> list[tuple[str, dict[str, Any]]]:
  """One JSON object per non-blank line."""
  rows = []
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e})") from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
      rows.append((f"{path}:{lineno}", row))
  return rows


def read_parquet(path: str) -> list[tuple[str, dict[str, Any]]]:
  """Rows of a Parquet file; row numbers are 1-based. pyarrow is imported only here."""
  import pyarrow.parquet as pq  # lazy: only Parquet sources need it

  return [(f"{path}:{i}", row) for i, row in enumerate(pq.read_table(path).to_pylist(), 1)]


def _read_rows(source: str, cfg: PromptDataConfig, split: str) -> list[tuple[str, dict[str, Any]]]:
  if source in tasks.TASK_NAMES:
    task = cfg.task or tasks.TaskConfig(name=source)
    return [(f"task:{source}[{split}]:{i}", ex) for i, ex in enumerate(tasks.make_split(task, split), 1)]
  if not os.path.exists(source):
    raise FileNotFoundError(f"No prompt file at {source}.")
  return read_parquet(source) if source.endswith(".parquet") else read_jsonl(source)


def _example(where: str, row: Mapping[str, Any], cfg: PromptDataConfig) -> dict[str, Any]:
  """The row as a batch item without ids: prompt/answer under our names, other fields as they are."""
  prompt_field, answer_field = ("prompt", "answer") if cfg.is_task else (cfg.prompt_field, cfg.answer_field)
  prompt = row.get(prompt_field)
  if not isinstance(prompt, str) or not prompt:
    raise ValueError(f"{where}: field {prompt_field!r} must be a non-empty string, got {prompt!r} "
                     f"(fields: {sorted(row)})")
  answer = "" if answer_field is None else row.get(answer_field)
  if isinstance(answer, int) and not isinstance(answer, bool):
    answer = str(answer)
  if not isinstance(answer, str):
    raise ValueError(f"{where}: field {answer_field!r} must be a string or an int, got {answer!r} "
                     f"(fields: {sorted(row)})")
  extra = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
  clash = sorted(set(extra) & set(RESERVED_FIELDS))
  if clash:
    raise ValueError(f"{where}: fields {clash} are reserved for batch items ({RESERVED_FIELDS}); rename them.")
  return {"prompt": prompt, "answer": answer, **extra}


def with_instruction(prompt: str, instruction: str) -> str:
  """The prompt as the model sees it: data.instruction after it, a blank line between ("" leaves it as it is)."""
  return f"{prompt}\n\n{instruction}" if instruction else prompt


def tokenize_rows(rows: list[tuple[str, dict[str, Any]]], cfg: PromptDataConfig, tokenizer: Tokenizer,
                  source: str | None = None) -> PromptSet:
  """Validates and tokenizes rows (read from `source`, default cfg.source); overlong prompts are
  skipped, truncated (left) or raised per cfg, and a warning says how many."""
  source = cfg.source if source is None else source
  examples, n_skipped, n_truncated = [], 0, 0
  for row_index, (where, row) in enumerate(rows):
    example = _example(where, row, cfg)
    try:
      example["prompt"].encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" is valid JSON): the tokenizer would fail unnamed
      raise ValueError(f"{where}: the prompt is not valid Unicode text ({e})") from None
    ids = tokenizer.prompt_ids(with_instruction(example["prompt"], cfg.instruction), cfg.chat_template)
    if not ids:
      raise ValueError(f"{where}: prompt encodes to no tokens")
    if len(ids) > cfg.max_prompt_len:
      if cfg.overlong == "error":
        raise ValueError(f"{where}: prompt is {len(ids)} tokens, over max_prompt_len={cfg.max_prompt_len} "
                         "(overlong='error'; use 'skip' or 'truncate' to go on)")
      if cfg.overlong == "skip":
        n_skipped += 1
        continue
      # Keep the end: it holds the question's cue ("=") and the chat template's assistant header.
      ids, n_truncated = ids[-cfg.max_prompt_len:], n_truncated + 1
    examples.append({"prompt_ids": ids, **example, "source_row": row_index})
  if not examples:
    raise ValueError(f"No prompts left from {source}: {n_skipped} of {len(rows)} rows are over "
                     f"data.max_prompt_len={cfg.max_prompt_len} tokens." if rows else f"No rows in {source}.")
  if n_skipped or n_truncated:
    what = "skipped" if n_skipped else "truncated to their last tokens"
    logging.warning("data: %d of %d prompts in %s are over data.max_prompt_len=%d tokens and were %s "
                    "(data.overlong=%r; 'truncate' keeps their end, 'error' stops)", n_skipped + n_truncated,
                    len(rows), source, cfg.max_prompt_len, what, cfg.overlong)
  stats = PromptStats(n_rows=len(rows), n_kept=len(examples), n_skipped=n_skipped, n_truncated=n_truncated)
  return PromptSet(examples=examples, stats=stats)


def load_prompts(cfg: PromptDataConfig, tokenizer: Tokenizer, split: str = "train") -> PromptSet:
  """The "train" (cfg.source) or "heldout" (cfg.eval_source, or the task's held-out split) prompts."""
  if split == "train":
    source = cfg.source
  elif split == "heldout":
    source = cfg.source if cfg.is_task and cfg.eval_source is None else cfg.eval_source
    if source is None:
      raise ValueError(f"No held-out prompts: set eval_source for file source {cfg.source!r}.")
  else:
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}.")
  rows = _read_rows(source, cfg, split)
  if not rows and cfg.is_task and source == cfg.source:
    knob = "n_train" if split == "train" else "n_heldout"
    raise ValueError(f"No {split} prompts in task {source!r}: data.task.{knob}=0 (a run trains on the one split and "
                     "evaluates on the other)")
  return tokenize_rows(rows, cfg, tokenizer, source)


# ---------------------------------------------------------------------------------------------------
# Iteration.


def _copy_batch(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
  return copy.deepcopy(items)  # the source holds one dict per row: a caller's edit must not leak into later epochs


class PromptIterator(Iterator[list[dict[str, Any]]]):
  """Endless batches of one process's shard; `get_state`/`set_state` restore the exact position."""

  def __init__(self, dataset: grain.MapDataset, layout: list[int], stats: PromptStats):
    self._it = dataset.to_iter_dataset(_READ_OPTIONS).__iter__()
    self._layout = layout  # [seed, process_index, process_count, batch_size, n_kept, SHUFFLE_VERSION]
    self.stats = stats

  def __next__(self) -> list[dict[str, Any]]:
    return next(self._it)

  def get_state(self) -> dict[str, Any]:
    return {"next_index": int(self._it.get_state()["next_index"]), "layout": list(self._layout)}

  def set_state(self, state: Mapping[str, Any]) -> None:
    names = "seed, process_index, process_count, batch_size, n_prompts, shuffle version"
    if list(state.get("layout", ())) != self._layout:
      raise ValueError(f"Iterator state is for layout [{names}] = {state.get('layout')}, but this pipeline is "
                       f"{self._layout}: resuming would read different prompts.")
    self._it.set_state({"next_index": int(state["next_index"])})


SHUFFLE_VERSION = 2  # in the iterator's layout: a state saved under another seed derivation is refused


def shuffle_seed(seed: int) -> int:
  """The seed grain shuffles with: `seed` mixed (splitmix64's finaliser), since grain seeds epoch e with
  seed + e, and seed s + 1 would then replay seed s's order one epoch later."""
  z = (seed + 0x9E3779B97F4A7C15) % 2**64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
  return (z ^ (z >> 31)) % 2**32


def make_prompt_iterator(cfg: PromptDataConfig, tokenizer: Tokenizer, *, process_index: int,
                         process_count: int) -> PromptIterator:
  """Training batches of `cfg.batch_size` prompts for this process, reshuffled each epoch, forever."""
  if not 0 <= process_index < process_count:
    raise ValueError(f"Need 0 <= process_index < process_count, got {process_index=}, {process_count=}.")
  prompts = load_prompts(cfg, tokenizer, "train")
  dataset = (grain.MapDataset.source(prompts.examples)
             .shuffle(seed=shuffle_seed(cfg.seed))
             .repeat()  # infinite; reseeds the shuffle each epoch
             [process_index::process_count]
             .batch(cfg.batch_size, batch_fn=_copy_batch))
  layout = [cfg.seed, process_index, process_count, cfg.batch_size, prompts.stats.n_kept, SHUFFLE_VERSION]
  return PromptIterator(dataset, layout, prompts.stats)


def eval_batches(cfg: PromptDataConfig, tokenizer: Tokenizer, *, process_index: int,
                 process_count: int) -> tuple[list[list[dict[str, Any]]], PromptStats]:
  """The held-out set once, in source order: this process's rows [process_index::process_count].

  Batches hold `cfg.batch_size` prompts, the last one fewer; shards differ in length by at most one
  prompt. "source_row" puts gathered results back in order.
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"Need 0 <= process_index < process_count, got {process_index=}, {process_count=}.")
  prompts = load_prompts(cfg, tokenizer, "heldout")
  shard = prompts.examples[process_index::process_count]
  batches = [shard[i:i + cfg.batch_size] for i in range(0, len(shard), cfg.batch_size)]
  return batches, prompts.stats
