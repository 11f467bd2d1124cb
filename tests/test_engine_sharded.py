"""The rollout engine with its KV pool split over the rollout mesh's `data` axis (device.py, kv_pool.py).

Each data shard owns n_slots/data slots and n_pages/data pages. These tests check the bytes each
device holds (from the arrays' shardings), that the compiled decode step moves no pool bytes between
devices (from its HLO), and that sharded outputs are token for token one device's under pinned
groups, preemption, stop strings and every weight-update policy.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr
from test_engine import EOS, SAMPLED, TINY, _detok, _engine, _prompts, _swap_once, _tiny_params

from jaxrl_topo.models.model import abstract_model, param_shardings
from jaxrl_topo.rollout import device
from jaxrl_topo.rollout import engine as engine_lib
from jaxrl_topo.rollout.engine import EngineConfig, Request, RolloutEngine
from jaxrl_topo.topology.rules import ROLLOUT_RULES, make_mesh

_COLLECTIVE = re.compile(r" = (.*?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


@pytest.fixture(scope="module")
def tiny():
  return _tiny_params()


def _mesh(data: int, tensor: int):
  return make_mesh({"data": data, "tensor": tensor}, jax.devices()[: data * tensor])


def _on_mesh(params, mesh):
  return jax.device_put(params, param_shardings(abstract_model(TINY)[1], mesh, ROLLOUT_RULES))


def _sharded_engine(graphdef, params, mesh, detokenize=None, **kw):
  """test_engine._engine's defaults but 8 slots; mesh=None: one device."""
  defaults = dict(n_slots=8, page_size=4, n_pages=64, max_len=64, decode_chunk=5, tail_chunk=5, sampling=SAMPLED,
                  eos_ids=EOS)
  params = params if mesh is None else _on_mesh(params, mesh)
  return RolloutEngine(graphdef, TINY, params, EngineConfig(**{**defaults, **kw}), mesh=mesh, detokenize=detokenize)


def _collectives(hlo: str) -> list[tuple[str, int, str]]:
  """(op, elements of its largest result, replica groups) of every collective in an HLO text."""
  found = []
  for line in hlo.splitlines():
    groups = re.search(r"replica_groups=(\{\{.*?\}\}|\[[^ ]*?)(?:, | |$)", line)
    if groups is None:
      continue
    op = _COLLECTIVE.search(line)
    assert op, f"a collective not understood: {line.strip()[:160]}"
    elems = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\w+\[([\d,]*)\]", op[1])]
    found.append((op[2], max(elems), groups[1]))
  return found


def _replica_groups(text: str) -> list[list[int]]:
  """HLO replica groups: `{{0,1},{2,3}}` or the iota form `[G,S]<=[dims]T(perm)`."""
  if text.startswith("{"):
    return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", text)]
  m = re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  assert m, f"replica groups {text!r}: unknown form"
  ids = np.arange(int(m[1]) * int(m[2])).reshape([int(d) for d in m[3].split(",")])
  if m[4]:
    ids = ids.transpose([int(p) for p in m[4].split(",")])
  return ids.reshape(int(m[1]), int(m[2])).tolist()


# ---------------------------------------------------------------- memory and communication


