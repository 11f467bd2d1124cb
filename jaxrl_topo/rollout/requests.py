"""What a caller asks the rollout engine for and what it gets back: `Request` (a prompt, its n samples and
their limits) and `Sample` (one finished sample), the checks a batch of requests must pass before
anything is compiled or admitted, and where a completion's stop string ends it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from jaxrl_topo.rollout.engine import RolloutEngine


MAX_STOP_IDS = 4  # per-request stop ids beyond eos_ids (static width of the device array)


@dataclasses.dataclass(frozen=True)
class Request:
  prompt_ids: Sequence[int]
  n: int = 1  # samples (a GRPO group shares the prompt's pages)
  max_new_tokens: int = 64
  stop_ids: tuple[int, ...] = ()  # extra stop tokens besides the engine's eos_ids
  stop_strings: tuple[str, ...] = ()  # stop once the completion's text contains one (needs detokenize)
  # > 0: an episode (episodes.py) of at most this many model turns; max_new_tokens then bounds every
  # token after the prompt, the model's and the environment's
  max_turns: int = 0


@dataclasses.dataclass
class Sample:
  request: int
  index: int  # which of the request's n samples
  tokens: list[int]
  logprobs: list[float]
  gen_ids: list[int]
  finish_reason: str = ""  # "stop" | "length"; episodes also "turns" (turn limit) or the environment's reason
  loss_mask: list[int] = dataclasses.field(default_factory=list)  # per token: 1 sampled, 0 appended (episodes)
  turns: int = 0  # model turns ended (episodes)


def check_requests(eng: RolloutEngine, requests: Sequence[Request]) -> None:
  """Every request must fit the engine; errors name the request, raised before any compilation."""
  e = eng.ecfg
  for r, req in enumerate(requests):
    n = len(req.prompt_ids)
    if n == 0 or req.max_new_tokens <= 0 or req.n <= 0:
      raise ValueError(f"request {r}: needs a non-empty prompt, max_new_tokens > 0 and n > 0")
    if n + req.max_new_tokens > e.max_len:
      raise ValueError(f"request {r}: prompt {n} + max_new_tokens {req.max_new_tokens} > max_len {e.max_len}")
    if req.n > e.n_slots:
      raise ValueError(f"request {r}: n={req.n} samples need as many decode slots; the engine has {e.n_slots}")
    pool = eng.pool  # a group lives in one data shard: its pages, at most its slots at once
    group_pages = -(-(n + req.max_new_tokens) // e.page_size) * min(req.n, pool.slots_per_shard)
    if group_pages > pool.pages_per_shard:
      raise ValueError(f"request {r}: its {req.n} samples can need {group_pages} pages; the pool has "
                       f"{pool.pages_per_shard}" + (" per data shard" if pool.n_shards > 1 else ""))
    if len(req.stop_ids) > MAX_STOP_IDS:
      raise ValueError(f"request {r}: at most {MAX_STOP_IDS} stop ids")
    if req.stop_strings and (eng.detokenize is None or not all(req.stop_strings)):
      raise ValueError(f"request {r}: stop strings need non-empty strings and an engine built with detokenize=")
    if req.max_turns < 0:
      raise ValueError(f"request {r}: max_turns must be >= 0 (0: a plain completion, not an episode)")
    if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= eng.cfg.vocab_size:
      raise ValueError(f"request {r}: token ids must lie in [0, {eng.cfg.vocab_size})")


def stop_string_end(tokens: list[int], start: int, stops: Sequence[str], detokenize) -> int | None:
  """Length of the shortest token prefix (> start) whose text contains a stop string, else None."""
  if not any(s in detokenize(tokens) for s in stops):
    return None
  for n in range(start + 1, len(tokens) + 1):
    text = detokenize(tokens[:n])
    if any(s in text for s in stops):
      return n
  return len(tokens)  # the stop string straddles `start` (it cannot: it was checked then); be safe
