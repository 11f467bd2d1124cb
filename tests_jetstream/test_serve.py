"""JetStream serving (issue 16): our engine behind JetStream's orchestrator and gRPC server, queried
with JetStream's own client (jetstream_pb2_grpc).

One tiny random-init model directory (char tokenizer) and one in-process server for the module;
`launchers/serve.py` as a user starts it (a subprocess) for start-up errors and shutdown.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

from jaxrl_topo import cli
from jaxrl_topo.models import hf_io
from jaxrl_topo.models.fresh import write_fresh_model
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.rollout.engine import EngineConfig, Request, RolloutEngine
from jaxrl_topo.serving import client, server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_NEW = 12
TINY = dataclasses.replace(get_preset("tiny"), tie_embeddings=False)  # untied: greedy answers depend on the weights
SC = server.ServeConfig(slots=8, max_len=128, max_new_tokens=MAX_NEW, decode_chunk=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("model"))
  write_fresh_model(out, TINY, seed=0)
  return out


@pytest.fixture(scope="module")
def served(model_dir):
  js_engine, tokenizer = server.build_engine(model_dir, SC)
  port = cli.free_port()
  srv = server.start(js_engine, port)
  channel = grpc.insecure_channel(f"localhost:{port}")
  grpc.channel_ready_future(channel).result(timeout=30)
  yield js_engine, tokenizer, jetstream_pb2_grpc.OrchestratorStub(channel)
  channel.close()
  srv.stop()


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, min(vocab, 60), size=int(rng.integers(3, 20))).tolist() for _ in range(n)]


def _ask(stub, ids, max_tokens=MAX_NEW) -> list[int]:
  return client.decode_ids(stub, ids, max_tokens, timeout_s=120)


def _reference(js_engine, params, prompts, max_new: int = MAX_NEW) -> list[list[int]]:
  """Our engine's own greedy run (RolloutEngine.run, one slot: each prompt alone), EOS cut as JetStream does."""
  e = js_engine.engine
  ecfg = EngineConfig(n_slots=1, page_size=e.ecfg.page_size, n_pages=e.ecfg.n_pages, max_len=e.ecfg.max_len,
                      eos_ids=e.ecfg.eos_ids, pad_id=e.ecfg.pad_id)
  ref = RolloutEngine(e.graphdef, e.cfg, params, ecfg)
  out = []
  for p in prompts:
    toks = ref.run([Request(p, max_new_tokens=max_new)])[0].tokens
    out.append([t for t in toks if t not in e.ecfg.eos_ids])
  return out


def test_greedy_request_equals_the_engine(served):
  js_engine, _, stub = served
  prompts = _prompts(3, js_engine.engine.cfg.vocab_size)
  want = _reference(js_engine, js_engine.engine.params, prompts)
  got = [_ask(stub, p) for p in prompts]
  assert got == want
  assert any(len(w) == MAX_NEW for w in want), "some answer should run to max_tokens"


def test_sixteen_concurrent_requests_each_equal_one_at_a_time(served):
  js_engine, _, stub = served
  prompts = _prompts(16, js_engine.engine.cfg.vocab_size, seed=1)
  want = _reference(js_engine, js_engine.engine.params, prompts)
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    got = list(pool.map(lambda p: _ask(stub, p), prompts))
  assert got == want  # 16 requests over 8 slots: every one answered, in any interleaving, as if alone


def test_text_request_and_max_tokens(served):
  js_engine, tokenizer, stub = served
  req = jetstream_pb2.DecodeRequest(text_content=jetstream_pb2.DecodeRequest.TextContent(text="abc"), max_tokens=5)
  resps = list(stub.Decode(req, timeout=120))
  ids = [t for r in resps for t in r.stream_content.samples[0].token_ids]
  text = "".join(r.stream_content.samples[0].text for r in resps)
  want = _reference(js_engine, js_engine.engine.params, [tokenizer.encode("abc", add_special_tokens=True)])[0][:5]
  assert ids == want and len(ids) <= 5
  assert text == tokenizer.decode(ids)


