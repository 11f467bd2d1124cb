"""Generation: greedy parity with `transformers.generate`, and the JSONL command end to end."""

from __future__ import annotations

import json

import chex
import jax
import numpy as np
import pytest
import torch
from hf_fixtures import FAMILY_CASES, VOCAB, make_hf_model

from jaxrl_topo.models import hf_io
from jaxrl_topo.models.fresh import write_fresh_model
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.models.tokenizer import Tokenizer
from jaxrl_topo.rollout import generate
from jaxrl_topo.rollout.dense import DecodeConfig, generate_dense
from jaxrl_topo.rollout.sampling import SamplingConfig

PROMPTS = [[5, 17, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7], [90, 2, 33, 8, 61]]
MAX_NEW = 12


def _hf_greedy(model, prompt, eos):
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
  tokens = out.sequences[0, len(prompt):].tolist()
  logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=False)]
  return tokens, logprobs


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_greedy_matches_transformers_generate(family, tmp_path):
  """Token for token and log-prob for log-prob, ragged prompts batched together, one stopping early."""
  model = make_hf_model(family, seed=1)
  model.save_pretrained(str(tmp_path))
  cfg, graphdef, params = hf_io.load_model(str(tmp_path), dtype="float32")
  probe = generate.generate_ids(graphdef, params, PROMPTS, DecodeConfig(max_new_tokens=MAX_NEW), batch_size=4)
  eos = probe[0].completion_ids[3]  # prompt 0 then stops after 4 tokens: the stop path is exercised
  got = generate.generate_ids(graphdef, params, PROMPTS, DecodeConfig(max_new_tokens=MAX_NEW, eos_ids=(eos,)),
                              batch_size=4)
  assert got[0].finish_reason == "stop" and got[0].completion_ids[-1] == eos
  for prompt, completion in zip(PROMPTS, got, strict=True):
    want_tokens, want_logprobs = _hf_greedy(model, prompt, eos)
    assert completion.completion_ids == want_tokens, f"{family}: greedy tokens differ for prompt {prompt}"
    np.testing.assert_allclose(completion.logprobs, want_logprobs, atol=1e-4, rtol=0)
    assert completion.finish_reason == ("stop" if want_tokens[-1] == eos else "length")


def test_batch_size_and_slot_do_not_change_outputs(tmp_path):
  """Sampling keys come from (seed, prompt index, position): batching must not change a sample."""
  model = make_hf_model("qwen3", seed=2)
  model.save_pretrained(str(tmp_path))
  _, graphdef, params = hf_io.load_model(str(tmp_path), dtype="float32")
  decode = DecodeConfig(max_new_tokens=8, sampling=SamplingConfig(temperature=1.0, top_p=0.9))
  one = generate.generate_ids(graphdef, params, PROMPTS, decode, seed=3, batch_size=1)
  four = generate.generate_ids(graphdef, params, PROMPTS, decode, seed=3, batch_size=4)
  other_seed = generate.generate_ids(graphdef, params, PROMPTS, decode, seed=4, batch_size=4)
  assert [c.completion_ids for c in one] == [c.completion_ids for c in four]
  np.testing.assert_allclose([c.logprobs for c in one], [c.logprobs for c in four], atol=1e-5)
  assert [c.completion_ids for c in one] != [c.completion_ids for c in other_seed]


