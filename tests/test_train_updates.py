"""Several optimizer updates per train step (rl.epochs x rl.minibatches, PPO's K epochs of minibatch updates).

The reference is the plain one-update step run update by update: each minibatch (whole groups, so GRPO's
advantages are its own) as a batch of its own that carries the step's starting log-probs as its proximal
policy. The toy policy runs `train_step` op by op (train_fixtures.one_step), so each case costs no compile.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
import train_fixtures as fx

from jaxrl_topo.train.batch import Completion, build_batch
from jaxrl_topo.train.config import LossConfig, OptimConfig, TrainConfig
from jaxrl_topo.train.optim import learning_rate, make_optimizer
from jaxrl_topo.train.sft import make_sft_step, sft_optimizer
from jaxrl_topo.train.state import create_train_state
from jaxrl_topo.train.step import advance_schedule, train_step

N, G, RESP_LEN, ROW_LEN = 16, 4, 6, 12


def _completions():
  _, fns, params, _, vocab = fx.policy("toy")
  comps = fx.ragged_completions(N, vocab)
  sampler = fx.perturbed(fx.completion_logprobs(fns, params, comps), 0.05, seed=2)
  comps = [Completion(c.prompt, c.response, c.reward, s) for c, s in zip(comps, sampler, strict=True)]
  return comps, fx.completion_logprobs(fns, params, comps)  # the starting weights' log-probs


def _batch(comps, n_micro, old=None):
  return build_batch(comps, n_micro=n_micro, rows=len(comps) // n_micro, row_len=ROW_LEN, resp_len=RESP_LEN,
                     pack=False, old_logp=old)


def _step(cfg: TrainConfig, state, batch, tx):
  with jax.disable_jit():
    return train_step(state, batch, fns=fx.policy("toy")[1], cfg=cfg, tx=tx)


def _fresh(cfg: TrainConfig, tx):
  _, _, params, d_model, _ = fx.policy("toy")
  return create_train_state(params, cfg, tx, d_model=d_model)


@pytest.mark.parametrize("epochs, minibatches", [(2, 1), (1, 2), (2, 2)])
def test_updates_equal_one_update_steps_on_each_minibatch_against_the_starting_policy(epochs, minibatches):
  comps, start_logp = _completions()
  loss = dict(group_size=G, clip_low=0.1, clip_high=0.15)
  tx = make_optimizer(OptimConfig(lr=0.05))
  multi = TrainConfig(loss=LossConfig(**loss, epochs=epochs, minibatches=minibatches))
  got, metrics = _step(multi, _fresh(multi, tx), _batch(comps, n_micro=2), tx)

  one = TrainConfig(loss=LossConfig(**loss))
  state, per = _fresh(one, tx), N // minibatches
  for _ in range(epochs):
    for k in range(minibatches):
      part = slice(k * per, (k + 1) * per)
      state, _ = _step(one, state, _batch(comps[part], n_micro=2 // minibatches, old=start_logp[part]), tx)
  fx.assert_trees_close(jax.device_get(got.params), jax.device_get(state.params), rtol=2e-5,
                        what=f"{epochs} epochs x {minibatches} minibatches")
  assert int(got.step) == 1 and int(got.rejected) == 0 and float(metrics["step_ok"]) == 1.0
  # From the second update on, the ratios move off 1 and the clip acts (lr 0.05 moves them past 1 +- 0.15).
  assert float(metrics["policy/clip_frac"]) > 0.0


def test_with_one_update_the_clip_never_binds_and_with_two_it_does():
  """One update: every ratio is 1, so clip_high changes nothing, to the bit. Two: it changes the step."""
  comps, _ = _completions()
  tx = make_optimizer(OptimConfig(lr=0.05))
  params = {}
  for epochs in (1, 2):
    for clip_high in (0.15, 0.3):
      cfg = TrainConfig(loss=LossConfig(group_size=G, clip_low=0.15, clip_high=clip_high, epochs=epochs))
      state, _ = _step(cfg, _fresh(cfg, tx), _batch(comps, n_micro=2), tx)
      params[epochs, clip_high] = jax.device_get(state.params)
  same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
  assert same(params[1, 0.15], params[1, 0.3])
  assert not same(params[2, 0.15], params[2, 0.3])


def test_the_schedule_counts_steps_not_updates():
  """warmup_steps=1: step 0's rate is 0 for every one of its updates (counted in updates, the second would
  have had the full rate), so the step leaves the params as they were; step 1 moves them."""
  comps, _ = _completions()
  cfg = TrainConfig(loss=LossConfig(group_size=G, epochs=2, minibatches=2))
  tx = make_optimizer(OptimConfig(lr=0.05, warmup_steps=1), updates_per_step=cfg.loss.updates)
  state = _fresh(cfg, tx)
  before = jax.device_get(state.params)
  state, _ = _step(cfg, state, _batch(comps, n_micro=2), tx)
  fx.assert_trees_close(jax.device_get(state.params), before, rtol=0.0, what="step 0 at lr 0")
  state, _ = _step(cfg, state, _batch(comps, n_micro=2), tx)
  assert not np.allclose(jax.tree.leaves(state.params)[0], jax.tree.leaves(before)[0])


def test_cosine_schedule_and_global_norm_clip_by_hand():
  """Warm-up then cosine decay to final_lr_frac x lr, at hand-worked points; and the clip: two updates of grads
  with norms 10 and 0.1 under max_grad_norm=1 equal unclipped updates of the first scaled to norm 1 (Adam is not
  scale-free over two updates of different scale, so a clip that did nothing would differ)."""
  sched = learning_rate(OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=10, total_steps=110, final_lr_frac=0.1))
  for step, want in [(0, 0.0), (5, 5e-4), (10, 1e-3), (60, 1e-3 * (0.1 + 0.9 * 0.5)), (110, 1e-4), (200, 1e-4)]:
    np.testing.assert_allclose(float(sched(step)), want, rtol=1e-6, atol=1e-12, err_msg=f"step {step}")
  g = {"w": np.array([3.0, 4.0], np.float32)}  # norm 5

  def two_updates(tx, first, second):
    params = {"w": np.zeros(2, np.float32)}
    opt = tx.init(params)
    u1, opt = tx.update(first, opt, params)
    u2, _ = tx.update(second, opt, params)
    return np.concatenate([u1["w"], u2["w"]])

  scaled = lambda k: jax.tree.map(lambda x: x * k, g)
  clipped = two_updates(make_optimizer(OptimConfig(lr=0.1, max_grad_norm=1.0)), scaled(2.0), scaled(0.02))
  by_hand = two_updates(make_optimizer(OptimConfig(lr=0.1, max_grad_norm=0.0)), scaled(0.2), scaled(0.02))
  unclipped = two_updates(make_optimizer(OptimConfig(lr=0.1, max_grad_norm=0.0)), scaled(2.0), scaled(0.02))
  np.testing.assert_allclose(clipped, by_hand, rtol=1e-6)
  assert not np.allclose(unclipped, by_hand, rtol=1e-3), "the check must tell a clip from none"
  # The supervised warm-up's optimizer (run.sft_max_grad_norm; before: never clipped) clips the same way.
  sft_clipped = two_updates(sft_optimizer(0.1, 1.0), scaled(2.0), scaled(0.02))
  np.testing.assert_allclose(sft_clipped, two_updates(sft_optimizer(0.1, 0.0), scaled(0.2), scaled(0.02)), rtol=1e-6)
  assert not np.allclose(two_updates(sft_optimizer(0.1, 0.0), scaled(2.0), scaled(0.02)), sft_clipped, rtol=1e-3)


def test_warm_up_microbatches_take_the_one_batch_step():
  """run.sft_n_micro: the warm-up's 16 ragged rows in 4 microbatches (scanned, each one's token sum over the whole
  batch's token count) take the one-batch step: the same loss and weights up to summation order. A mean of the
  microbatches' own means would differ (their token counts differ)."""
  comps, _ = _completions()
  _, fns, params, _, _ = fx.policy("toy")
  copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)  # the step donates its params
  out = {}
  for n_micro in (1, 4):
    step, opt_state = make_sft_step(fns, sft_optimizer(1e-2, 0.0), copy(params))
    new, _, loss = step(copy(params), opt_state, _batch(comps, n_micro))
    out[n_micro] = (float(loss), jax.device_get(new))
  np.testing.assert_allclose(out[4][0], out[1][0], rtol=1e-6)
  fx.assert_trees_close(out[4][1], out[1][1], rtol=1e-5, what="4 microbatches vs 1")
  assert fx.max_rel_diff(out[1][1], jax.device_get(params)) > 0, "the warm-up step moved nothing"


