"""No recompiles in the RL loop's steady state (issue 12, item 7), as a whole: not one component at a time.

A loop step runs many programs (the engine's prefill and decode buckets, the page patch, the batch layout's
train step, the log-prob pass, the weight sync's buckets, the host-side metric reductions). Each should be
traced and lowered once per shape and then only called. The check: run a few steps, put the experiment back
as it was (initial weights on both sides, gen_id 0), run the same steps again. The replay draws the same
batches, so it meets only shapes the first run met; any trace or lowering during it is a program rebuilt
in the hot loop (a jit made per call, a Python value that should have been static or traced, a shape that
drifts). Counted from JAX's own compile events, which fire on every jit cache miss whether or not the
persistent compilation cache then saves the XLA compile.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_topo.runtime import experiment, loop
from tests.test_loop_sync import _cfg

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")


class CompileLog:
  """Names of the functions JAX traced or lowered while `recording` (one listener for the test session, registered
  at import; runtime/spans.py CompileLog is the run's own, timing the compiles inside each span)."""

  def __init__(self):
    self.recording = False
    self.seen: collections.Counter[str] = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **kw) -> None:
    if self.recording and event in _EVENTS:
      self.seen[f"{event.rsplit('/', 1)[-1]}: {kw.get('fun_name', '?')}"] += 1


_LOG = CompileLog()


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)  # own buffers: the train step donates its state


def _recorded(exp) -> tuple[collections.Counter, list[dict]]:
  """One train_loop: (what it traced or lowered, its metrics per step)."""
  records: list[dict] = []
  _LOG.seen.clear()
  _LOG.recording = True
  try:
    loop.train_loop(exp, hooks=loop.LoopHooks(on_step=lambda step, m: records.append(m),
                                              should_eval=lambda done: done == 2))  # after step 1
  finally:
    _LOG.recording = False
  return collections.Counter(_LOG.seen), records


def _replay(cfg, workdir):
  """(the first run's compiles and metrics, the replay's)."""
  exp = experiment.build(cfg, str(workdir))
  try:
    state0, rollout0 = _copy(exp.state), _copy(exp.engine.params)
    first = _recorded(exp)
    exp.state, exp.engine.params, exp.engine.gen_id = state0, rollout0, 0  # as built
    return first, _recorded(exp)
  finally:
    exp.close()


@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_a_replayed_run_traces_and_lowers_nothing(tmp_path, mode):
  """Three steps, then the same three again: every program of the second pass comes from the jit caches.
  Async lands its weights between decode chunks (run.deterministic: after a fixed chunk count), so both
  passes take the same path. The replay is the same run: equal tokens, rewards and losses."""
  cfg = _cfg(3, mode=mode, **{"run.deterministic": True, "optim.weight_decay": 0.1})
  (built, first), (compiled, again) = _replay(cfg, tmp_path / mode)
  # The listener hears the first run build the programs the loop meets first (the rest, e.g. the weight
  # sync's, are built with the experiment).
  assert {"jaxpr_trace_duration: train_step", "jaxpr_trace_duration: generate"} <= set(built), built
  assert len(first) == len(again) == 3
  for a, b in zip(first, again, strict=True):
    assert (a["perf/tokens"], a["reward_mean"], a["loss"]) == (b["perf/tokens"], b["reward_mean"], b["loss"])
  assert not compiled, f"the replay rebuilt programs: {dict(compiled)}"
  # The evaluation after step 1 says which weights it read: version 2, or a later one that landed first (async).
  assert first[1]["eval/version"] == 2 if mode == "colocated" else first[1]["eval/version"] >= 2
  assert "eval/version" not in first[0] and "eval/accuracy" in first[1]
  assert np.isfinite(first[-1]["loss"])
