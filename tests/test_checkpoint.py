"""Checkpoint and resume (runtime/checkpoint.py): bitwise round trips onto requested shardings (8 fake CPU
devices), keep-N, async saves whose source arrays are donated right after `save`, strict mismatch errors, and
a process SIGKILLed while an async save is in flight, which must leave the previous checkpoint as the latest."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from subproc import cpu_env

import tests.train_fixtures as fx
from jaxrl_topo.runtime.checkpoint import Checkpointer, abstract_like
from jaxrl_topo.topology.rules import make_mesh
from jaxrl_topo.train.config import LossConfig, OptimConfig, TrainConfig
from jaxrl_topo.train.optim import make_optimizer
from jaxrl_topo.train.state import TrainState, create_train_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META = {"gen_id": 3, "data": {"epoch": 1, "cursor": [4, 17]}, "seed": 0, "mode": "async", "policy": None,
        "lr": 1.5e-6}


def _mesh():
  return make_mesh({"fsdp": 8})


def _tree(mesh, seed: int = 0):
  """A nested pytree of mixed dtypes, ranks and shardings (sharded, replicated, scalar)."""
  rng = np.random.RandomState(seed)
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))
  return {"w": put(rng.randn(16, 12).astype(np.float32), "fsdp"),
          "emb": put(jnp.asarray(rng.randn(8, 24), jnp.bfloat16), None, "fsdp"),
          "opt": (put(np.arange(16, dtype=np.int32), "fsdp"), {"count": put(np.int32(seed + 7))}),
          "bias": put(rng.randn(5).astype(np.float32))}


def _assert_bitwise(got, want, what: str = ""):
  got_flat, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_flat, want_def = jax.tree_util.tree_flatten(want)
  assert got_def == jax.tree.structure(want), f"{what}: {got_def} != {want_def}"
  for (path, g), w in zip(got_flat, want_flat, strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.shape == w.shape, f"{what} {jax.tree_util.keystr(path)}"
    assert g.tobytes() == w.tobytes(), f"{what}: leaf {jax.tree_util.keystr(path)} differs"


def _assert_shardings(got, abstract):
  for (path, g), a in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(abstract), strict=True):
    assert g.sharding.is_equivalent_to(a.sharding, g.ndim), f"{jax.tree_util.keystr(path)}: {g.sharding}"
    assert g.sharding == a.sharding, f"{jax.tree_util.keystr(path)}: {g.sharding} != {a.sharding}"


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_round_trip_onto_new_shardings(tmp_path, async_save):
  """Saved under one layout, restored bitwise under another (a resharding resume), meta included."""
  mesh = _mesh()
  tree = _tree(mesh)
  want = jax.device_get(tree)
  with Checkpointer(str(tmp_path), async_save=async_save) as ckpt:
    ckpt.save(5, tree, META)
  repl = NamedSharding(mesh, PartitionSpec())
  other = {"w": repl, "emb": NamedSharding(mesh, PartitionSpec("fsdp")),
           "opt": (repl, {"count": repl}), "bias": repl}
  for shardings in (jax.tree.map(lambda x: x.sharding, tree), other):
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
    ckpt = Checkpointer(str(tmp_path))
    assert ckpt.latest_step() == 5 and ckpt.all_steps() == [5]
    state, meta = ckpt.restore(None, abstract)
    ckpt.close()
    _assert_bitwise(state, want)
    _assert_shardings(state, abstract)
    assert meta == META


def test_train_state_round_trip(tmp_path):
  """A real TrainState (AdamW moments, reference copy) on {"fsdp": 8}: same type, bitwise, same shardings."""
  cfg = TrainConfig(loss=LossConfig(group_size=2, kl_coef=0.01), optim=OptimConfig(lr=1e-3, warmup_steps=2))
  tx = make_optimizer(cfg.optim)
  mesh_axes = (("fsdp", 8),)
  _, _, params, d_model, _ = fx.policy("tiny", mesh_axes)
  state = create_train_state(params, cfg, tx, d_model=d_model)
  state = state.replace(step=state.step + 3, opt_state=jax.tree.map(lambda x: x + 0.5, state.opt_state))
  assert state.ref is not None and state.frozen is None
  abstract = abstract_like(state)
  assert any(len(s.sharding.device_set) == 8 and not s.sharding.is_fully_replicated
             for s in jax.tree.leaves(abstract)), "the fixture should hold sharded leaves"
  want = jax.device_get(state)
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(3, state, {"step": 3})
  with Checkpointer(str(tmp_path)) as ckpt:
    got, meta = ckpt.restore(3, abstract)
  assert isinstance(got, TrainState) and got.frozen is None
  _assert_bitwise(got, want, "TrainState")
  _assert_shardings(got, abstract)
  assert meta == {"step": 3}


def test_async_save_lets_the_caller_donate_its_arrays(tmp_path):
  """`save` returns after the device->host copy: the train step may donate (here: delete) the state at once."""
  mesh = _mesh()
  ckpt = Checkpointer(str(tmp_path), keep=1)
  tree = _tree(mesh, seed=1)
  abstract, want = abstract_like(tree), jax.device_get(tree)
  ckpt.save(1, tree, {"s": 1})
  step = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
  tree = step(tree)  # consumes the saved arrays while the write may still run
  ckpt.save(2, tree, {"s": 2})
  want2 = jax.device_get(tree)
  jax.tree.map(lambda x: x.delete(), tree)
  ckpt.wait()
  assert ckpt.all_steps() == [2]
  got, meta = ckpt.restore(None, abstract)
  _assert_bitwise(got, want2)
  assert meta == {"s": 2}
  ckpt.close()
  np.testing.assert_array_equal(np.asarray(want2["w"]), np.asarray(want["w"]) + 1)


def test_latest_step_skips_the_save_in_flight(tmp_path, monkeypatch):
  """Orbax lists a step as soon as its async save starts (and drops the steps keep-N will delete); we do not
  until it is finalised. The in-flight window is pinned open by faking orbax's progress flag."""
  mesh = _mesh()
  ckpt = Checkpointer(str(tmp_path), keep=1)
  ckpt.save(1, _tree(mesh), {})
  ckpt.wait()
  in_progress = {"v": True}
  monkeypatch.setattr(ckpt._mngr, "is_saving_in_progress", lambda: in_progress["v"])
  ckpt.save(2, _tree(mesh, 2), {})
  assert ckpt._mngr.all_steps() == [2]  # orbax's own view: the in-flight step, step 1 already dropped
  assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
  in_progress["v"] = False
  assert ckpt.latest_step() == 2 and ckpt.all_steps() == [2]
  ckpt.close()


