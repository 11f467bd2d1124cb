"""Tokenizer wrapper: char tokenizer round trips, transformers parity for ids and chat templates,
EOS-id precedence. transformers is the reference here and nowhere in the library."""

import datetime
import json

import pytest
import transformers

from jaxrl_topo.models import tokenizer as tk

# A Llama-3-style template (header markers, BOS, a default system turn, role check, trim, tojson,
# namespace, whitespace control) written for these tests. It exercises the jinja features whose
# whitespace handling differs most easily between two renderers.
HEADER_TEMPLATE = (
  "{{- bos_token }}{% set ns = namespace(turns=0) %}\n"
  "{% for m in messages %}\n"
  "  {% if m['role'] not in ['system', 'user', 'assistant'] %}\n"
  "    {{ raise_exception('Unknown role: ' ~ m['role']) }}\n"
  "  {% endif %}\n"
  "  {% if loop.first and m['role'] != 'system' %}\n"
  "<|start_header_id|>system<|end_header_id|>\n\nBe brief.\n"
  "    {%- if tools is not none %} Tools: {{ tools | tojson(indent=2) }}{% endif %}<|eot_id|>\n"
  "  {% endif %}\n"
  "  {% if m['role'] == 'user' %}{% set ns.turns = ns.turns + 1 %}{% endif %}\n"
  "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
  "{{ m['content'] | trim }}<|eot_id|>\n"
  "{% endfor %}\n"
  "{%- if add_generation_prompt -%}\n"
  "  <|start_header_id|>assistant<|end_header_id|> (turn {{ ns.turns }})\n\n"
  "{% endif %}"
)
HEADER_SPECIALS = ("<pad>", "<|begin_of_text|>", "<|end_of_text|>", "<unk>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>")

CHATS = {
  "no_system": [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "  4.\n"},
    {"role": "user", "content": "And 3 * 3?\n\nShow work."},
  ],
  "system": [
    {"role": "system", "content": "You add numbers.  "},
    {"role": "user", "content": "1, 2"},
    {"role": "assistant", "content": "3", "tool_calls": None},
    {"role": "user", "content": "tabs\tand {braces}"},
  ],
}
SAMPLES = ["Hello, world!", "  two  spaces\nnew line\n\n", "x<|im_start|>user\nhi<|im_end|>\n", "a . b , c ?"]


def _save(tmp_path, template, specials=tk.CHAR_SPECIAL_TOKENS, bos="<bos>", eos="<|im_end|>"):
  tok = tk.build_char_tokenizer(special_tokens=specials)
  tk.save_tokenizer_dir(tmp_path, tok, chat_template=template, bos_token=bos, eos_token=eos,
                        pad_token="<pad>", unk_token="<unk>")
  return tk.Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))


def test_char_tokenizer_round_trips_text_exactly():
  tok = tk.build_char_tokenizer()
  for text in SAMPLES + [tk.CHAR_ALPHABET]:
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
  assert tok.encode("ab c").ids == [6 + tk.CHAR_ALPHABET.index(c) for c in "ab c"]


def test_char_tokenizer_specials_have_fixed_single_ids():
  tok = tk.build_char_tokenizer()
  assert [tok.token_to_id(t) for t in tk.CHAR_SPECIAL_TOKENS] == [0, 1, 2, 3, 4, 5]
  assert tok.encode("<|im_start|>a<|im_end|><eos>").ids == [4, 6, 5, 2]
  assert tok.get_vocab_size() == 6 + 97 <= 128
  assert tok.encode("é!").ids == [3, 6 + tk.CHAR_ALPHABET.index("!")]  # unknown char -> <unk>
  assert tok.decode([4, 6, 5]) == "a"  # skip_special_tokens defaults to True in tokenizers


def test_char_tokenizer_rejects_duplicates_and_unlisted_unk():
  with pytest.raises(ValueError, match="Duplicate"):
    tk.build_char_tokenizer("abca")
  with pytest.raises(ValueError, match="unk_token"):
    tk.build_char_tokenizer(special_tokens=("<pad>",), unk_token="<unk>")


