"""Tokenizers and chat templates read from a local Hugging Face model directory.

Why our own wrapper: the engine needs encode, decode, EOS ids and chat rendering, nothing more, and
`transformers` is a heavy, test-only dependency. We load `tokenizer.json` with the `tokenizers`
library and render chat templates in the same jinja2 sandbox, with the same settings and helpers, as
Hugging Face does, so a prompt string is byte-identical to the reference. tests/test_tokenizer.py
checks that against `transformers.AutoTokenizer`.

Only `tokenizer.json` is read: no pickles, no sentencepiece `.model` files, no remote code.

The module also builds the character-level tokenizer that the tiny models use, so tests and the
demo never need a model hub.
"""

import dataclasses
import datetime
import functools
import json
import os
import string
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Printable ASCII (letters, digits, punctuation) plus space, newline and tab: 97 characters.
CHAR_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n\t"
# Fixed ids 0..5; the ChatML markers are here so that a rendered template encodes each to one id.
CHAR_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>")

# ChatML: `<|im_start|>role\ncontent<|im_end|>\n` per message, then an open assistant turn.
CHATML_TEMPLATE = (
  "{% for message in messages %}"
  "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
  "{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TemplateError(ValueError):
  """A chat template refused its input (via `raise_exception`) or none is available."""


def _read_json(path: str) -> dict[str, Any]:
  """The parsed file, or {} if it does not exist: every config file here is optional."""
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _token_str(value: str | Mapping[str, Any] | None) -> str | None:
  """tokenizer_config.json writes special tokens as a string or an AddedToken dict with 'content'."""
  if isinstance(value, Mapping):
    return value["content"]
  return value


def read_chat_template(model_dir: str | os.PathLike) -> str | None:
  """`chat_template.jinja` if present, else tokenizer_config.json's `chat_template`, else None.

  The config value may be a list of {"name", "template"} dicts; we take "default", else the first.
  """
  path = os.path.join(model_dir, "chat_template.jinja")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  value = _read_json(os.path.join(model_dir, "tokenizer_config.json")).get("chat_template")
  if isinstance(value, list):
    named = {t["name"]: t["template"] for t in value}
    return named.get("default", value[0]["template"] if value else None)
  return value


def _as_ids(value: int | Sequence[int] | None) -> tuple[int, ...] | None:
  if value is None:
    return None
  return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def read_eos_token_ids(model_dir: str | os.PathLike, *,
                       tokenizer: tokenizers.Tokenizer | None = None) -> tuple[int, ...]:
  """EOS ids, in the order generation stops on them; () if the directory names none.

  Precedence: generation_config.json `eos_token_id` (int or list; chat models list the end-of-turn
  token there too), then config.json `eos_token_id`, then the id of tokenizer_config's `eos_token`.
  `tokenizer` saves reloading tokenizer.json for the last case.
  """
  for name in ("generation_config.json", "config.json"):
    ids = _as_ids(_read_json(os.path.join(model_dir, name)).get("eos_token_id"))
    if ids is not None:
      return ids
  eos = _special_tokens(model_dir)["eos_token"]
  if eos is None:
    return ()
  tok = tokenizer or tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
  eos_id = tok.token_to_id(eos)
  return () if eos_id is None else (eos_id,)


def _special_tokens(model_dir: str) -> dict[str, str | None]:
  """bos/eos/pad/unk token strings: tokenizer_config.json's, else special_tokens_map.json's (the older layout,
  where tokenizer_config.json names none of them)."""
  config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
  older = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
  return {k: _token_str(config.get(k)) or _token_str(older.get(k)) for k in _SPECIAL_KEYS}


def _raise_exception(message: str):
  raise TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  # jinja's own tojson escapes HTML characters (<, >, &, '); chat templates expect plain json.dumps.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it (for masks); the
  rendered text is the body's, which is all a prompt needs."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


# Names a message's reasoning arrives under; templates read the first (transformers fills it, and "thinking",
# from whichever is set).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _with_reasoning_aliases(message: dict) -> dict:
  reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
  return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _make_environment() -> ImmutableSandboxedEnvironment:
  """The Hugging Face rendering setup: templates come from the hub, so they run sandboxed and
  cannot mutate our messages; trim/lstrip_blocks and loop controls change whitespace and syntax."""
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


_ENV = _make_environment()


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
  return _ENV.from_string(template)  # compiling costs ms; every rollout prompt renders


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool, **variables: Any) -> str:
  """Renders `messages` as Hugging Face does.

  Keys whose value is None are dropped from each message (an API's `content=None`), and `tools` and
  `documents` default to None, so `is defined` tests in a template see what they see in transformers. As there,
  a message's reasoning is passed as `reasoning_content` and `thinking` whichever name it came under, and a
  `{% generation %}` block renders its body.
  """
  if not messages:
    raise TemplateError("Cannot render an empty conversation.")
  clean = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
  variables = {"tools": None, "documents": None, **variables}
  return _compile(template).render(messages=clean, add_generation_prompt=add_generation_prompt, **variables)


