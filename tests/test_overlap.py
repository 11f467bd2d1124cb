"""Overlap evidence that can fail (runtime/watch.py), and async weights that land when ready.

A train step is made slow on its devices: an extra output spins about SLOW_S on a trainer device after
the step, so the step's outputs complete that much later. The "train" span ends when a watcher thread saw the
outputs complete (not at the next host check), and `perf/overlap_tokens` counts the rollout tokens of
decode chunks that were dispatched and read entirely inside [dispatch, device completion].
"""

from __future__ import annotations

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
  real = exp.engine.run

  def run(requests, on_chunk=None, **kw):
    if on_chunk is None:
      return real(requests, **kw)
    return real(requests, lambda eng: (time.sleep(seconds), on_chunk(eng)), **kw)

  exp.engine.run = run


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
  assert overlap[0] > 0, f"{mode}: no rollout token was generated while step 0 ran: {overlap}"
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