def test_a_read_only_reader_leaves_a_live_runs_save_in_flight_alone(tmp_path):
  """export and serving open the run's checkpoints while it trains: a writer's manager deletes tmp
  directories (an in-flight save) when it opens; a read-only one must not, and cannot save."""
  mesh = _mesh()
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(1, _tree(mesh), {"step": 1})
  in_flight = tmp_path / "2.orbax-checkpoint-tmp"  # what a save of step 2 looks like while it writes
  in_flight.mkdir()
  with Checkpointer(str(tmp_path), read_only=True) as reader:
    assert reader.latest_step() == 1 and reader.restore(None, abstract_like(_tree(mesh)))[1] == {"step": 1}
    with pytest.raises(RuntimeError, match="read-only"):
      reader.save(3, _tree(mesh), {})
  assert in_flight.is_dir()
  # A writer opening removes the tmp directory (why readers must not be one). orbax does it on a background
  # thread that only a save awaits, so wait for it here.
  Checkpointer(str(tmp_path)).close()
  deadline = time.monotonic() + 30
  while in_flight.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not in_flight.exists()


def test_keep_n(tmp_path):
  mesh = _mesh()
  tree = _tree(mesh)
  with Checkpointer(str(tmp_path), keep=2) as ckpt:
    for step in (10, 20, 30, 40):
      ckpt.save(step, tree, {"step": step})
    ckpt.wait()
    assert ckpt.all_steps() == [30, 40] and ckpt.latest_step() == 40
  assert sorted(os.listdir(tmp_path)) == ["30", "40"]
  with Checkpointer(str(tmp_path), keep=2) as ckpt:
    assert ckpt.restore(None, abstract_like(tree))[1] == {"step": 40}
    assert ckpt.restore(30, abstract_like(tree))[1] == {"step": 30}
    with pytest.raises(FileNotFoundError, match=r"step 10 .*complete steps: \[30, 40\]"):
      ckpt.restore(10, abstract_like(tree))


def test_empty_directory(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "run"))
  assert ckpt.latest_step() is None and ckpt.all_steps() == []
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "run")):
    ckpt.restore(None, {"x": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(_mesh(),
                                                                                          PartitionSpec()))})
  ckpt.close()


def _mismatches():
  def extra(a):
    return {**a, "new": a["bias"]}

  def missing(a):
    return {k: v for k, v in a.items() if k != "bias"}

  def shape(a):
    return {**a, "w": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=a["w"].sharding)}

  def dtype(a):
    return {**a, "bias": jax.ShapeDtypeStruct((5,), jnp.bfloat16, sharding=a["bias"].sharding)}

  def nested(a):
    return {**a, "opt": (a["opt"][0], {"count": a["opt"][1]["count"], "mu": a["bias"]})}

  return [(extra, r"not in the checkpoint \['new'\]"), (missing, r"not in the abstract state \['bias'\]"),
          (shape, r"leaf w is saved as \(16, 12\) float32.*wants \(16, 8\) float32"),
          (dtype, r"leaf bias is saved as \(5,\) float32.*wants \(5,\) bfloat16"), (nested, r"\['opt/1/mu'\]")]


@pytest.mark.parametrize("change,message", _mismatches(), ids=["extra", "missing", "shape", "dtype", "nested"])
def test_mismatch_names_the_leaf(tmp_path, change, message):
  tree = _tree(_mesh())
  with Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(1, tree, {})
    with pytest.raises(ValueError, match=message):
      ckpt.restore(1, change(abstract_like(tree)))