def test_malformed_requests_get_an_error_and_the_server_keeps_serving(served):
  js_engine, _, stub = served
  with pytest.raises(grpc.RpcError):  # no content at all
    list(stub.Decode(jetstream_pb2.DecodeRequest(max_tokens=4), timeout=60))
  assert _ask(stub, [10**6, 5]) == []  # ids outside the vocabulary: ended at once, with no tokens
  assert any("outside the vocabulary" in (r["error"] or "") for r in js_engine.finished)
  p = _prompts(1, js_engine.engine.cfg.vocab_size, seed=2)
  assert _ask(stub, p[0]) == _reference(js_engine, js_engine.engine.params, p)[0]


@pytest.mark.parametrize("policy", ["finish_on_old", "abort_and_resume"])
def test_hot_weight_swap_under_load(model_dir, policy, tmp_path):
  """Weights swapped while 16 requests stream: every response is one version's greedy answer
  finish_on_old: each response is one version's greedy answer, its tokens all of one gen_id, and both
  versions answer some; abort_and_resume: a request caught mid-answer keeps what was sent and continues
  as the new weights answer prompt + sent tokens."""
  js_engine, _ = server.build_engine(model_dir, server.ServeConfig(**{**SC.__dict__, "policy": policy}))
  old = js_engine.engine.params
  other = str(tmp_path / "other")
  write_fresh_model(other, TINY, seed=1)  # a clearly different policy, same shapes
  new = hf_io.load_model(other, dtype=SC.dtype)[2]
  port = cli.free_port()
  srv = server.start(js_engine, port)
  try:
    stub = client.connect(port)
    prompts = _prompts(16, js_engine.engine.cfg.vocab_size, seed=3)
    want_old, want_new = _reference(js_engine, old, prompts), _reference(js_engine, new, prompts)
    differ = sum(a != b for a, b in zip(want_old, want_new, strict=True))
    assert differ >= 12, f"the versions must answer differently: {want_old} {want_new}"
    swapped, report = threading.Event(), js_engine._report

    def report_then_swap(state):  # the swap arrives while a request is mid-answer (4 tokens sent), every run
      out = report(state)
      if not swapped.is_set() and any(len(r.reported) >= 4 and not r.done for r in state.by_slot.values()):
        js_engine.swap_weights(new, gen_id=1)
        swapped.set()
      return out

    js_engine._report = report_then_swap
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
      futs = [pool.submit(_ask, stub, p) for p in prompts[:8]]
      assert swapped.wait(timeout=120)
      futs += [pool.submit(_ask, stub, p) for p in prompts[8:]]
      got = [f.result() for f in futs]
  finally:
    srv.stop()
  versions = [("old" if g == o else "new" if g == n else None) for g, o, n in zip(got, want_old, want_new,
                                                                                     strict=True)]
  if policy == "finish_on_old":
    assert None not in versions, f"a response mixed versions: {versions}"
    rows = [r for r in js_engine.finished if r["error"] is None]
    assert all(len(set(r["gen_ids"])) == 1 for r in rows), "a request's tokens came from two versions"
    assert "old" in versions and "new" in versions, versions
  else:  # abort_and_resume: what was sent stays; the rest is the new weights' answer to prompt + what was sent
    resumed = continued = 0
    for r in (r for r in js_engine.finished if r["error"] is None):
      k = r["gen_ids"].index(1) if 1 in r["gen_ids"] else len(r["gen_ids"])
      if 0 < k < len(r["tokens"]):
        resumed += 1
        cont = _reference(js_engine, new, [r["prompt"] + r["tokens"][:k]], max_new=MAX_NEW - k)[0]
        sent = [t for t in r["tokens"][k:] if t not in js_engine.engine.ecfg.eos_ids]  # JetStream drops EOS
        assert sent == cont[: len(sent)], r
        continued += bool(sent)
    assert resumed and continued, f"{resumed} requests caught mid-answer, {continued} continued past the swap"
    assert all(v == "new" for v in versions[8:]), f"requests sent after the swap must be answered by it: {versions}"


def test_the_decode_read_is_a_serve_config_key(model_dir, served):
  """ServeConfig.read (launchers/serve.py --read): the engine decodes through it, and greedy answers equal the
  default read's; an unknown read is refused before anything loads."""
  one_device, _, _ = served
  js_engine, _ = server.build_engine(model_dir, dataclasses.replace(SC, read="bucketed"))
  assert js_engine.engine.impl == "bucketed" and one_device.engine.impl == "window"
  port = cli.free_port()
  srv = server.start(js_engine, port)
  try:
    stub = client.connect(port)
    prompts = _prompts(4, js_engine.engine.cfg.vocab_size, seed=5)
    got = [_ask(stub, p) for p in prompts]
  finally:
    srv.stop()
  assert got == _reference(one_device, one_device.engine.params, prompts)
  with pytest.raises(ValueError, match="read='paged'"):
    server.ServeConfig(read="paged")


