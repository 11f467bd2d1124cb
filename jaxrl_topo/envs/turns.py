"""Environments driving the engine's episodes (rollout/episodes.py): the turns handler and chat rendering.

`EnvTurns` is the stream's `turns` handler for a run with `env.fn`. A model turn ends -> its text
(decoded once, for the environment only) goes to the `EnvPool` with the turns before it; the reply
comes back as the environment's observation, which is rendered with the chat template's role markers
and tokenized ONCE (`reply_ids`); those ids are what the engine appends. The model's own tokens are
never re-tokenized, so the trainer sees exactly the sampled ids.

Rendering a reply: with `messages` the conversation so far and the model's turn text X, the chat
template renders messages (with the generation prompt: what the model continued) and messages +
[assistant X, role obs] (with the generation prompt); the second must extend the first with X
(whitespace a template trims aside), and the reply is its text after X. A turn that ended with the
template's end-of-turn marker (sampled as an EOS or stop token) already holds it, so it is dropped from the reply;
a turn that ended on another special token (a base model's EOS) keeps it, and the template's marker follows.
So prompt + every turn + every reply renders, as text, to apply_chat_template of the whole
conversation (tests/test_envs.py checks ChatML/Qwen2, Qwen3 and Llama-3 style templates against
transformers), as long as the template renders earlier turns as it rendered them when they were
last (Qwen3 drops earlier turns' <think> blocks: the episode keeps the tokens it sampled).

Episode results: the return is the sum of the steps' rewards; an environment that raises, returns
garbage, dies or hangs past `timeout_s` ends its episode with finish_reason "env_error", return
`error_score`, counted in `env/errors` / `env/timeouts`; the run goes on.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np
from absl import logging

from jaxrl_topo.envs.env import checked_reset, checked_step
from jaxrl_topo.envs.env_pool import EnvPool
from jaxrl_topo.models.tokenizer import Tokenizer


def reply_text(tokenizer: Tokenizer, messages: Sequence[dict], model_text: str, obs: str, *, role: str = "user",
               ended_with: str = "") -> str:
  """The text to append after a model turn `model_text` for the observation `obs` (module docstring).
  `ended_with`: the special token the turn's last sampled token is (its text; "" for none), e.g. the EOS."""
  seen = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)  # what the model continued
  full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": model_text},
                                        {"role": role, "content": obs}], add_generation_prompt=True)
  core = model_text.strip()
  at = full.find(core, len(seen))
  if not full.startswith(seen) or at < 0 or full[len(seen):at].strip():
    raise ValueError("the chat template renders the conversation so far differently once a turn is added; "
                     "its replies cannot be appended as tokens")
  at += len(core)
  text = full[at:]
  if ended_with and text.lstrip(" \t").startswith(ended_with):  # the model already wrote the end-of-turn marker
    text = text.lstrip(" \t")[len(ended_with):]
  # Else the turn ended on a special token the template does not close turns with (another EOS id, a base
  # model's EOS, a one-token stop): the template's own marker follows it, so the turn is closed as it renders.
  return text


def reply_ids(tokenizer: Tokenizer, messages: Sequence[dict], model_text: str, obs: str, **kw) -> list[int]:
  return tokenizer.encode(reply_text(tokenizer, messages, model_text, obs, **kw))


def first_prompt(tokenizer: Tokenizer, obs: str, chat: bool) -> list[int]:
  """The episode's prompt: reset's observation as one user turn (the data pipeline's rule, data.chat_template)."""
  return tokenizer.prompt_ids(obs, chat)


@dataclasses.dataclass
class _Episode:
  example: dict
  messages: list[dict]
  texts: list[str] = dataclasses.field(default_factory=list)
  ret: float = 0.0
  info: dict = dataclasses.field(default_factory=dict)
  failed: str = ""  # "error" | "timeout" once the environment failed
  ended_with: str = ""  # the special token (its text) that ended the last model turn, e.g. an EOS; "" for none


