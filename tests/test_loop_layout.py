"""The loop's train batches and step, as the config builds them: packing, fused log-prob pass, remat,
sharding constraints, and the sampler-vs-trainer log-prob gap.

One rollout batch of the tiny demo config (colocated on trainer fsdp=4, rollout data=2 x tensor=2) is
laid out padded and packed; both go through a gradient-capturing copy of the loop's step.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest
import train_fixtures as fx

from jaxrl_topo.models.model import abstract_model
from jaxrl_topo.runtime import experiment as experiment_lib
from jaxrl_topo.runtime import loop as loop_lib
from jaxrl_topo.runtime import run as run_lib
from jaxrl_topo.runtime.config import config_from_file, from_config_dict
from jaxrl_topo.runtime.metrics import read_metrics
from jaxrl_topo.runtime.sections import TrainSpec
from jaxrl_topo.topology.rules import TRAIN_RULES, ActivationSharding
from jaxrl_topo.train.optim import make_optimizer
from jaxrl_topo.train.policy import model_fns
from jaxrl_topo.train.state import create_train_state
from jaxrl_topo.train.step import batch_sharding_for, make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**overrides):
  c = config_from_file(os.path.join(ROOT, "configs", "grpo_task.py"), "tiny")
  base = {"run.steps": 2, "run.eval_every": 0, "run.tensorboard": False, "run.plot": False, "reward.n_workers": 0,
          "run.sft_steps": 0, "data.batch_size": 4, "rl.group_size": 4, "rollout.n_slots": 16, "rl.kl_coef": 0.05}
  for dotted, value in {**base, **overrides}.items():
    section, key = dotted.split(".")
    c[section][key] = value
  c.topology = dict(mode="colocated", trainer={"fsdp": 4}, rollout={"data": 2, "tensor": 2})
  return from_config_dict(c)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """(padded experiment, packed+remat+separate experiment, one rollout batch of the first)."""
  plain = experiment_lib.build(_cfg(), str(tmp_path_factory.mktemp("plain")), warmup=False)
  other_cfg = _cfg(**{"train.max_tokens_per_row": 64, "train.remat": "block", "train.logprobs": "separate",
                      "run.n_micro": 2})
  other = experiment_lib.build(other_cfg, str(tmp_path_factory.mktemp("other")), warmup=False)
  traj = loop_lib.rollout(plain, 0)
  yield plain, other, traj
  plain.close()
  other.close()


def _grad_step(exp, batch, separate: bool = False):
  """(metrics, gradients) of the experiment's step function with an SGD-as-gradient optimizer."""
  policy = jax.tree.map(lambda x: x.copy(), exp.state.params["policy"])
  state = create_train_state(policy, exp.cfg.train_config, fx.GRAD_TX)
  mesh = exp.topology.trainer
  step = make_train_step(exp.fns, exp.cfg.train_config, fx.GRAD_TX, state, mesh=mesh, rules=TRAIN_RULES)
  batch = jax.device_put(batch, batch_sharding_for(mesh, TRAIN_RULES))
  if separate:
    from jaxrl_topo.train.step import make_logprobs_fn, with_logprobs
    batch = with_logprobs(batch, make_logprobs_fn(exp.fns, exp.cfg.train_config, state, mesh=mesh,
                                                  rules=TRAIN_RULES)(state, batch))
  new_state, metrics = step(state, batch)
  return jax.device_get(metrics), jax.device_get(new_state.opt_state)