def test_the_engine_knobs_are_serve_config_keys(model_dir):
  """ServeConfig.engine (launchers/serve.py --kv_dtype, --min_pack_rows, --min_window_tokens) reaches the engine;
  what build_engine sets itself, or a bad value, is refused before anything loads."""
  knobs = {"kv_dtype": "bfloat16", "min_pack_rows": 4, "min_window_tokens": 32}
  js_engine, _ = server.build_engine(model_dir, dataclasses.replace(SC, engine=knobs, greedy=False, top_k=5,
                                                                    page_size=8))  # --page_size=8
  e = js_engine.engine
  assert (e.ecfg.kv_dtype, e.ecfg.min_pack_rows, e.ecfg.min_window_tokens, e.ecfg.page_size) == ("bfloat16", 4, 32, 8)
  assert (e.ecfg.sampling.greedy, e.ecfg.sampling.top_k) == (False, 5)  # --nogreedy --top_k=5
  assert e.state.cache.k_LPSKH.dtype == jnp.bfloat16 and e.cfg.dtype == "float32"
  hash(dataclasses.replace(SC, engine=knobs))  # a frozen config stays hashable
  with pytest.raises(ValueError, match=r"engine options \['n_slots'\]: serving sets"):
    server.ServeConfig(engine={"n_slots": 4})
  with pytest.raises(ValueError, match="min_pack_rows=1 must be >= 2"):
    server.ServeConfig(engine={"min_pack_rows": 1})
  with pytest.raises(ValueError, match="page_size=1024 exceeds the model's position limit 512"):  # before the load
    server.build_engine(model_dir, dataclasses.replace(SC, page_size=1024, max_len=2048))


def test_launcher_errors_and_clean_shutdown(model_dir, tmp_path):
  launcher = [sys.executable, os.path.join(ROOT, "launchers", "serve.py")]
  r = subprocess.run([*launcher, f"--model={tmp_path / 'nope'}"], capture_output=True, text=True, timeout=120)
  assert r.returncode != 0 and "no config.json" in r.stderr + r.stdout
  port = cli.free_port()
  log = open(tmp_path / "server.log", "w+")  # noqa: SIM115 - a file, not a pipe nobody reads while it serves
  proc = subprocess.Popen([*launcher, f"--model={model_dir}", f"--port={port}", "--slots=4", "--max_len=64",
                           "--read=bucketed"], stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)

  def output() -> str:
    log.seek(0)
    return log.read()[-3000:]

  try:
    stub = client.connect(port)
    client.wait_live(stub, proc=proc, log=log, timeout_s=180)
    assert len(_ask(stub, [5, 6, 7], max_tokens=4)) <= 4
    assert "decode read bucketed" in output()  # --read reaches the engine
    busy = subprocess.run([*launcher, f"--model={model_dir}", f"--port={port}"], capture_output=True, text=True,
                          timeout=180)
    assert busy.returncode != 0 and f"--port={port} is busy" in busy.stderr + busy.stdout
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, output()
    assert "server stopped" in output()
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
  assert left.stdout.strip() == "", f"processes left behind: {left.stdout}"