def test_weight_decay_mask_by_hand():
  """Zero gradients, lr 0.5, weight_decay 0.1: AdamW's update is -lr x wd x param = -0.05 x param on what the mask
  decays, 0 elsewhere. "all" decays the norm scale and the bias too; "matrices" only the 2-D kernel and embedding
  (before: no way to keep a norm's scale out of the decay)."""
  params = {"kernel": np.full((2, 3), 2.0, np.float32), "embed": np.ones((4, 2), np.float32),
            "norm": {"scale": np.ones(3, np.float32)}, "bias": np.full(3, 4.0, np.float32)}
  zeros = jax.tree.map(np.zeros_like, params)
  for mask, decayed in (("all", {"kernel", "embed", "norm", "bias"}), ("matrices", {"kernel", "embed"})):
    tx = make_optimizer(OptimConfig(lr=0.5, weight_decay=0.1, weight_decay_mask=mask))
    updates, _ = tx.update(zeros, tx.init(params), params)
    for name in params:
      want = jax.tree.map(lambda p: -0.05 * p if name in decayed else 0 * p, params[name])  # noqa: B023
      jax.tree.map(lambda u, w: np.testing.assert_allclose(u, w, rtol=1e-6, err_msg=f"{mask}: {name}"),  # noqa: B023
                   updates[name], want)
  with pytest.raises(ValueError, match="weight_decay_mask='norms'; expected one of"):
    OptimConfig(weight_decay_mask="norms")