def test_stop_strings_end_completions_in_the_engine_and_in_the_dense_decoder(tmp_path, monkeypatch):
  """One character a token: a stop string of completion 0's tokens 3-4 ends it after token 4 in both decoders, as
  cutting the full completion would; the engine retires it there (fewer decoded tokens; before, generation ran to
  max_new_tokens and the launcher cut the text afterwards)."""
  model = make_hf_model("llama", seed=4)
  model.save_pretrained(str(tmp_path))
  _, graphdef, params = hf_io.load_model(str(tmp_path), dtype="float32")
  detok = lambda ids: "".join(chr(0x100 + t) for t in ids)  # noqa: E731
  decode = DecodeConfig(max_new_tokens=MAX_NEW)
  busy = []
  run = generate.RolloutEngine.run

  def counted(self, *args, **kwargs):
    out = run(self, *args, **kwargs)
    busy.append(self.stats["busy_steps"])
    return out

  monkeypatch.setattr(generate.RolloutEngine, "run", counted)
  chunks = {"decode_chunk": 2, "tail_chunk": 2, "max_chunk": 0}  # the host sees every 2 steps' tokens
  full = generate.generate_ids(graphdef, params, PROMPTS, decode, batch_size=4, engine=chunks)
  stop = detok(full[0].completion_ids[3:5])
  for impl in ("paged", "dense"):
    got = generate.generate_ids(graphdef, params, PROMPTS, decode, batch_size=4, impl=impl, stop_strings=stop,
                                detokenize=detok, engine=chunks)
    for want, c in zip(full, got, strict=True):
      n = next((k for k in range(1, len(want.completion_ids) + 1) if stop in detok(want.completion_ids[:k])), None)
      assert c.completion_ids == want.completion_ids[:n], impl
      np.testing.assert_allclose(c.logprobs, want.logprobs[:n], atol=1e-6)
      assert c.finish_reason == ("stop" if n else want.finish_reason), impl
    assert got[0].finish_reason == "stop" and len(got[0].completion_ids) <= 5
  assert busy[1] < busy[0], "the engine must stop decoding a completion at its stop string"
  with pytest.raises(ValueError, match="they need detokenize="):
    generate.generate_ids(graphdef, params, PROMPTS, decode, stop_strings=("x",))


def test_decode_compiles_once_per_bucket(tmp_path):
  model = make_hf_model("llama", seed=3)
  model.save_pretrained(str(tmp_path))
  _, graphdef, params = hf_io.load_model(str(tmp_path), dtype="float32")
  decode = DecodeConfig(max_new_tokens=4)
  rng = np.random.RandomState(0)
  generate_dense.clear_cache()
  for _ in range(3):  # new values, same shapes: the loop and the prefill must not retrace
    prompts = rng.randint(0, VOCAB, (2, 8)).astype(np.int32)
    lens = rng.randint(1, 9, 2).astype(np.int32)
    jax.block_until_ready(generate_dense(graphdef, params, prompts, lens, np.arange(2, dtype=np.int32),
                                         jax.random.key(0), decode=decode))
  assert generate_dense._cache_size() == 1


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny"))
  write_fresh_model(path, get_preset("tiny"), seed=0)
  return path


def test_generate_command_end_to_end(tiny_dir, tmp_path, monkeypatch):
  prompts = tmp_path / "in.jsonl"
  lines = [{"prompt": "What is 2 + 3?"}, {"prompt_ids": [10, 11, 12]}, {"prompt": "hi"}]
  prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
  out = tmp_path / "out.jsonl"
  rows = generate.run(tiny_dir, str(prompts), str(out), max_new_tokens=6, chat=True, batch_size=2)
  written = [json.loads(x) for x in out.read_text().splitlines()]
  assert written == rows and len(rows) == 3
  tok = Tokenizer.from_dir(tiny_dir)
  for row in rows:
    assert set(row) == {"completion_ids", "text", "logprobs", "finish_reason"}
    assert len(row["logprobs"]) == len(row["completion_ids"]) and all(lp <= 0 for lp in row["logprobs"])
    assert row["text"] == tok.decode(row["completion_ids"])
    stopped = row["completion_ids"][-1] in tok.eos_token_ids
    assert row["finish_reason"] == ("stop" if stopped else "length")
    assert stopped or len(row["completion_ids"]) == 6
  # Row order follows the input, whatever the length-sorted batching did: re-run prompt 1 alone.
  (tmp_path / "one.jsonl").write_text(json.dumps(lines[1]) + "\n")
  alone = generate.run(tiny_dir, str(tmp_path / "one.jsonl"), str(tmp_path / "o1.jsonl"), max_new_tokens=6,
                       chat=True, batch_size=2)
  assert alone[0]["completion_ids"] == rows[1]["completion_ids"]
  # The engine's window read (generate.run(read=...), the launcher's --read), its page size (--page_size) and its
  # other knobs (engine=..., the launcher's --kv_dtype, --min_pack_rows, --min_window_tokens, --decode_chunk): the
  # same tokens, log-probs to 1e-5.
  seen, engine = [], generate.RolloutEngine
  monkeypatch.setattr(generate, "RolloutEngine", lambda *a, **k: seen.append(a[3]) or engine(*a, **k))
  window = generate.run(tiny_dir, str(prompts), str(tmp_path / "w.jsonl"), max_new_tokens=6, chat=True, batch_size=2,
                        read="window", page_size=8, engine={"kv_dtype": "float32", "min_pack_rows": 4,
                                                           "min_window_tokens": 32, "decode_chunk": 4})
  # what reached the engine (its tokens alone would not show it)
  assert [(e.impl, e.kv_dtype, e.min_pack_rows, e.min_window_tokens, e.page_size, e.decode_chunk) for e in seen] == [
      ("window", "float32", 4, 32, 8, 4)]
  assert [r["completion_ids"] for r in window] == [r["completion_ids"] for r in rows]
  np.testing.assert_allclose(sum((r["logprobs"] for r in window), []), sum((r["logprobs"] for r in rows), []),
                             atol=1e-5)