def test_usage_errors(tmp_path):
  tree = _tree(_mesh())
  with pytest.raises(ValueError, match="keep=0"):
    Checkpointer(str(tmp_path), keep=0)
  with Checkpointer(str(tmp_path)) as ckpt:
    with pytest.raises(TypeError, match="not JSON-serialisable"):
      ckpt.save(1, tree, {"x": object()})
    with pytest.raises(TypeError, match="meta must be a dict"):
      ckpt.save(1, tree, [1])
    for bad in (-1, "x", 1.5, True):  # before (a new user's trial): -1 saved (latest_step() -1), "x" failed in int()
      says = f"^Checkpointer.save: step must be an int >= 0, got {re.escape(repr(bad))}$"
      with pytest.raises(ValueError, match=says):
        ckpt.save(bad, tree, {})
    assert ckpt.latest_step() is None
    ckpt.save(2, tree, {})
    with pytest.raises(ValueError, match="step 2 <= newest checkpoint 2"):
      ckpt.save(2, tree, {})
    no_sharding = {**abstract_like(tree), "bias": jax.ShapeDtypeStruct((5,), jnp.float32)}
    with pytest.raises(ValueError, match="leaf bias .* with a sharding"):
      ckpt.restore(2, no_sharding)
  with pytest.raises(TypeError, match=r"leaf \['n'\] is a ndarray"):
    abstract_like({"n": np.zeros(3)})
  # A file, or a path under one: refused at construction (before: orbax logged a traceback from its thread, and
  # the first save failed with "[Errno 20] Not a directory").
  (tmp_path / "f.txt").write_text("x")
  with pytest.raises(NotADirectoryError, match=f"^Checkpointer: {tmp_path}/f.txt is a file; name a directory"):
    Checkpointer(str(tmp_path / "f.txt"))
  with pytest.raises(NotADirectoryError, match=f"^Checkpointer: directory={tmp_path}/f.txt/ck: {tmp_path}/f.txt is a "
                                               "file, not a directory$"):
    Checkpointer(str(tmp_path / "f.txt" / "ck"))


_KILLED_CHILD = textwrap.dedent("""
  import os, signal, sys
  import jax, numpy as np
  from jaxrl_topo.runtime.checkpoint import Checkpointer
  directory, n = sys.argv[1], int(sys.argv[2])
  ckpt = Checkpointer(directory, keep=1)  # keep=1: step 1 is also due for deletion once step 2 commits
  w = np.random.RandomState(0).randn(n).astype(np.float32)
  ckpt.save(1, {"w": jax.device_put(w), "k": jax.device_put(np.int32(1))}, {"step": 1})
  ckpt.wait()
  ckpt.save(2, {"w": jax.device_put(w + 1), "k": jax.device_put(np.int32(2))}, {"step": 2})
  print("listing at kill:", sorted(os.listdir(directory)), flush=True)
  os.kill(os.getpid(), signal.SIGKILL)  # right after the async save returned: before its commit
""")


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
  """A process SIGKILLed while an async save of a 200 MB state is in flight: step 2 never committed, step 1
  (due for keep-N deletion) is intact, `latest_step()` is 1, and the run resumes and saves step 2 again."""
  n = 50_000_000  # 200 MB of float32: its write takes far longer than the few instructions before the kill
  directory = str(tmp_path / "run")
  env = cpu_env(PYTHONPATH=REPO)  # one device is enough
  proc = subprocess.run([sys.executable, "-c", _KILLED_CHILD, directory, str(n)], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  assert "listing at kill:" in proc.stdout, proc.stderr[-3000:]
  listing = sorted(os.listdir(directory))
  assert "1" in listing and "2" not in listing, listing  # the torn step is at most a tmp directory
  assert set(listing) <= {"1", "2.orbax-checkpoint-tmp"}, listing

  device = jax.devices()[0]
  abstract = {"w": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)),
              "k": jax.ShapeDtypeStruct((), jnp.int32, sharding=jax.sharding.SingleDeviceSharding(device))}
  with Checkpointer(directory, keep=1) as ckpt:
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    state, meta = ckpt.restore(None, abstract)
    assert meta == {"step": 1} and int(state["k"]) == 1
    w = np.random.RandomState(0).randn(n).astype(np.float32)
    assert np.asarray(state["w"]).tobytes() == w.tobytes()
    del state
    ckpt.save(2, {"w": jax.device_put(w + 1, device), "k": jax.device_put(np.int32(2), device)}, {"step": 2})
  assert sorted(os.listdir(directory)) == ["2"]  # the torn tmp directory was cleaned up, step 1 pruned
  with Checkpointer(directory, keep=1) as ckpt:
    assert ckpt.all_steps() == [2]
    state, meta = ckpt.restore(None, abstract)
    assert meta == {"step": 2} and int(state["k"]) == 2
    assert np.asarray(state["w"]).tobytes() == (w + 1).tobytes()
