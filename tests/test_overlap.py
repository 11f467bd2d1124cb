"""Overlap evidence that can fail (runtime/watch.py), and async weights that land when ready.

A train step is made slow on its devices: an extra output spins about SLOW_S on a trainer device after
the step, so the step's outputs complete that much later. The "train" span ends when a watcher thread saw the
outputs complete (not at the next host check), and `perf/overlap_tokens` counts the rollout tokens of
decode chunks that were dispatched and read entirely inside [dispatch, device completion].
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import pytest

from jaxrl_topo.runtime import experiment, loop
from tests.test_loop_sync import _cfg

SLOW_S = 1.0


@functools.cache
def _spin(device):
  """(spin(seed, n): n dependent 64x64 matmuls after `seed` is ready, on seed's device; iterations/s).
  A matmul, not scalar work: the CPU client runs programs without one inline, at dispatch."""
  def body(seed, n):
    x = jnp.full((64, 64), 1 / 64, jnp.float32) + 0 * seed.astype(jnp.float32)
    return jax.lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ a), x)[0, 0]

  spin, seed = jax.jit(body), jax.device_put(jnp.float32(0), device)
  spin(seed, 1).block_until_ready()
  t = time.perf_counter()
  spin(seed, 2000).block_until_ready()
  return spin, 2000 / (time.perf_counter() - t)


def _slow_step(exp, seconds: float = SLOW_S) -> None:
  """The train step's outputs complete about `seconds` after the step itself: an extra output computed
  on one trainer device from the step's metrics (a host callback would make CPU dispatch synchronous)."""
  real, device = exp.step_fn, exp.topology.trainer.devices.flat[0]
  spin, rate = _spin(device)

  def step(state, batch):
    state, metrics = real(state, batch)
    seed = jax.device_put(jax.tree.leaves(metrics)[0], device)
    return state, {**metrics, "_slow": spin(seed, int(seconds * rate))}

  exp.step_fn = step


def _slow_chunks(exp, seconds: float) -> None:
  """Every decode chunk of a training rollout takes `seconds` longer (a long rollout, on the host)."""
  real = exp.engine.stream

  def stream(on_chunk=None, *args, **kw):  # engine.run opens a stream too
    if on_chunk is None:
      return real(None, *args, **kw)
    return real(lambda eng: (time.sleep(seconds), on_chunk(eng)), *args, **kw)

  exp.engine.stream = stream


def _run(mode: str, workdir, steps: int = 3, chunk_s: float = 0.0, slow_s: float = SLOW_S, **kw):
  eta = {"colocated": 0, "disaggregated": 1, "async": 2}[mode]
  cfg = _cfg(steps, mode, **{"run.max_staleness": eta, "rollout.decode_chunk": 1, **kw})
  exp = experiment.build(cfg, str(workdir))
  records, spans = [], []
  try:
    _slow_step(exp, slow_s)
    if chunk_s:
      _slow_chunks(exp, chunk_s)
    loop.train_loop(exp, hooks=loop.LoopHooks(on_step=lambda step, m: records.append(m), on_span=spans.append))
  finally:
    exp.close()
  return records, spans


@pytest.mark.parametrize("mode", ["disaggregated", "async"])
def test_rollout_tokens_are_generated_while_a_slow_train_step_runs(mode, tmp_path):
  records, spans = _run(mode, tmp_path)
  train = [s for s in spans if s["phase"] == "train"]
  assert len(train) == 3, train
  overlap = [r["perf/overlap_tokens"] for r in records]
  # Step 0 may have nothing left to overlap: the continuous stream can finish batch 1 in batch 0's tail
  # (eta = 1 allows it), and batch 2 waits for step 0's weights. The last step has no next batch.
  assert max(overlap[:-1]) > 0, f"{mode}: no rollout token was generated while a train step ran: {overlap}"
  assert max(overlap) <= max(r["perf/tokens"] for r in records) * 3  # counts tokens, not chunks or seconds


def test_colocated_generates_nothing_while_training(tmp_path):
  records, spans = _run("colocated", tmp_path)
  train = [s for s in spans if s["phase"] == "train"]
  rollouts = [s for s in spans if s["phase"] == "rollout"]
  assert len(train) == 3, train
  assert [r["perf/overlap_tokens"] for r in records] == [0, 0, 0]
  assert all(min(t["end"], r["end"]) <= max(t["start"], r["start"]) for t in train for r in rollouts)
  assert all(r["perf/tokens"] > 0 for r in records)


@pytest.mark.parametrize("deterministic", [False, True])
def test_async_weights_land_when_the_step_is_done(deterministic, tmp_path):
  """A rollout longer than a train step: with readiness (the default) a finished step's weights land
  between decode chunks without the rollout ever waiting for the trainer; the counter schedule
  (land after 1 chunk) makes the rollout wait for the still-running step."""
  records, _ = _run("async", tmp_path, steps=4, chunk_s=0.05, slow_s=0.5, **{
      "run.deterministic": deterministic, "run.land_after_chunks": 1, "rollout.max_new_tokens": 48})
  at_chunk = [r for r in records if r["perf/land_at_chunk"]]
  assert at_chunk, "no step landed inside a running batch"
  waits = [r["perf/land_waited"] for r in at_chunk]
  if deterministic:
    assert max(waits) == 1.0, waits
  else:
    assert max(waits) == 0.0, waits
  assert max(r["staleness/max"] for r in records) <= 2
  assert [r["version"] for r in records] == [1, 2, 3, 4]


def test_the_next_batch_decodes_beside_a_straggler_and_groups_are_scored_as_they_finish(tmp_path, monkeypatch,
                                                                                      continuous=True):
  """Async, batch 0 with a straggling group (40 tokens) beside a 2-token one (EOS off). Continuous (the
  default): batch 1's sequences decode in the slots the short group frees while the straggler is still
  running, and the short group is handed to the reward worker before the straggler ends. Batch by
  batch (continuous=False here, rollout.continuous=False in a config) neither happens: the test fails."""
  from jaxrl_topo.runtime import rollout_side

  real = rollout_side._requests

  def requests(exp, examples):  # every sample 2 tokens, but batch 0's first group 40
    out = [dataclasses.replace(r, max_new_tokens=2) for r in real(exp, examples)]
    if not requests.calls:
      out[0] = dataclasses.replace(out[0], max_new_tokens=40)
    requests.calls += 1
    return out

  requests.calls = 0
  monkeypatch.setattr(rollout_side, "_requests", requests)
  cfg = _cfg(2, "async", **{"run.max_staleness": 1, "rollout.decode_chunk": 1, "rollout.continuous": continuous,
                            "rollout.max_new_tokens": 40, "reward.n_workers": 1})
  exp = experiment.build(cfg, str(tmp_path))
  exp.engine.ecfg = dataclasses.replace(exp.engine.ecfg, eos_ids=())
  per_batch = rollout_side.seq_base(exp, 1, 0)  # sequence ids of batch k start at k * per_batch
  live_batches = []  # per decode chunk: the batches with a live sequence
  real_stream = exp.engine.stream

  def stream(on_chunk=None, *args, **kw):
    def watched(eng):
      h = eng.host
      live_batches.append({int(s) // per_batch for s in h.seq_B[h.active_B]})
      on_chunk(eng)
    return real_stream(watched if on_chunk else None, *args, **kw)

  exp.engine.stream = stream
  records = []
  try:
    loop.train_loop(exp, hooks=loop.LoopHooks(on_step=lambda step, m: records.append(m)))
  finally:
    exp.close()
  assert any({0, 1} <= b for b in live_batches), f"batch 1 never decoded beside batch 0's straggler: {live_batches}"
  assert records[0].get("reward/groups_scored_early", 0) >= 1, records[0]
  assert max(r["staleness/max"] for r in records) <= 1