@dataclasses.dataclass(frozen=True, eq=False)  # identity equality: a Rust tokenizer has no value eq
class Tokenizer:
  """A `tokenizers.Tokenizer` plus the chat template, special tokens and EOS ids of its model dir."""

  tok: tokenizers.Tokenizer
  chat_template: str | None = None
  bos_token: str | None = None
  eos_token: str | None = None
  pad_token: str | None = None
  unk_token: str | None = None
  eos_token_ids: tuple[int, ...] = ()
  source: str = "<memory>"  # named in errors

  @classmethod
  def from_dir(cls, model_dir: str | os.PathLike) -> "Tokenizer":
    model_dir = os.fspath(model_dir)
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"No tokenizer.json at {path}; only the tokenizers JSON format is supported.")
    tok = tokenizers.Tokenizer.from_file(path)
    specials = _special_tokens(model_dir)
    return cls(tok=tok, chat_template=read_chat_template(model_dir), **specials,
               eos_token_ids=read_eos_token_ids(model_dir, tokenizer=tok), source=model_dir)

  @property
  def vocab_size(self) -> int:
    """Every id the tokenizer can emit, added tokens included: the embedding table needs this many rows."""
    return self.tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_token_id(self) -> int | None:
    return None if self.pad_token is None else self.token_to_id(self.pad_token)

  def token_to_id(self, token: str) -> int | None:
    return self.tok.token_to_id(token)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                          **extra: Any) -> str:
    """The prompt string; the special tokens are template variables, and `extra` overrides them."""
    if self.chat_template is None:
      raise TemplateError(f"{self.source} has no chat template: no chat_template.jinja and none in "
                          "tokenizer_config.json.")
    specials = {k: getattr(self, k) for k in _SPECIAL_KEYS if getattr(self, k) is not None}
    return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                **{**specials, **extra})

  def apply_chat_template_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                              **extra: Any) -> list[int]:
    """Token ids of the rendered prompt. No added BOS/EOS: templates write their own special tokens."""
    text = self.apply_chat_template(messages, add_generation_prompt, **extra)
    return self.encode(text, add_special_tokens=False)

  def prompt_ids(self, text: str, chat: bool) -> list[int]:
    """A prompt's ids: `text` as one user turn of the chat template (`chat`), else encoded as it is (the data
    pipeline's rule, data.chat_template; an episode's first observation follows it too)."""
    if chat:
      return self.apply_chat_template_ids([{"role": "user", "content": text}])
    return self.encode(text)


def build_char_tokenizer(alphabet: str = CHAR_ALPHABET,
                         special_tokens: Sequence[str] = CHAR_SPECIAL_TOKENS,
                         unk_token: str | None = "<unk>") -> tokenizers.Tokenizer:
  """One token per character of `alphabet`, after `special_tokens` (ids 0..len-1).

  A WordLevel model over a pre-tokenizer that isolates every character ([\\s\\S] also matches
  newlines), with a Fuse decoder that concatenates pieces, so decode(encode(s)) == s for any s over
  the alphabet, whitespace included. Specials are added tokens: they match in raw text before the
  split, so a rendered chat template encodes each marker to one id. Characters outside the alphabet
  map to `unk_token`, which must be one of the specials; with None, encoding them raises.
  """
  tokens = [*special_tokens, *alphabet]
  if len(set(tokens)) != len(tokens):
    raise ValueError(f"Duplicate tokens among specials {special_tokens} and alphabet {alphabet!r}.")
  if unk_token is not None and unk_token not in special_tokens:
    raise ValueError(f"unk_token {unk_token!r} must be one of the special tokens {special_tokens}.")
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=unk_token))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = tokenizers.decoders.Fuse()
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in special_tokens])
  return tok


def save_tokenizer_dir(path: str | os.PathLike, tok: tokenizers.Tokenizer, *, chat_template: str | None,
                       bos_token: str | None, eos_token: str | None, pad_token: str | None,
                       unk_token: str | None = None, model_max_length: int = 4096) -> None:
  """Writes a directory that both `Tokenizer.from_dir` and `transformers.AutoTokenizer` load.

  `clean_up_tokenization_spaces` is off so transformers' decode does not glue " ." into ".".
  """
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  specials = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token, "unk_token": unk_token}
  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "model_max_length": model_max_length,
    "clean_up_tokenization_spaces": False,
    **{k: v for k, v in specials.items() if v is not None},
  }
  with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  if chat_template is not None:
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
      f.write(chat_template)