def test_a_non_finite_batch_rejects_every_update_of_the_step():
  """epochs=2 x minibatches=2: a NaN reward in one minibatch rejects the whole step (all four updates): the
  params and the optimizer state are as they were, and the rejection is counted once."""
  comps, _ = _completions()
  comps[5] = Completion(comps[5].prompt, comps[5].response, float("nan"), comps[5].sampler_logp)
  cfg = TrainConfig(loss=LossConfig(group_size=G, epochs=2, minibatches=2))
  tx = make_optimizer(OptimConfig(lr=0.05), updates_per_step=cfg.loss.updates)
  state = _fresh(cfg, tx)
  before = jax.device_get((state.params, state.opt_state))
  state, m = _step(cfg, state, _batch(comps, n_micro=2), tx)
  assert (float(m["step_ok"]), int(state.rejected), int(state.step)) == (0.0, 1, 1)
  # All as it was but the schedule's counters, which count train steps (here 4 updates each).
  fx.assert_trees_close(jax.device_get((state.params, advance_schedule(state.opt_state, before[1]))), before,
                        rtol=0.0, what="a rejected step")
  assert _schedule_counts(state.opt_state) == [4]


def _schedule_counts(opt_state) -> list[int]:
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
  return [int(x.count) for x in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(x)]


def test_after_a_rejected_step_the_schedule_and_the_logged_lr_agree():
  """Warm-up of 4 steps to lr 1. Step 0 is rejected (a NaN reward), step 1 trains at lr(1) = 0.25, as logged.
  Before, the schedule's counter was restored with the moments, so step 1 trained at lr(0) = 0 (the weights did
  not move) while the metric said 0.25, and every later step ran one warm-up step behind."""
  comps, _ = _completions()
  bad = list(comps)
  bad[5] = Completion(comps[5].prompt, comps[5].response, float("nan"), comps[5].sampler_logp)
  optim = OptimConfig(lr=1.0, warmup_steps=4, max_grad_norm=0.0)
  cfg = TrainConfig(loss=LossConfig(group_size=G), optim=optim)
  tx = make_optimizer(optim)
  state, m = _step(cfg, _fresh(cfg, tx), _batch(bad, n_micro=2), tx)
  assert float(m["step_ok"]) == 0.0 and _schedule_counts(state.opt_state) == [1]
  before = jax.device_get(state.params)
  state, m = _step(cfg, state, _batch(comps, n_micro=2), tx)
  assert float(m["step_ok"]) == 1.0 and float(m["lr"]) == float(learning_rate(optim)(1)) == 0.25
  # Adam's first update is g / |g| per weight (bias-corrected moments), so the largest move is the rate itself.
  moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(jax.device_get(state.params)),
                                                          jax.tree.leaves(before), strict=True))
  assert moved == pytest.approx(0.25, rel=1e-3)


def test_minibatches_must_divide_the_microbatches_and_be_positive():
  comps, _ = _completions()
  cfg = TrainConfig(loss=LossConfig(group_size=G, minibatches=2))
  tx = make_optimizer(OptimConfig(lr=0.05))
  with pytest.raises(ValueError, match=r"rl.minibatches=2 does not divide the step's 1 microbatches"):
    _step(cfg, _fresh(cfg, tx), _batch(comps, n_micro=1), tx)
  for field in ("epochs", "minibatches"):
    with pytest.raises(ValueError, match=rf"LossConfig.{field}=0 must be >= 1"):
      LossConfig(group_size=G, **{field: 0})