def test_packed_loop_batch_trains_like_the_padded_one(built):
  """Same completions, packed into rows of at most 64 tokens, groups spread over 2 microbatches: fewer rows,
  the padding reported, the same loss and gradients as one padded microbatch (and the separate log-prob
  program gives what the fused step computes itself)."""
  plain, other, traj = built
  padded, lay_pad = loop_lib.make_batch(plain, traj, version=0)
  packed, lay_pack = loop_lib.make_batch(other, traj, version=0)
  assert padded.tokens_MRS.shape[1:] == (16, plain.row_len)
  assert packed.tokens_MRS.shape[0] == 2 and packed.tokens_MRS.shape[2] <= 64
  assert packed.tokens_MRS.shape[1] % other.dp_width == 0
  assert lay_pack["train/rows"] < lay_pad["train/rows"], (lay_pack, lay_pad)
  real = sum(len(ex["prompt_ids"]) + len(s.tokens) for ex, s in zip(
      [traj.examples[i // 4] for i in range(len(traj.samples))], traj.samples, strict=True))
  assert lay_pack["train/pad_frac"] == pytest.approx(1 - real / packed.tokens_MRS.size)
  assert int(packed.segment_ids_MRS.max()) > 1, "nothing was packed"
  m_pad, g_pad = _grad_step(plain, padded)
  m_pack, g_pack = _grad_step(other, packed, separate=True)
  assert m_pad["step_ok"] == 1.0
  np.testing.assert_allclose(m_pack["loss"], m_pad["loss"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(m_pack["kl/mean"], m_pad["kl/mean"], atol=1e-7)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6), g_pack, g_pad)


def test_sampler_and_trainer_logprobs_agree_on_the_loop_batch(built):
  """fp32 (matmul precision "highest" in conftest): the paged sampler's log-probs equal the trainer's
  (flash attention, packed or not) within 1e-5 on every token sampled under the step's weights."""
  plain, other, traj = built
  for exp in (plain, other):
    batch, _ = loop_lib.make_batch(exp, traj, version=0)
    metrics, _ = _grad_step(exp, batch)
    assert metrics["logprob_gap/tokens"] == batch.mask_MBT.sum() > 0
    assert metrics["logprob_gap/max"] < 1e-5, metrics["logprob_gap/max"]
  stale, _ = loop_lib.make_batch(plain, traj, version=1)  # nothing was sampled under version 1
  assert stale.onpolicy_MBT.sum() == 0


def test_loop_step_is_the_constrained_graph_and_remat_reaches_it(built):
  """The loop's jitted step carries the activation sharding constraints (the graph tests/test_model.py
  checks sharded) and, with train.remat="block", a checkpoint per block."""
  plain, other, traj = built
  batch, _ = loop_lib.make_batch(plain, traj, version=0)
  batch = jax.device_put(batch, batch_sharding_for(plain.topology.trainer, TRAIN_RULES))
  jaxpr = str(jax.make_jaxpr(plain.step_fn)(plain.state, batch))
  mesh = plain.topology.trainer
  graphdef, _ = abstract_model(plain.model_cfg, ActivationSharding(mesh, TRAIN_RULES))
  want = make_train_step(model_fns(graphdef), plain.cfg.train_config, make_optimizer(plain.cfg.optim), plain.state,
                         mesh=mesh, rules=TRAIN_RULES)
  n_layers = plain.model_cfg.n_layers
  assert jaxpr.count("sharding_constraint") >= 5 * n_layers, "the loop's model carries no sharding constraints"
  assert str(jax.make_jaxpr(want)(plain.state, batch)) == jaxpr
  n_plain = jaxpr.count("remat") + jaxpr.count("checkpoint")  # the chunked log-probs' own checkpoints
  packed, _ = loop_lib.make_batch(other, traj, version=0)
  packed = jax.device_put(packed, batch_sharding_for(other.topology.trainer, TRAIN_RULES))
  remat_jaxpr = str(jax.make_jaxpr(other.step_fn)(other.state, packed))
  n_remat = remat_jaxpr.count("remat") + remat_jaxpr.count("checkpoint")
  assert n_remat >= n_plain + n_layers, f"train.remat did not reach the step: {n_remat} vs {n_plain} checkpoints"


def test_bf16_run_logs_the_logprob_gap_every_step(tmp_path):
  """bf16 compute: the gap between the bf16 sampler and the trainer is logged each step, nonzero and small."""
  cfg = _cfg(**{"model.dtype": "bfloat16", "run.steps": 2})
  cfg = dataclasses.replace(cfg, train=TrainSpec(max_tokens_per_row=44))
  run_lib.train(cfg, str(tmp_path), progress=False)
  rows = read_metrics(str(tmp_path))
  assert len(rows) == 2
  for m in rows:
    assert 1e-4 < m["logprob_gap/max"] < 1.0, m["logprob_gap/max"]
    assert 0 < m["logprob_gap/mean"] < m["logprob_gap/max"]
    assert 0 <= m["train/pad_frac"] < 0.5
