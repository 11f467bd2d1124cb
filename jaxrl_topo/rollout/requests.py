"""What a caller asks the rollout engine for and what it gets back: `Request` (a prompt, its n samples and
their limits) and `Sample` (one finished sample), the checks a batch of requests must pass before
anything is compiled or admitted, and where a completion's stop string ends it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from jaxrl_topo.rollout.engine import RolloutEngine


MAX_STOP_IDS = 4  # per-request stop ids beyond eos_ids (static width of the device array)


@dataclasses.dataclass(frozen=True)
class Request:
  """A prompt and how to sample it.

  prompt_ids: the prompt's token ids, a sequence of ints [T]. n: samples drawn from it (a GRPO group: they share
  the prompt's pages). max_new_tokens: the most tokens each sample generates. stop_ids: tokens that end a sample
  besides EngineConfig.eos_ids (at most MAX_STOP_IDS; one int is read as one id). stop_strings: a sample ends once
  its text contains one (needs an engine with detokenize=); one str is one stop string, not one per character.
  max_turns > 0: an episode (episodes.py) of at most this many model turns; max_new_tokens then bounds every token
  after the prompt, the model's and the environment's."""

  prompt_ids: Sequence[int]
  n: int = 1
  max_new_tokens: int = 64
  stop_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()
  max_turns: int = 0

  def __post_init__(self):
    ids = None if isinstance(self.prompt_ids, str) else np.asarray(self.prompt_ids)
    if ids is None or ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
      raise ValueError(f"Request.prompt_ids must be a sequence of ints (token ids), got "
                       f"{type(self.prompt_ids).__name__} {str(self.prompt_ids)[:40]!r}")
    stops = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
    if not all(isinstance(s, str) for s in stops):
      raise ValueError(f"Request.stop_strings must be a str or a sequence of str, got {self.stop_strings!r}")
    object.__setattr__(self, "stop_strings", stops)
    object.__setattr__(self, "stop_ids", token_ids(self.stop_ids, "Request.stop_ids"))
    for name in ("n", "max_new_tokens", "max_turns"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"Request.{name} must be an int, got {type(value).__name__} {value!r}")
      object.__setattr__(self, name, int(value))


@dataclasses.dataclass
class Sample:
  """One finished sample: the `index`-th of the n samples of request `request` (its place in the batch).

  tokens [L]: the completion's token ids, the stop token included when one ended it (a stop string cuts right after
  the token that completed it). logprobs [L]: each token's log-probability under the sampler,
  log_softmax(logits / temperature)[token] over the full vocabulary, temperature 1 when greedy (rollout/sampling.py).
  gen_ids [L]: the weights version (RolloutEngine.update_weights) each token was sampled under. finish_reason:
  "stop" (an eos id, a stop id or a stop string) or "length" (max_new_tokens reached); episodes also "turns"
  (max_turns) or the environment's own reason. loss_mask [L]: 1 sampled, 0 appended by the environment (episodes).
  turns: model turns ended (episodes)."""

  request: int
  index: int
  tokens: list[int]
  logprobs: list[float]
  gen_ids: list[int]
  finish_reason: str = ""
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  turns: int = 0


def token_ids(value, where: str) -> tuple[int, ...]:
  """`value` (a token id, or a sequence of them) as a tuple of ints; anything else is a ValueError naming `where`."""
  ids = (value,) if isinstance(value, int | np.integer) else value
  if isinstance(ids, str) or not isinstance(ids, Sequence | np.ndarray) or not all(
      isinstance(i, int | np.integer) and not isinstance(i, bool) for i in ids):
    raise ValueError(f"{where}={value!r} must be a token id or a sequence of token ids (ints)")
  return tuple(int(i) for i in ids)


def check_requests(eng: RolloutEngine, requests: Sequence[Request]) -> None:
  """Every request must fit the engine; errors name the request, raised before any compilation."""
  e = eng.ecfg
  for r, req in enumerate(requests):
    n = len(req.prompt_ids)
    if n == 0 or req.max_new_tokens <= 0 or req.n <= 0:
      raise ValueError(f"request {r}: needs a non-empty prompt, max_new_tokens > 0 and n > 0")
    if n + req.max_new_tokens > e.max_len:
      raise ValueError(f"request {r}: prompt {n} + max_new_tokens {req.max_new_tokens} > max_len {e.max_len}")
    limit = getattr(eng.cfg, "max_position", None)  # max_len may round the limit up to a page (check_fits_model)
    if limit and n + req.max_new_tokens > limit:
      raise ValueError(f"request {r}: prompt {n} + max_new_tokens {req.max_new_tokens} > the model's position limit "
                       f"{limit} (max_position_embeddings)")
    if req.n > e.n_slots:
      raise ValueError(f"request {r}: n={req.n} samples need as many decode slots; the engine has {e.n_slots}")
    pool = eng.pool  # a group lives in one data shard: its pages, at most its slots at once
    group_pages = -(-(n + req.max_new_tokens) // e.page_size) * min(req.n, pool.slots_per_shard)
    if group_pages > pool.pages_per_shard:
      raise ValueError(f"request {r}: its {req.n} samples can need {group_pages} pages; the pool has "
                       f"{pool.pages_per_shard}" + (" per data shard" if pool.n_shards > 1 else ""))
    if len(req.stop_ids) > MAX_STOP_IDS:
      raise ValueError(f"request {r}: at most {MAX_STOP_IDS} stop ids")
    if req.stop_strings and not all(req.stop_strings):
      raise ValueError(f"request {r}: an empty stop string would stop every sample at once: give non-empty ones")
    if req.stop_strings and eng.detokenize is None:
      raise ValueError(f"request {r}: stop strings need an engine built with detokenize= (token ids -> text)")
    if req.max_turns < 0:
      raise ValueError(f"request {r}: max_turns must be >= 0 (0: a plain completion, not an episode)")
    if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= eng.cfg.vocab_size:
      raise ValueError(f"request {r}: token ids must lie in [0, {eng.cfg.vocab_size})")
    if any(not 0 <= i < eng.cfg.vocab_size for i in req.stop_ids):
      raise ValueError(f"request {r}: stop_ids {req.stop_ids} must lie in [0, {eng.cfg.vocab_size}) (the model's "
                       "vocabulary): an id outside it is never sampled")


def stop_string_end(tokens: list[int], start: int, stops: Sequence[str], detokenize) -> int | None:
  """Length of the shortest token prefix (> start) whose text contains a stop string, else None."""
  if not any(s in detokenize(tokens) for s in stops):
    return None
  for n in range(start + 1, len(tokens) + 1):
    text = detokenize(tokens[:n])
    if any(s in text for s in stops):
      return n
  return len(tokens)  # the stop string straddles `start` (it cannot: it was checked then); be safe