def test_workdir_serves_the_runs_newest_checkpoint(tmp_path):
  """--workdir: a 2-step GRPO run's last checkpoint, exported and served; its answers are the engine's
  greedy answers under the checkpoint's weights (not the run's initial ones). The run then trains on
  while served, and follow_run swaps its next checkpoint in."""
  from jaxrl_topo.runtime import run as run_lib
  from jaxrl_topo.runtime.config import config_from_file, from_config_dict

  c = config_from_file(os.path.join(ROOT, "configs", "grpo_task.py"), "tiny")
  c.run.update(dict(steps=2, sft_steps=20, sft_target_accuracy=0.0, eval_every=0, tensorboard=False, plot=False,
                    checkpoint_every=2))
  c.reward.n_workers = 0
  work = str(tmp_path / "run")
  run_lib.save_config(c, work)  # as launchers/train.py does
  run_lib.train(from_config_dict(c), work, progress=False)
  model_dir = server.resolve_model_dir(None, work)
  # Its own export directory per server process: two servers of one run never write the same files.
  assert model_dir == server.export_dir(work) == os.path.join(work, "serve_hf", str(os.getpid()))
  assert os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
  js_engine, tokenizer = server.build_engine(model_dir, SC)
  trained = hf_io.load_model(model_dir, dtype="float32")[2]
  init = hf_io.load_model(os.path.join(work, "init_model"), dtype="float32")[2]
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(init), strict=True))
  port = cli.free_port()
  srv = server.start(js_engine, port)
  stop = threading.Event()
  try:
    stub = client.connect(port)
    prompt = tokenizer.encode("reverse: abc", add_special_tokens=True)
    assert _ask(stub, prompt) == _reference(js_engine, trained, [prompt])[0]
    # The run goes on while it is served: --follow_s swaps its step-4 checkpoint in (gen_id 4).
    follower = threading.Thread(target=server.follow_run, args=(js_engine, work, SC, stop),
                                kwargs=dict(every_s=0.2, served_step=2))
    follower.start()
    c.run.steps = 4
    run_lib.save_config(c, work)
    run_lib.train(from_config_dict(c), work, progress=False)
    deadline = time.time() + 120
    while js_engine._pending is None and js_engine.engine.gen_id != 4:
      assert time.time() < deadline, "the step-4 checkpoint was never swapped in"
      time.sleep(0.1)
    step4 = hf_io.load_model(model_dir, dtype="float32")[2]  # serve_hf/<pid>/ now holds step 4
    assert _ask(stub, prompt) == _reference(js_engine, step4, [prompt])[0]
    assert js_engine.engine.gen_id == 4 and js_engine.finished[-1]["gen_ids"][0] == 4
  finally:
    stop.set()
    srv.stop()
  with pytest.raises(ValueError, match="exactly one of"):
    server.resolve_model_dir(model_dir, work)


def test_a_sharded_rollout_mesh_serves_the_same_tokens(model_dir, served):
  """--data=2 --tensor=2: slots split over data, KV heads over tensor; the same answers as one device."""
  one_device, _, _ = served
  js_engine, _ = server.build_engine(model_dir, dataclasses.replace(SC, data=2, tensor=2))
  assert js_engine.mesh.shape == {"data": 2, "tensor": 2}
  port = cli.free_port()
  srv = server.start(js_engine, port)
  try:
    stub = client.connect(port)
    prompts = _prompts(8, js_engine.engine.cfg.vocab_size, seed=4)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      got = list(pool.map(lambda p: _ask(stub, p), prompts))
  finally:
    srv.stop()
  assert got == _reference(one_device, one_device.engine.params, prompts)


def _non_loopback_ipv4() -> str:
  """An address of this host other than 127.0.0.1 where there is one (JetStream binds all interfaces)."""
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      s.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks the outgoing interface
      return s.getsockname()[0]
  except OSError:
    return "127.0.0.1"


def test_a_taken_port_is_an_error_even_when_taken_after_the_check(model_dir, monkeypatch):
  """check_port sees a holder on any interface (JetStream binds [::]); a port taken between the check
  and JetStream's bind is an OSError, and JetStream's threads (some not daemons) do not outlive it."""
  with socket.socket() as holder:
    holder.bind((_non_loopback_ipv4(), 0))
    holder.listen()
    port = holder.getsockname()[1]
    with pytest.raises(OSError, match=f"--port={port} is busy"):
      server.check_port(port)
    with pytest.raises(ValueError, match="1-65535"):
      server.check_port(0)
    monkeypatch.setattr(server, "check_port", lambda port: None)  # the race: taken after the check
    js_engine, _ = server.build_engine(model_dir, dataclasses.replace(SC, slots=2))
    before = set(threading.enumerate())
    with pytest.raises(OSError, match="could not bind"):
      server.start(js_engine, port)
  left = [t.name for t in set(threading.enumerate()) - before if t.is_alive() and not t.daemon]
  assert not left, f"JetStream threads left running (the process could not exit): {left}"