def test_saved_dir_gives_same_ids_and_text_as_transformers(tmp_path):
  ours, ref = _save(tmp_path, tk.CHATML_TEMPLATE)
  for text in SAMPLES:
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text == ref.decode(ids)
  assert ours.vocab_size == len(ref) == 103
  specials = (ours.bos_token, ours.eos_token, ours.pad_token, ours.pad_token_id)
  assert specials == ("<bos>", "<|im_end|>", "<pad>", 0)
  assert ours.eos_token_ids == (5,)  # no config files: id of the eos_token string


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_chatml_matches_transformers(tmp_path, chat, add_generation_prompt):
  ours, ref = _save(tmp_path, tk.CHATML_TEMPLATE)
  msgs, gen = CHATS[chat], add_generation_prompt
  assert ours.apply_chat_template(msgs, gen) == ref.apply_chat_template(
    msgs, tokenize=False, add_generation_prompt=gen)
  ids = ours.apply_chat_template_ids(msgs, gen)
  assert ids == ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)
  assert ids.count(4) == len(msgs) + gen  # one <|im_start|> id per turn


def test_chatml_renders_the_expected_text():
  tok = tk.Tokenizer(tok=tk.build_char_tokenizer(), chat_template=tk.CHATML_TEMPLATE)
  got = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert got == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_header_template_matches_transformers(tmp_path, chat, add_generation_prompt):
  ours, ref = _save(tmp_path, HEADER_TEMPLATE, HEADER_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>")
  msgs, gen = CHATS[chat], add_generation_prompt
  got = ours.apply_chat_template(msgs, gen)
  assert got == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
  assert got.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
  assert ("(turn 2)" in got) == add_generation_prompt


def test_header_template_text_by_hand_with_tools():
  """Pins the whitespace: trim_blocks eats the newline after each tag, lstrip_blocks the indent before it."""
  tok = tk.Tokenizer(tok=tk.build_char_tokenizer(special_tokens=HEADER_SPECIALS),
                     chat_template=HEADER_TEMPLATE, bos_token="<|begin_of_text|>")
  tools = [{"name": "add", "doc": "a<b & ü"}]
  got = tok.apply_chat_template([{"role": "user", "content": " hi "}], tools=tools)
  assert got == (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief. Tools: "
    + json.dumps(tools, indent=2, ensure_ascii=False) + "<|eot_id|>\n"
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>\n"
    "<|start_header_id|>assistant<|end_header_id|> (turn 1)\n\n")


def test_tools_render_like_transformers(tmp_path):
  ours, ref = _save(tmp_path, HEADER_TEMPLATE, HEADER_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>")
  tools = [{"type": "function", "function": {"name": "add", "description": "x < y & ü", "parameters": {}}}]
  chat = CHATS["no_system"]
  assert ours.apply_chat_template(chat, tools=tools) == ref.apply_chat_template(
    chat, tools=tools, tokenize=False, add_generation_prompt=True)


def test_none_valued_keys_are_dropped_like_transformers(tmp_path):
  """transformers drops `key: None` from messages before rendering, so `is defined` is False for them."""
  template = ("{% for m in messages %}{{ m.role }}:{{ m.content is defined }},"
              "{{ tools is defined }};{% endfor %}")
  ours, ref = _save(tmp_path, template)
  chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]
  got = ours.apply_chat_template(chat, add_generation_prompt=False)
  assert got == "user:True,True;assistant:False,True;"
  assert got == ref.apply_chat_template(chat, tokenize=False)
  assert chat[1] == {"role": "assistant", "content": None}  # the caller's messages are untouched


def test_raise_exception_gives_our_error(tmp_path):
  tok = tk.Tokenizer(tok=tk.build_char_tokenizer(), chat_template=HEADER_TEMPLATE)
  with pytest.raises(tk.TemplateError, match="Unknown role: robot"):
    tok.apply_chat_template([{"role": "robot", "content": "beep"}])
  assert issubclass(tk.TemplateError, ValueError)


def test_strftime_now_and_missing_template():
  tok = tk.Tokenizer(tok=tk.build_char_tokenizer(), chat_template="{{ strftime_now('%Y') }}")
  assert tok.apply_chat_template([{"role": "user", "content": ""}]) == str(datetime.date.today().year)
  with pytest.raises(tk.TemplateError, match="no chat template"):
    tk.Tokenizer(tok=tk.build_char_tokenizer()).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("form", ["string", "named_list"])
def test_template_from_tokenizer_config_matches_transformers(tmp_path, form):
  tk.save_tokenizer_dir(tmp_path, tk.build_char_tokenizer(), chat_template=None, bos_token="<bos>",
                        eos_token="<eos>", pad_token="<pad>")
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = tk.CHATML_TEMPLATE if form == "string" else [
    {"name": "tool_use", "template": "WRONG"}, {"name": "default", "template": tk.CHATML_TEMPLATE}]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  ours = tk.Tokenizer.from_dir(tmp_path)
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert ours.chat_template == tk.CHATML_TEMPLATE
  chat = CHATS["system"]
  want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
  assert ours.apply_chat_template(chat) == want


def test_template_list_without_default_takes_first(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
    {"chat_template": [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]}))
  assert tk.read_chat_template(str(tmp_path)) == "A"
  (tmp_path / "chat_template.jinja").write_text("FILE")
  assert tk.read_chat_template(str(tmp_path)) == "FILE"  # the .jinja file beats the config