def test_engine_options_are_checked_before_any_work():
  with pytest.raises(ValueError, match=r"engine options \['n_slots'\]: generation sets .*'n_slots'.* itself"):
    generate.engine_knobs({"n_slots": 4, "kv_dtype": "bfloat16"})
  with pytest.raises(ValueError, match=r"engine options \['bogus'\]: no such EngineConfig field; generation takes "):
    generate.engine_knobs({"bogus": 1})  # before: "generation sets [...] itself", as if it were one of those
  with pytest.raises(ValueError, match="min_pack_rows=1 must be >= 2"):
    generate.engine_knobs({"min_pack_rows": 1})
  with pytest.raises(ValueError, match=r"kv_dtype='int8'; expected one of"):
    generate.engine_knobs({"kv_dtype": "int8"})
  assert generate.engine_knobs(None) == {} and generate.engine_knobs({"max_chunk": 0}) == {"max_chunk": 0}
  for kw, says in ((dict(page_size=0), "page_size=0 must be positive"),
                   (dict(page_size=2.5), "page_size=2.5 must be of type int"),
                   (dict(read="bogus"), r"^read='bogus'; expected one of \('auto', 'reference', "),  # was after loading
                   (dict(max_new_tokens=0), "^max_new_tokens=0 must be positive")):
    with pytest.raises((ValueError, TypeError), match=says):  # before any file is read
      generate.run("/no/model", "/no/prompts.jsonl", "/no/out.jsonl", **kw)


def test_generate_on_a_tensor_parallel_mesh_matches_one_device(tiny_dir, tmp_path):
  prompts = tmp_path / "in.jsonl"
  prompts.write_text("".join(json.dumps({"prompt_ids": list(range(3, 3 + n))}) + "\n" for n in (3, 9, 5, 1)))
  single = generate.run(tiny_dir, str(prompts), str(tmp_path / "a.jsonl"), max_new_tokens=5, batch_size=4)
  sharded = generate.run(tiny_dir, str(prompts), str(tmp_path / "b.jsonl"), max_new_tokens=5, batch_size=4,
                         data=2, tensor=2)
  assert [r["completion_ids"] for r in single] == [r["completion_ids"] for r in sharded]
  chex.assert_trees_all_close([r["logprobs"] for r in single], [r["logprobs"] for r in sharded], atol=1e-5)


@pytest.mark.parametrize("line, message", [
    ('{"text": "x"}', "exactly one of"),
    ('{"prompt": "x", "prompt_ids": [1]}', "exactly one of"),
    ('{"prompt_ids": [1, "a"]}', "list of ints"),
    ('{"prompt_ids": []}', "empty prompt"),
    ("not json", "not valid JSON"),
    ('\n{"prompt": "y"}', "a blank line between prompts"),  # before: skipped, so output line 2 answered line 3
])
def test_bad_prompt_lines_name_the_line(tiny_dir, tmp_path, line, message):
  prompts = tmp_path / "in.jsonl"
  prompts.write_text('{"prompt": "ok"}\n' + line + "\n")
  with pytest.raises(ValueError, match=f"in.jsonl:2: .*{message}"):
    generate.run(tiny_dir, str(prompts), str(tmp_path / "out.jsonl"), max_new_tokens=2)


def test_out_of_vocab_prompt_ids_are_refused(tiny_dir, tmp_path):
  prompts = tmp_path / "in.jsonl"
  prompts.write_text('{"prompt_ids": [1, 500]}\n')
  with pytest.raises(ValueError, match=r"in.jsonl:1: prompt_ids holds 500; token ids must lie in \[0, 128\)"):
    generate.run(tiny_dir, str(prompts), str(tmp_path / "out.jsonl"), max_new_tokens=2)