class EnvTurns:
  """The engine's `turns` handler for one run (module docstring). `add(tag, examples, group_size)`
  before a batch's episodes start; `take(tag, samples)` for their returns once they ended."""

  def __init__(self, pool: EnvPool, tokenizer: Tokenizer, *, chat: bool = True, role: str = "user",
               error_score: float = 0.0, max_prompt_len: int | None = None, breaker=None):
    self.pool, self.tok, self.chat, self.role, self.error_score = pool, tokenizer, chat, role, error_score
    # reward_pool.CircuitBreaker over each step's episodes (runtime/rollout_side.score); None: never stops a run
    self.breaker, self.last_failure = breaker, ""
    self.max_prompt_len = max_prompt_len  # a longer reset observation keeps its last tokens (data.overlong's rule)
    self.batches: dict = {}  # tag -> (examples, group size)
    self.episodes: dict = {}  # (tag, request, sample) -> _Episode
    self._backlog: list = []  # pool results that came while waiting for resets

  def prepare(self, examples: list[dict]) -> tuple[list[dict], dict]:
    """Resets an environment per example (in the pool) and renders its observation as the prompt:
    (examples with `prompt_ids` and `env_obs`, {"env/reset_errors", "env/reset_truncated"}). A failed reset
    keeps the example's own prompt; its episode then fails at its first step (scored, counted). An observation
    over `max_prompt_len` tokens keeps its last ones, as data.overlong="truncate" does (counted)."""
    for j, ex in enumerate(examples):
      self.pool.submit(("reset", j), ex, [])
    got, why = {}, ""
    while len(got) < len(examples):
      for key, kind, payload in self.pool.poll(block=True):
        if isinstance(key, tuple) and key[0] == "reset":
          got[key[1]] = payload[0] if kind == "ok" else None
          why = why or ("" if kind == "ok" else f"{kind}: {payload}")
        else:
          self._backlog.append((key, kind, payload))
    if why:  # before (a new user's trial): only counted in metrics.jsonl, even when every reset failed
      logging.warning("environment: %d of %d resets failed (the first: %s); their episodes score %s",
                      sum(v is None for v in got.values()), len(examples), why, self.error_score)
    out, truncated = [], 0
    for j, ex in enumerate(examples):
      obs = got[j]
      ids = first_prompt(self.tok, obs, self.chat) if obs is not None else list(ex["prompt_ids"])
      if self.max_prompt_len is not None and len(ids) > self.max_prompt_len:
        ids, truncated = ids[-self.max_prompt_len :], truncated + 1
      out.append({**ex, "prompt_ids": ids, "env_obs": obs if obs is not None else ex["prompt"]})
    return out, {"env/reset_errors": sum(v is None for v in got.values()), "env/reset_truncated": truncated}

  def add(self, tag, examples: list[dict], group_size: int) -> None:
    self.batches[tag] = (examples, group_size)

  def submit(self, key, sample, turn_start: int) -> None:
    tag, r, i = key
    ep = self.episodes.get(key)
    if ep is None:
      ex = self.batches[tag][0][r]
      ep = self.episodes[key] = _Episode(ex, [{"role": "user", "content": ex["env_obs"]}])
    ep.texts.append(self.tok.decode(sample.tokens[turn_start:]))
    last = sample.tokens[-1:]  # a special token decodes to "" when specials are skipped
    ep.ended_with = self.tok.decode(last, skip_special_tokens=False) if last and not self.tok.decode(last) else ""
    self.pool.submit(key, ep.example, ep.texts)

  def poll(self, block: bool) -> list:
    results, self._backlog = self._backlog + self.pool.poll(block=block and not self._backlog), []
    replies = []
    for key, kind, payload in results:
      ep = self.episodes[key]
      if kind != "ok":
        ep.failed, ep.ret, self.last_failure = kind, self.error_score, str(payload)
        replies.append((key, None, "env_error"))
        continue
      obs, reward, done, info = payload
      ep.ret += reward
      ep.info = info
      if done:
        replies.append((key, None, "stop"))
        continue
      text = ep.texts[-1]
      try:
        ids = (reply_ids(self.tok, ep.messages, text, obs, role=self.role, ended_with=ep.ended_with)
               if self.chat else self.tok.encode(obs))  # no chat template: the observation as plain text
      except Exception:  # the template refused the conversation: the episode cannot go on
        ids = []
      if not ids:  # ... or the reply is no tokens at all (an empty observation as plain text)
        ep.failed, ep.ret = "error", self.error_score
        self.last_failure = "its observation rendered as no tokens (or the chat template refused the turn)"
        replies.append((key, None, "env_error"))
        continue
      ep.messages += [{"role": "assistant", "content": text}, {"role": self.role, "content": obs}]
      replies.append((key, ids, ""))
    return replies

  def take(self, tag, samples: list) -> tuple[np.ndarray, dict]:
    """(returns_N, info) of batch `tag`'s samples (group-major, as the stream returned them); forgets it."""
    _, G = self.batches.pop(tag)
    eps = [self.episodes.pop((tag, n // G, n % G), None) for n in range(len(samples))]
    returns = np.array([ep.ret if ep else 0.0 for ep in eps], np.float32)
    info = {"env/errors": sum(bool(ep and ep.failed == "error") for ep in eps),
            "env/timeouts": sum(bool(ep and ep.failed == "timeout") for ep in eps),
            "env/turns_mean": float(np.mean([s.turns for s in samples])),
            "env/tokens_mean": float(np.mean([len(s.tokens) for s in samples]))}
    keys = sorted({k for ep in eps if ep for k, v in ep.info.items() if isinstance(v, int | float)})
    for k in keys:
      info[f"env/{k}"] = float(np.mean([float(ep.info.get(k, 0.0)) if ep else 0.0 for ep in eps]))
    reasons = collections.Counter(s.finish_reason for s in samples)
    info.update({f"env/finish_{r}": n / len(samples) for r, n in reasons.items()})
    if info["env/errors"] or info["env/timeouts"]:  # as a failing reward function is (reward_pool.py)
      logging.warning("environment: %d of %d episodes failed (%d errors, %d timeouts; the last: %s); each scores %s",
                      info["env/errors"] + info["env/timeouts"], len(samples), info["env/errors"],
                      info["env/timeouts"], self.last_failure, self.error_score)
    return returns, info


def demonstrations(tokenizer: Tokenizer, make_env, examples: list[dict], *, chat: bool = True, role: str = "user",
                   resp_len: int, name: str = "env.fn") -> list[tuple[list[int], list[int], list[float]]]:
  """Warm-up episodes from examples' `demo_turns` (model turn texts), built exactly as rollouts are:
  (prompt ids, response ids, loss mask) with the environment's replies masked. A turn that is not a
  tool call ends with EOS. Runs the environment in-process; one that raises or returns the wrong types is a
  ValueError naming `name` (the environment) and the example."""
  out = []
  for i, ex in enumerate(examples):
    try:
      episode = _demonstration(tokenizer, make_env(), ex, chat=chat, role=role)
    except Exception as e:  # noqa: BLE001 -- the user's environment: any failure is named as its own
      raise ValueError(f"env.fn={name}: the warm-up's demonstration of example {i} ({str(ex.get('prompt', ''))[:40]!r})"
                       f" failed: {type(e).__name__}: {e}") from e
    if len(episode[1]) <= resp_len:
      out.append(episode)
  return out


def _demonstration(tokenizer: Tokenizer, env, ex: dict, *, chat: bool, role: str):
  eos = tokenizer.eos_token_ids[0]
  obs0 = checked_reset(env, ex)
  messages, ids, mask = [{"role": "user", "content": obs0}], [], []
  for text in ex["demo_turns"]:
    obs, _, done, _ = checked_step(env, text)
    turn = tokenizer.encode(text) + ([eos] if done else [])
    ids, mask = ids + turn, mask + [1.0] * len(turn)
    if done:
      break
    reply = reply_ids(tokenizer, messages, text, obs, role=role) if chat else tokenizer.encode(obs)
    messages += [{"role": "assistant", "content": text}, {"role": role, "content": obs}]
    ids, mask = ids + reply, mask + [0.0] * len(reply)
  return first_prompt(tokenizer, obs0, chat), ids, mask