def test_eos_ids_precedence(tmp_path):
  tk.save_tokenizer_dir(tmp_path, tk.build_char_tokenizer(), chat_template=None, bos_token="<bos>",
                        eos_token="<|im_end|>", pad_token="<pad>")
  assert tk.read_eos_token_ids(str(tmp_path)) == (5,)  # only the eos_token string
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
  assert tk.read_eos_token_ids(str(tmp_path)) == (2,)  # config.json beats the string
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))
  assert tk.read_eos_token_ids(str(tmp_path)) == (5, 2)  # generation_config.json beats config.json
  assert tk.Tokenizer.from_dir(tmp_path).eos_token_ids == (5, 2)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
  assert tk.read_eos_token_ids(str(tmp_path)) == (2,)  # an explicit null counts as absent


def test_eos_ids_empty_when_nothing_names_one(tmp_path):
  tk.save_tokenizer_dir(tmp_path, tk.build_char_tokenizer(), chat_template=None, bos_token=None,
                        eos_token=None, pad_token=None)
  assert tk.read_eos_token_ids(str(tmp_path)) == ()
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
  assert tk.read_eos_token_ids(str(tmp_path)) == ()  # named but not in the vocab


def test_special_token_dicts_in_config(tmp_path):
  tk.save_tokenizer_dir(tmp_path, tk.build_char_tokenizer(), chat_template=None, bos_token=None,
                        eos_token=None, pad_token=None)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
    {"eos_token": {"content": "<eos>", "special": True}, "bos_token": "<bos>"}))
  tok = tk.Tokenizer.from_dir(tmp_path)
  assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.eos_token_ids) == ("<bos>", "<eos>", None, (2,))


def test_special_tokens_map_is_read_like_transformers(tmp_path):
  """The older layout: tokenizer_config.json names no special tokens, special_tokens_map.json does. Before, they
  stayed None: the template rendered {{ bos_token }} and {{ eos_token }} empty and no EOS id stopped generation."""
  tk.save_tokenizer_dir(tmp_path, tk.build_char_tokenizer(), chat_template=None, bos_token=None,
                        eos_token=None, pad_token=None)
  template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
    {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}))
  (tmp_path / "special_tokens_map.json").write_text(json.dumps(
    {"bos_token": "<bos>", "eos_token": {"content": "<|im_end|>", "special": True}}))
  ours, ref = tk.Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  chat = [{"role": "user", "content": "hi"}]
  want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
  assert ours.apply_chat_template(chat, add_generation_prompt=False) == want == "<bos>user: hi<|im_end|>"
  assert ours.eos_token_ids == (ref.eos_token_id,) == (5,)


@pytest.mark.parametrize("template,message", [
    # Before: TemplateSyntaxError (the tag transformers uses to mark assistant tokens).
    ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
     {"role": "assistant", "content": "a"}),
    # Before: an earlier turn's reasoning, passed as `reasoning` or `thinking`, vanished from the prompt.
    ("{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
     "{{ m.content }}{% endfor %}", {"role": "assistant", "content": "a", "reasoning": "r"}),
    ("{% for m in messages %}[{{ m.thinking }}]{{ m.content }}{% endfor %}",
     {"role": "assistant", "content": "a", "reasoning_content": "r"}),
])
def test_generation_blocks_and_reasoning_names_render_like_transformers(tmp_path, template, message):
  tk.save_tokenizer_dir(tmp_path, tk.build_char_tokenizer(), chat_template=template, bos_token="<bos>",
                        eos_token="<eos>", pad_token="<pad>")
  want = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template([message], tokenize=False)
  assert tk.Tokenizer.from_dir(tmp_path).apply_chat_template([message], add_generation_prompt=False) == want
  assert want in ("a", "<think>r</think>a", "[r]a")


def test_missing_tokenizer_json_names_the_file(tmp_path):
  (tmp_path / "tokenizer.model").write_bytes(b"\x00")
  with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
    tk.Tokenizer.from_dir(tmp_path)