def test_the_dapo_config_makes_two_updates_a_step_and_a_launch_refuses_minibatches_that_do_not_divide():
  """configs/dapo.py reaches the step with two updates (so its clip-higher binds); a launch whose run.n_micro
  the minibatches do not divide is refused before anything is built (runtime/preflight.check_shapes)."""
  import os

  from jaxrl_topo.runtime.config import config_from_file, from_config_dict
  from jaxrl_topo.runtime.preflight import check_shapes
  from jaxrl_topo.topology.carve import carve

  c = config_from_file(os.path.join(os.path.dirname(__file__), "..", "configs", "dapo.py"), "tiny")
  cfg = from_config_dict(c)
  assert (cfg.train_config.loss.epochs, cfg.train_config.loss.updates, cfg.run.n_micro) == (1, 2, 2)
  check_shapes(cfg, carve(cfg.topology))
  c.run.n_micro = 3
  bad = from_config_dict(c)
  with pytest.raises(ValueError, match=r"rl.minibatches=2 does not divide run.n_micro=3"):
    check_shapes(bad, carve(bad.topology))


def test_a_critic_with_an_apply_only_policy_is_refused_before_tracing():
  """A critic reads hidden states; PolicyFns(apply=...) has none ('NoneType' object is not callable, deep in
  tracing, before)."""
  from jaxrl_topo.train.policy import PolicyFns
  from jaxrl_topo.train.step import make_train_step

  cfg = TrainConfig(loss=LossConfig(group_size=G, advantage="gae", critic="shared"))
  tx = make_optimizer(OptimConfig(lr=0.05))
  with pytest.raises(ValueError, match=r"rl.critic='shared' reads the policy's hidden states"):
    make_train_step(PolicyFns(apply=lambda *a: None), cfg, tx, _fresh(cfg, tx))


def test_build_batch_refuses_a_reward_that_is_not_a_number_and_sizes_that_cannot_be():
  """A None reward became NaN (a silently rejected step); n_micro=0 gave a ZeroDivisionError; one old log-prob
  for a 2-token response was broadcast; old_logp for too few sequences an IndexError. (A NaN reward still
  passes: the step rejects it and counts it, test_train_step's rejection test.)"""
  comps, start = _completions()
  bad = Completion(comps[0].prompt, comps[0].response, None, comps[0].sampler_logp)
  with pytest.raises(ValueError, match=r"sequence 0: reward None is not a number"):
    _batch([bad, *comps[1:]], n_micro=2)
  with pytest.raises(ValueError, match=r"n_micro=0, rows=.*: each must be >= 1"):
    build_batch(comps, n_micro=0, rows=8, row_len=ROW_LEN, resp_len=RESP_LEN, pack=False)
  with pytest.raises(ValueError, match=r"old_logp has 15 sequences for 16 completions"):
    _batch(comps, n_micro=2, old=start[1:])
  with pytest.raises(ValueError, match=r"sequence 3: old_logp has 1 entries for \d+ response tokens"):
    _batch(comps, n_micro=2, old=[*start[:3], start[3][:1], *start[4:]])


def test_an_optimizer_built_for_another_update_count_is_refused():
  """Before: make_optimizer(tc.optim) (the README's snippet) under epochs=2 x minibatches=2 ran the schedule 4x too
  fast (warm-up over in a quarter of its steps, step 0 moving the weights at a logged lr of 0), silently."""

  from jaxrl_topo.train.policy import PolicyFns
  from jaxrl_topo.train.step import make_train_step

  cfg = TrainConfig(loss=LossConfig(group_size=G, epochs=2, minibatches=2))
  fns = PolicyFns(apply=lambda *a: None)
  tx = make_optimizer(OptimConfig(lr=0.05, warmup_steps=4))
  with pytest.raises(ValueError, match=re.escape(
      "the optimizer counts 1 update(s) a train step, but the loss makes 4 (LossConfig epochs x minibatches = 2 x 2)")):
    make_train_step(fns, cfg, tx, _fresh(cfg, tx))
  tx = make_optimizer(OptimConfig(lr=0.05, warmup_steps=4), cfg.loss.updates)
  make_train_step(fns, cfg, tx, _fresh(cfg, tx))  # (nothing traced yet)
  make_train_step(fns, cfg, optax.sgd(0.1), _fresh(cfg, optax.sgd(0.1)))  # an optax chain of the caller's own
  with pytest.raises(ValueError, match=r"updates_per_step=0 must be an int >= 1"):
    make_optimizer(OptimConfig(lr=0.05), 0)
  assert make_optimizer(OptimConfig(lr=0.05), np.int64(4)).updates_per_step == 4  # as LossConfig takes them