@pytest.mark.parametrize("tensor", [1, 2])
def test_kv_bytes_per_device_fall_as_data_grows(tiny, tensor):
  """64 pages, 8 slots: each device holds 64/data pages (and 2/tensor KV heads) of K and of V, and
  8/data rows of the page table; per-device KV bytes halve with every doubling of `data`."""
  graphdef, params = tiny
  L, K, H = TINY.n_layers, TINY.n_kv_heads, TINY.head_dim
  per_device = []
  for data in (1, 2, 4):
    eng = _sharded_engine(graphdef, params, _mesh(data, tensor))
    for kv in (eng.state.cache.k_LPSKH, eng.state.cache.v_LPSKH):
      local = kv.addressable_shards[0].data
      assert kv.sharding.shard_shape(kv.shape) == local.shape == (L, 64 // data, 4, K // tensor, H)
      assert {s.data.nbytes for s in kv.addressable_shards} == {local.nbytes}
    table = eng.state.cache.table_BM
    assert table.sharding.shard_shape(table.shape) == (8 // data, eng.ecfg.max_pages_per_seq)
    assert eng.pool.pages_per_shard == 64 // data and eng.pool.slots_per_shard == 8 // data
    per_device.append(2 * local.nbytes)
  whole = 2 * L * 64 * 4 * K * H * 4  # K and V, fp32
  assert per_device == [whole // (data * tensor) for data in (1, 2, 4)], per_device


@pytest.mark.parametrize("data, tensor, impl", [(4, 2, "window"), (4, 1, "window"), (4, 2, "bucketed"),
                                                (4, 1, "bucketed")])
def test_compiled_decode_step_moves_no_pool_bytes_between_devices(tiny, data, tensor, impl):
  """The compiled `generate` chunk: every collective stays inside one data shard (the tensor-parallel
  sums of the model) and is far smaller than a device's share of the pool; without `tensor`, there is
  no collective at all. An all-gather of the pool (GSPMD's answer to a gather it cannot prove local)
  would fail both. The window read (the CPU default) gathers its window inside each shard; the bucketed read
  folds tiny's 2 KV heads into the key axis (paged.py) exactly where tensor does not split them: folding
  split heads would all-gather each step's gathered K/V."""
  graphdef, params = tiny
  eng = _sharded_engine(graphdef, params, _mesh(data, tensor), impl=impl)
  assert eng.state.cache.fold_heads == (tensor == 1)
  hlo = device.generate.lower(eng._static, eng.params, eng.state, eng.key, np.zeros(data, np.int32), np.int32(5),
                              sampling=eng.sampling, capacity=5, eos_ids=EOS, pad_id=0, layout=eng.layout,
                              window_pages=4 if impl == "window" else 0).compile().as_text()
  kv = eng.state.cache.k_LPSKH
  pool_elems = int(np.prod(kv.sharding.shard_shape(kv.shape)))
  found = _collectives(hlo)
  if tensor == 1:
    assert not found, f"collectives in a decode step with nothing to share: {found}"
  for op, elems, groups in found:
    assert elems * 8 < pool_elems, f"{op} of {elems} elements moves pool-sized data ({pool_elems} per device)"
    for group in _replica_groups(groups):  # mesh devices are data-major: device i is in data shard i // tensor
      assert len({i // tensor for i in group}) == 1, f"{op} of {elems} elements crosses data shards: {group}"
  assert found or tensor == 1


@pytest.mark.parametrize("impl", ["window", "bucketed"])
def test_a_window_chunk_gathers_pages_once_not_at_every_step(tiny, impl):
  """impl "window": the compiled chunk gathers its rows' pages before its decode loop and never inside it; the
  bucketed read (the check's control) gathers every layer's pages at every step."""
  graphdef, params = tiny
  eng = _sharded_engine(graphdef, params, None, impl=impl)
  hlo = device.generate.lower(eng._static, eng.params, eng.state, eng.key, np.zeros(1, np.int32), np.int32(5),
                              sampling=eng.sampling, capacity=5, eos_ids=EOS, pad_id=0, layout=eng.layout,
                              window_pages=4 if impl == "window" else 0).compile().as_text()
  page = ",".join(str(d) for d in (1, 1, *eng.state.cache.k_LPSKH.shape[2:]))  # one (layer, page) of the pool
  gathers = [re.search(r'op_name="([^"]*)"', line)[1] for line in hlo.splitlines()
             if " gather(" in line and f"slice_sizes={{{page}}}" in line]
  in_loop = [name for name in gathers if "/while/body/" in name]
  if impl == "window":
    assert len(gathers) == 2 * TINY.n_layers and not in_loop, gathers  # K and V of each layer, once
  else:
    assert in_loop, gathers


def _subjaxprs(eqn):
  """The jaxprs an equation's params hold (a while's cond and body, a cond's branches, a pjit's or shard_map's)."""
  for v in eqn.params.values():
    for sub in v if isinstance(v, tuple) else (v,):
      if isinstance(sub, ClosedJaxpr):
        yield sub.jaxpr
      elif isinstance(sub, Jaxpr):
        yield sub


def _count(jaxpr, name: str) -> int:
  return sum((eqn.primitive.name == name) + sum(_count(sub, name) for sub in _subjaxprs(eqn)) for eqn in jaxpr.eqns)


def _decode_loops(jaxpr) -> list[int]:
  """The conditionals in the body of each while loop that runs the model (holds a dot), in program order."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "while" and _count(eqn.params["body_jaxpr"].jaxpr, "dot_general"):
      found.append(_count(eqn.params["body_jaxpr"].jaxpr, "cond"))
    else:
      found += [n for sub in _subjaxprs(eqn) for n in _decode_loops(sub)]
  return found


def test_a_window_chunk_reads_its_full_width_with_no_conditional(tiny):
  """impl "window": the chunk's steps whose bucketed width is narrower than the window read through a switch (one
  conditional a layer); the steps at the window's own width run in a second loop with none (XLA:CPU runs a
  conditional as a called computation, ~8 us a layer: most of a batch-1 step). The bucketed read (the control)
  has one loop, its conditionals in it. A window at the narrowest width allowed (EngineConfig.min_window_tokens: 64
  tokens, all 16 of a row's 4-token pages here) has no narrower steps, so its program holds the second loop only.
  Equal bits either way: test_engine_chunks' window tests."""
  graphdef, params = tiny
  loops = {}
  for name, impl, window, min_tokens in (("window", "window", 4, 0), ("bucketed", "bucketed", 0, 0),
                                         ("window at its floor", "window", 16, 64)):
    eng = _sharded_engine(graphdef, params, None, impl=impl, min_window_tokens=min_tokens)
    loops[name] = _decode_loops(jax.make_jaxpr(functools.partial(
        device.generate, eng._static, sampling=eng.sampling, capacity=5, eos_ids=EOS, pad_id=0, layout=eng.layout,
        window_pages=window))(eng.params, eng.state, eng.key, np.zeros(1, np.int32), np.int32(5)).jaxpr)
  assert loops == {"window": [TINY.n_layers, 0], "bucketed": [TINY.n_layers], "window at its floor": [0]}, loops


@pytest.mark.parametrize("data, tensor", [(1, 1), (2, 2)])
def test_compiled_prefill_and_decode_never_copy_the_pool(tiny, monkeypatch, data, tensor):
  """The programs that write the pool update it in place: no `copy` of a pool-sized buffer in the compiled
  prefill (a GRPO group: its prompt's pages and a fork's copy-on-write page) or decode chunk. Before the
  copy-on-write depended on the layers' output, XLA copied the whole pool twice in every prefill (201 ms a
  wave at 8,192 pages)."""
  graphdef, params = tiny
  eng = _sharded_engine(graphdef, params, None if data == 1 else _mesh(data, tensor))
  texts = {}

  def spying(name, fn):
    def spy(*a, **k):
      texts.setdefault(name, fn.lower(*a, **k).compile().as_text())
      return fn(*a, **k)
    return spy

  for name in ("prefill", "generate"):
    monkeypatch.setattr(engine_lib, name, spying(name, getattr(engine_lib, name)))
  eng.run([Request(p + [7, 8, 9], n=3, max_new_tokens=6) for p in _prompts(3, seed=4, max_len=6)])
  assert eng.stats["forks"] == 6 and set(texts) == {"prefill", "generate"}
  kv = eng.state.cache.k_LPSKH
  shard = ",".join(str(d) for d in kv.sharding.shard_shape(kv.shape))
  for name, hlo in texts.items():
    copies = [line.strip()[:120] for line in hlo.splitlines() if re.search(rf"= \w+\[{shard}\]\S* copy\(", line)]
    assert not copies, f"{name} copies the pool ({shard} per device): {copies}"


def test_n_pages_must_divide_over_data(tiny):
  graphdef, params = tiny
  with pytest.raises(ValueError, match=r"n_pages=30 must be a multiple of the mesh's data axis \(4\)"):
    _sharded_engine(graphdef, params, _mesh(4, 2), n_pages=30)


# ---------------------------------------------------------------- outputs equal one device's


def test_groups_pin_across_shards_and_stop_strings_cut_as_on_one_device(tiny):
  """data=4, 2 slots per shard: groups of 3 cannot start whole in any shard, so each starts 2 samples
  and forks its third from the pinned prompt in the same shard; every token, log-prob and finish is
  what one roomy device gives, and running the batch again compiles nothing new."""
  graphdef, params = tiny
  prompts = _prompts(6, seed=23, max_len=12)
  vowels = ("a", "e", "i", "o", "u")
  requests = ([Request(p, n=3, max_new_tokens=9) for p in prompts[:4]] +
              [Request(p, max_new_tokens=14, stop_strings=vowels) for p in prompts[4:]])
  want = _sharded_engine(graphdef, params, None, _detok, n_slots=16, n_pages=256).run(requests)
  eng = _sharded_engine(graphdef, params, _mesh(4, 2), _detok)
  got = eng.run(requests)
  assert [(s.tokens, s.finish_reason) for s in got] == [(s.tokens, s.finish_reason) for s in want]
  np.testing.assert_allclose(np.concatenate([s.logprobs for s in got]),
                             np.concatenate([s.logprobs for s in want]), atol=2e-5)
  assert eng.stats["pinned_groups"] >= 4 and eng.stats["prefills"] == 6
  assert any(_detok(s.tokens)[-1] in vowels and s.finish_reason == "stop" for s in got[-2:]), "no stop string hit"
  eng.pool.check()
  assert eng.pool.pins() == [] and eng.pool.stats()["used_pages"] == 0
  sizes = (engine_lib.generate._cache_size(), engine_lib.prefill._cache_size(), engine_lib.patch._cache_size())
  assert [s.tokens for s in eng.run(requests)] == [s.tokens for s in got]  # the same shapes: nothing to compile
  assert (engine_lib.generate._cache_size(), engine_lib.prefill._cache_size(),
          engine_lib.patch._cache_size()) == sizes, "steady state recompiled"


def test_preemption_within_a_shard_gives_one_devices_outputs(tiny):
  """data=2, 2 slots and 6 pages per shard, sequences of up to 6 pages: a shard runs out while the
  other may have free pages; only its own youngest are preempted, and the outputs do not change."""
  graphdef, params = tiny
  requests = [Request(p, max_new_tokens=16) for p in _prompts(8, seed=6, max_len=8)]
  want = _engine(graphdef, params, n_pages=64).run(requests)
  eng = _sharded_engine(graphdef, params, _mesh(2, 2), n_slots=4, n_pages=12, max_len=32)
  got = eng.run(requests)
  assert eng.stats["preemptions"] > 0, "the shards were meant to run out"
  assert [s.tokens for s in got] == [s.tokens for s in want]
  eng.pool.check()
  assert eng.pool.stats()["used_pages"] == 0


@pytest.mark.parametrize("policy", ["keep_kv", "finish_on_old", "abort_and_resume"])
def test_weight_updates_land_as_on_one_device(tiny, policy):
  """Each policy, swapping to other weights after chunk 1: tokens and their gen_ids equal one device's."""
  graphdef, params = tiny
  _, new = _tiny_params(seed=7)
  requests = [Request(p, max_new_tokens=12) for p in _prompts(5, seed=11)]
  want = _engine(graphdef, params, n_slots=2, eos_ids=()).run(requests, on_chunk=_swap_once(new, policy))
  mesh = _mesh(2, 2)
  eng = _sharded_engine(graphdef, params, mesh, n_slots=2, eos_ids=())
  got = eng.run(requests, on_chunk=_swap_once(_on_mesh(new, mesh), policy))
  assert [(s.tokens, s.gen_ids) for s in got] == [(s.tokens, s.gen_ids) for s in want]
  assert eng.gen_id == 1 and any(1 in s.gen_ids for s in got)


def test_update_weights_refuses_another_layout_on_the_same_devices(tiny):
  """Found by a helper's review: weights replicated over the engine's 4 devices, where the engine's own are split
  over `tensor`, passed the device check; every decode and prefill program then compiled again at the next
  chunk (steady state compiled). Now refused from the shardings, naming the leaf."""
  graphdef, params = tiny
  mesh = _mesh(2, 2)
  eng = _sharded_engine(graphdef, params, mesh)
  replicated = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  with pytest.raises(ValueError, match=r"update_weights: \['embed_tokens'\].* is laid out as .* in the new params"):
    eng.update_weights(replicated, gen_id=1)
  eng.update_weights(_on_mesh(jax.tree.map(lambda x: x * 1.01, params), mesh), gen_id=1)  # the engine's layout
  assert eng.gen_id == 1


def test_release_kv_gives_back_the_shards_and_reallocates_them_without_compiling(tiny):
  """Colocated mode frees the pool between runs: the next run gets it back, born sharded, from the
  engine's one jitted builder, and decodes the same tokens."""
  graphdef, params = tiny
  eng = _sharded_engine(graphdef, params, _mesh(2, 2))
  requests = [Request(p, n=2, max_new_tokens=6) for p in _prompts(3, seed=29)]
  first = eng.run(requests)
  old = eng.state.cache.k_LPSKH
  eng.release_kv()
  assert old.is_deleted()
  assert [s.tokens for s in eng.run(requests)] == [s.tokens for s in first]
  kv = eng.state.cache.k_LPSKH
  assert kv.sharding == old.sharding and kv.addressable_shards[0].data.shape[1] == 64 // 2
  assert eng._zero_state._cache_size() == 1, "the pool's builder compiled again"
