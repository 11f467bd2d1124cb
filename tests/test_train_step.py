"""The RL train step end to end: invariances, on-policy identities, rejection, LoRA, critics, learning.

Most tests take ONE step from a fresh state with `grad_capture` as the optimizer (update = -grad, new
optimizer state = grad), so "same gradients" is checked directly. The data: 16 ragged completions
(4 prompts x group_size 4, random rewards), the proximal policy's log-probs off the current policy by
N(0, 0.15²) per token (so ratios differ from 1 and some clip), the sampler's within N(0, 0.05²) of
those (truncated IS weights differ from 1). The tiny transformer runs make_train_step's jitted step; the
toy policy (train_fixtures.py) runs the same `train_step` op by op for the wide sweeps.
Runtime on 2 CPU cores: ~70 s with `-m "not slow"`, ~165 s for the whole file.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import chex
import jax
import numpy as np
import pytest
import train_fixtures as fx

from jaxrl_topo.rl import advantages as adv_lib
from jaxrl_topo.rl import losses as loss_lib
from jaxrl_topo.rl.core import AGG_MODES
from jaxrl_topo.topology.rules import TRAIN_RULES, make_mesh
from jaxrl_topo.train import config as config_lib
from jaxrl_topo.train import step as step_lib
from jaxrl_topo.train.batch import Completion, build_batch
from jaxrl_topo.train.config import LoraConfig, LossConfig, OptimConfig, TrainConfig
from jaxrl_topo.train.lora import merge_lora
from jaxrl_topo.train.optim import make_optimizer
from jaxrl_topo.train.state import create_train_state
from jaxrl_topo.train.step import check_batch, make_train_step

N, G, RESP_LEN, PAD_ROW_LEN = 16, 4, 6, 12  # the longest completion has 10 tokens
CFG = TrainConfig(loss=LossConfig(group_size=G, kl_coef=0.01))  # ppo, token-mean, KL term (reference copy)


@functools.cache
def _data(name: str):
  """(completions with sampler log-probs, proximal-policy log-probs) for policy `name`'s initial params."""
  _, fns, params, _, vocab = fx.policy(name)
  comps = fx.ragged_completions(N, vocab)
  old = fx.perturbed(fx.completion_logprobs(fns, params, comps), 0.15, seed=1)
  sampler = fx.perturbed([np.asarray(o) for o in old], 0.05, seed=2)
  return [Completion(c.prompt, c.response, c.reward, s) for c, s in zip(comps, sampler, strict=True)], old


def _batch(name: str, n_micro: int, pack: bool = False, off_policy: bool = True):
  comps, old = _data(name)
  rows, row_len = (4 // n_micro, 32) if pack else (N // n_micro, PAD_ROW_LEN)
  return build_batch(comps, n_micro=n_micro, rows=rows, row_len=row_len, resp_len=RESP_LEN, pack=pack,
                     old_logp=old if off_policy else None)


@functools.cache
def _run(cfg: TrainConfig, name: str, n_micro: int, pack: bool = False, mesh_axes: tuple | None = None):
  return fx.one_step(cfg, _batch(name, n_micro, pack), name, mesh_axes)


def _assert_same_step(got, want, what: str):
  """Same loss, metrics, gradients and post-step params."""
  (_, state, metrics), (_, want_state, want_metrics) = got, want
  assert set(metrics) == set(want_metrics), f"{what}: metric keys differ"
  for k in sorted(want_metrics):
    np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-5, atol=1e-7,
                               err_msg=f"{what}: metric {k} changed: the global normalisers or the metric "
                                       "combination are not layout-independent")
  fx.assert_trees_close(state.opt_state, want_state.opt_state, what=f"{what}: gradients")
  fx.assert_trees_close(state.params, want_state.params, what=f"{what}: params after the step")
  assert metrics["step_ok"] == 1.0, f"{what}: the step was rejected"


# ---------------------------------------------------------------- 1. microbatch count


def _sweep() -> list:
  """Every (aggregation, policy loss) on the toy (op by op: cheap); on the tiny transformer (a jitted
  step, ~10 s each) a diagonal that still meets every aggregation and every loss once."""
  diagonal = set(zip(AGG_MODES, ("cispo", "gspo", "ppo", "ppo"), strict=True))
  out = []
  for name, agg, loss in itertools.product(("toy", "tiny"), AGG_MODES, loss_lib.POLICY_LOSS_FNS):
    if name == "tiny" and (agg, loss) not in diagonal:
      continue
    fast = (agg, loss) in diagonal if name == "toy" else (agg, loss) == ("seq-mean-token-sum", "ppo")
    out.append(pytest.param(name, agg, loss, marks=() if fast else pytest.mark.slow, id=f"{name}-{agg}-{loss}"))
  return out


@pytest.mark.parametrize("name,agg,policy_loss", _sweep())
def test_microbatch_count_does_not_change_the_step(name, agg, policy_loss):
  """1, 2 or 4 microbatches: same loss, metrics, gradients and params (tiny, token-mean ppo: gradients
  differ by at most 8.5e-7 of each leaf's largest entry; the loss by 1 ulp)."""
  cfg = TrainConfig(loss=LossConfig(group_size=G, kl_coef=0.01, agg=agg, policy_loss=policy_loss))
  want = _run(cfg, name, 1)
  assert 0 < want[2]["policy/clip_frac"] < 1 or policy_loss == "gspo", "the data should clip some tokens"
  for n_micro in (2, 4):
    _assert_same_step(_run(cfg, name, n_micro), want, f"{name} {agg} {policy_loss} n_micro={n_micro}")


@pytest.mark.parametrize("key", ["is/ess", "policy/ratio_mean", "policy/clip_frac"])
def test_sequence_level_metrics_are_microbatch_invariant(key):
  """Non-token-mean metrics (the IS effective sample size, GSPO's per-sequence ratio and clip fraction)
  are computed once over the whole batch after the scan. (A token-weighted combination of per-microbatch
  values gave is/ess 0.997572 vs 0.997690 and ratio_mean 1.00447 vs 1.00730 at n_micro 1 vs 4.)"""
  cfg = TrainConfig(loss=LossConfig(group_size=G, kl_coef=0.01, agg="seq-mean-token-mean", policy_loss="gspo"))
  one, four = _run(cfg, "toy", 1)[2], _run(cfg, "toy", 4)[2]
  np.testing.assert_allclose(four[key], one[key], rtol=1e-5)


# ---------------------------------------------------------------- 2. padding vs packing


@pytest.mark.parametrize("n_micro", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_packing_matches_padding(n_micro):
  """Same sequences one per row vs first-fit packed (several segments per row): same step (observed: same
  loss bitwise, gradients within 5.1e-7 of each leaf's scale)."""
  packed = _batch("tiny", n_micro, pack=True)
  assert packed.segment_ids_MRS.max() > 1, "the packed layout should hold several sequences per row"
  _assert_same_step(_run(CFG, "tiny", n_micro, pack=True), _run(CFG, "tiny", 1),
                    f"packed n_micro={n_micro} vs padded: segment ids or gather indices are wrong")


# ---------------------------------------------------------------- 3. mesh


@pytest.mark.parametrize("mesh_axes", [(("fsdp", 8),), (("fsdp", 4), ("tensor", 2)), (("data", 2), ("fsdp", 4))],
                         ids=["fsdp8", "fsdp4xtp2", "dp2xfsdp4"])
def test_mesh_does_not_change_the_step(mesh_axes, capfd):
  """fsdp=8, fsdp=4 x tensor=2 and data=2 x fsdp=4 vs one device, 2 microbatches of 8 rows (observed: gradients
  within 8.6e-7 and 1.1e-6 of each leaf's scale; loss equal / 1 ulp), compiled without XLA replicating a tensor
  it cannot reshard (with data x fsdp it did, for the embedding lookup's gradient)."""
  got = _run(CFG, "tiny", 2, mesh_axes=mesh_axes)
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
  want = _run(CFG, "tiny", 2)
  fx.assert_trees_close(got[0], want[0], rtol=0, what="initial params differ across meshes")
  sharded = fx.policy("tiny", mesh_axes)[2]
  assert not sharded["embed_tokens"].sharding.is_fully_replicated, "the params should be sharded on the mesh"
  _assert_same_step(got, want, f"mesh {mesh_axes} vs one device")


# ---------------------------------------------------------------- 4. on-policy identities


def test_on_policy_first_step_has_unit_ratios():
  """old_logp=None: ratios are exactly 1, nothing clips. An explicit old_logp from a separate jitted
  `sequence_logprobs` call per microbatch gives ratios within 1e-5 of 1. Observed: NOT bitwise; ratio_max - 1
  = 4.8e-7 (4 ulp), ratio_mean exactly 1: the grad program fuses the forward differently from the
  forward-only one."""
  _, _, m = fx.one_step(CFG, _batch("tiny", 2, off_policy=False))
  for k, want in [("policy/ratio_mean", 1.0), ("policy/ratio_max", 1.0), ("policy/clip_frac", 0.0),
                  ("policy/approx_kl", 0.0), ("kl/mean", 0.0)]:
    assert m[k] == want, f"on-policy {k} = {m[k]!r}, want exactly {want}: old_logp is not stop_gradient(logp)"

  _, fns, params, _, _ = fx.policy("tiny")
  batch = _batch("tiny", 2, off_policy=False)
  old_MBT = fx.batch_logprobs(fns, params, batch)
  _, _, m = fx.one_step(CFG, batch.replace(old_logp_MBT=old_MBT.astype(np.float32)))
  np.testing.assert_allclose([m["policy/ratio_mean"], m["policy/ratio_max"]], [1.0, 1.0], rtol=0, atol=1e-5,
                             err_msg="the step's log-probs differ from sequence_logprobs on the same params")
  assert m["policy/clip_frac"] == 0.0, "a ratio within 1e-5 of 1 cannot clip at ε = 0.2"


# ---------------------------------------------------------------- 5-6. compile once; reject non-finite


@pytest.fixture(scope="module")
def counted():
  """A jitted step on fsdp=8 with AdamW, whose python body raises if traced twice; and a state factory."""
  mesh_axes = (("fsdp", 8),)
  tx = make_optimizer(OptimConfig(lr=1e-3))
  chex.clear_trace_counter()
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(step_lib, "train_step", chex.assert_max_traces(step_lib.train_step, n=1))
    mesh, fns, params, d_model, _ = fx.policy("tiny", mesh_axes)
    step = make_train_step(fns, CFG, tx, create_train_state(params, CFG, tx, d_model=d_model), mesh=mesh,
                           rules=TRAIN_RULES)
  new_state = lambda: create_train_state(fx.policy("tiny", mesh_axes)[2], CFG, tx, d_model=d_model)
  return step, new_state


def _fresh_batch(seed: int, nan_reward: bool = False):
  """New values, same shapes: 2 microbatches x 8 rows x PAD_ROW_LEN."""
  comps = fx.ragged_completions(N, fx.TINY.vocab_size, seed=seed)
  if nan_reward:
    comps[3] = Completion(comps[3].prompt, comps[3].response, float("nan"), comps[3].sampler_logp)
  return build_batch(comps, n_micro=2, rows=8, row_len=PAD_ROW_LEN, resp_len=RESP_LEN, pack=False)


def test_step_compiles_once(counted):
  step, new_state = counted
  state = new_state()
  for seed in range(3):
    state, metrics = step(state, _fresh_batch(10 + seed))  # raises inside the trace if it retraced
    assert metrics["step_ok"] == 1.0, f"step {seed} was rejected on a finite batch"
    assert metrics["tokens"] == _fresh_batch(10 + seed).mask_MBT.sum() > 0
  # A batch with no token in the loss logs 0 tokens (before: 1, the normaliser's floor), in the same program.
  empty = _fresh_batch(13)
  state, metrics = step(state, empty.replace(mask_MBT=np.zeros_like(empty.mask_MBT)))
  assert (metrics["tokens"], metrics["response_len/mean"]) == (0.0, 0.0)
  assert int(state.step) == 4
  assert step._cache_size() == 1, "three same-shaped batches compiled more than one program"


def test_non_finite_batch_is_rejected_then_training_continues(counted):
  step, new_state = counted
  state = new_state()
  before = jax.device_get((state.params, state.opt_state))
  state, m = step(state, _fresh_batch(20, nan_reward=True))
  assert (m["step_ok"], int(state.rejected), int(state.step)) == (0.0, 1, 1), "a NaN reward must reject the step"
  # All as it was but the learning-rate schedule's counter (it counts train steps, rejected ones included).
  chex.assert_trees_all_equal(jax.device_get((state.params, step_lib.advance_schedule(state.opt_state, before[1]))),
                              before, custom_message="a rejected step changed the params or optimizer state")
  state, m = step(state, _fresh_batch(21))
  assert (m["step_ok"], int(state.rejected), int(state.step)) == (1.0, 1, 2), "training did not resume"
  after = jax.device_get(state.params)
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before[0]),
                                                       strict=True)]
  assert all(changed), "after a rejection the next finite step should update every parameter"


# ---------------------------------------------------------------- 7. LoRA


def test_lora_trains_adapters_only_and_starts_at_the_base_policy():
  cfg = TrainConfig(loss=LossConfig(group_size=G, kl_coef=0.01), lora=LoraConfig(rank=4))
  tx = make_optimizer(OptimConfig(lr=1e-3))
  _, fns, base, _, _ = fx.policy("tiny")
  base = jax.device_get(base)
  state, step = fx.fresh_state(cfg, "tiny", None, tx)
  assert state.ref is None, "LoRA's reference policy is the frozen base: no second copy"
  chex.assert_trees_all_equal(jax.device_get(state.frozen), base)
  adapters = state.params["policy"]
  assert set(state.params) == {"policy"} and len(adapters) == 7 * fx.TINY.n_layers
  batch = _batch("tiny", 2)
  np.testing.assert_array_equal(fx.batch_logprobs(fns, merge_lora(state.frozen, adapters, cfg.lora), batch),
                                fx.batch_logprobs(fns, state.frozen, batch),
                                err_msg="B = 0 at init, so the adapted policy must BE the base policy")
  before = jax.device_get(adapters)
  state, m = step(state, batch)
  assert m["kl/mean"] == 0.0, f"first-step KL to the base is {m['kl/mean']}, want exactly 0"
  assert m["step_ok"] == 1.0, "the LoRA step was rejected"
  chex.assert_trees_all_equal(jax.device_get(state.frozen), base, custom_message="the frozen base changed")
  for name, ad in jax.device_get(state.params["policy"]).items():
    assert not np.array_equal(ad["b"], before[name]["b"]), f"{name}.b did not train"
    # dL/dA = (alpha/r) g Bᵀ = 0 while B = 0, and Adam moves a zero-gradient leaf by exactly 0.
    np.testing.assert_array_equal(ad["a"], before[name]["a"], err_msg=f"{name}.a moved on the first step")


# ---------------------------------------------------------------- 8. critics / GAE


def _value_mse_by_hand(comps, lam: float, token_kl=None, kl_coef: float = 0.0) -> float:
  """With a zero value head (V = 0, γ = 1): δ_t = r_t, returns R_t = Σ_k≥t λ^(k-t) r_k, with r_t the outcome
  reward on the last response token minus kl_coef·KL_t; value/mse = token mean of R²."""
  sq = []
  for i, c in enumerate(comps):
    r = np.zeros(len(c.response))
    r[-1] = c.reward
    if token_kl is not None:
      r -= kl_coef * token_kl[i]
    ret = np.array([sum(lam ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))])
    sq.extend(ret**2)
  return float(np.mean(sq))


@pytest.mark.parametrize("critic,kl_in_reward", [("shared", False), ("separate", False),
                                                 pytest.param("shared", True, marks=pytest.mark.slow)])
def test_gae_critic_step(critic, kl_in_reward):
  """First step from a zero value head: values are exactly 0, so value/mse = mean of the GAE returns², by hand."""
  lc = LossConfig(group_size=G, advantage="gae", critic=critic, kl_coef=0.01 if kl_in_reward else 0.0,
                  kl_in_reward=kl_in_reward)
  cfg = TrainConfig(loss=lc)
  before, state, m = fx.one_step(cfg, _batch("tiny", 2), tx=make_optimizer(OptimConfig(lr=1e-3)))
  assert np.isfinite(m["loss"]) and m["step_ok"] == 1.0, f"GAE step not finite: loss {m['loss']}"
  assert {"value/mean", "value/mse", "value/clip_frac"} <= set(m)
  assert ("kl/mean" in m) == (lc.kl_coef > 0 and not kl_in_reward), "KL is a reward term OR a loss term"
  comps, _ = _data("tiny")
  token_kl = None
  if kl_in_reward:  # k3 of the sampler's log-probs against the reference (= the initial policy)
    _, fns, params, _, _ = fx.policy("tiny")
    d = [ref - np.asarray(c.sampler_logp) for ref, c in zip(fx.completion_logprobs(fns, params, comps), comps,
                                                           strict=True)]
    token_kl = [np.exp(x) - x - 1 for x in d]
  assert m["value/mean"] == 0.0 and m["value/clip_frac"] == 0.0, "the value head starts at zero"
  np.testing.assert_allclose(m["value/mse"], _value_mse_by_hand(comps, lc.lam, token_kl, lc.kl_coef), rtol=1e-5,
                             err_msg="GAE returns (targets of the value loss) differ from the hand computation")
  head = "value_head" if critic == "shared" else "critic"  # "critic" = {"backbone", "value_head"}
  for k in (head, "policy"):
    assert fx.max_rel_diff(state.params[k], before[k]) > 0, f"{k} did not train"


def test_a_separate_logprobs_phase_gives_the_same_step():
  """make_logprobs_fn (the controller's "logprobs" phase) carried in the batch == the step computing it."""
  lc = LossConfig(group_size=G, advantage="gae", critic="shared", kl_coef=0.05)
  cfg = TrainConfig(loss=lc)
  batch = _batch("toy", 2, off_policy=False)
  _, fns, params, d_model, _ = fx.policy("toy")
  state = create_train_state(params, cfg, fx.GRAD_TX, d_model=d_model)
  assert step_lib.make_logprobs_fn(fns, TrainConfig(loss=LossConfig(group_size=G)), state) is None, \
      "GRPO without KL needs no pre-pass"
  with jax.disable_jit():
    pre = step_lib.make_logprobs_fn(fns, cfg, state)(state, batch)
    want_state, want = step_lib.train_step(state, batch, fns=fns, cfg=cfg, tx=fx.GRAD_TX)
    got_state, got = step_lib.train_step(state, step_lib.with_logprobs(batch, pre), fns=fns, cfg=cfg, tx=fx.GRAD_TX)
  assert set(pre) == {"ref_logp", "old_values"}
  mask = batch.mask_MBT != 0  # the reference is the initial policy; values start at 0 (zero head)
  want_ref = fx.batch_logprobs(fns, state.params["policy"], batch)
  np.testing.assert_allclose(np.asarray(pre["ref_logp"])[mask], want_ref[mask], rtol=1e-5, atol=1e-6)
  assert not np.any(np.asarray(pre["old_values"]))
  chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want), rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(jax.device_get(got_state.params), jax.device_get(want_state.params), rtol=1e-6,
                              atol=1e-7)


# ---------------------------------------------------------------- 9. every estimator x loss


def _grid() -> list:
  losses = config_lib.POLICY_LOSSES
  out = []
  for i, (adv, loss) in enumerate(itertools.product(config_lib.ADVANTAGES, losses)):
    fast = loss == losses[(i // len(losses)) % len(losses)]  # each estimator once, the losses in turn
    out.append(pytest.param(adv, loss, marks=() if fast else pytest.mark.slow, id=f"{adv}-{loss}"))
  return out


@pytest.mark.parametrize("advantage,policy_loss", _grid())
def test_every_estimator_and_loss_takes_a_finite_step(advantage, policy_loss):
  lc = LossConfig(group_size=G, advantage=advantage, policy_loss=policy_loss, kl_coef=0.01,
                  critic="shared" if advantage == "gae" else "none", kl_in_reward=advantage == "gae")
  before, state, m = fx.one_step(TrainConfig(loss=lc), _batch("toy", 2, off_policy=False), "toy")
  assert m["step_ok"] == 1.0 and np.isfinite(m["loss"]) and 0 < m["grad_norm"] < np.inf, m
  assert m["policy/ratio_mean"] == 1.0, "on-policy ratios must be exactly 1 for every loss"
  assert fx.max_rel_diff(state.params["policy"], before["policy"]) > 0
  chex.assert_tree_all_finite(state.params)


def test_truncated_is_weight_scales_each_tokens_loss():
  """At unit ratios (on-policy) PPO's token loss is -A, times the truncated weight min(pi/mu, cap) against the
  sampler: the step's loss equals that token-mean, from the trainer's and the sampler's log-probs by hand."""
  batch = _batch("toy", 1, off_policy=False)
  _, fns, params, _, _ = fx.policy("toy")
  logp_BT = fx.batch_logprobs(fns, params, batch)[0]
  mask_BT, sampler_BT = batch.mask_MBT[0], batch.sampler_logp_MBT[0]
  adv_B = np.asarray(adv_lib.grpo(batch.rewards_MB[0], G))
  log_r_BT, wants = np.where(mask_BT > 0, logp_BT - sampler_BT, 0.0), {}
  for cap, level in ((None, "token"), (1.0, "token"), (1.2, "token"), (1.2, "geometric")):
    if level == "geometric":  # one weight a sequence: the geometric mean of its tokens' ratios, capped
      log_r_BT = np.broadcast_to((log_r_BT * mask_BT).sum(1, keepdims=True) / mask_BT.sum(1, keepdims=True),
                                 log_r_BT.shape)
    w_BT = np.ones_like(logp_BT) if cap is None else np.minimum(np.exp(log_r_BT), cap)
    want = -(adv_B[:, None] * w_BT * mask_BT).sum() / mask_BT.sum()
    _, _, m = fx.one_step(TrainConfig(loss=LossConfig(group_size=G, is_cap=cap, is_level=level)), batch, "toy")
    np.testing.assert_allclose(m["loss"], want, rtol=1e-5, err_msg=f"is_cap={cap} is_level={level}")
    wants[cap, level] = want
    if (cap, level) == (1.2, "token"):
      assert 0 < (w_BT < 1.2)[mask_BT > 0].mean() < 1, "the cap must bind on some tokens and not others"
  assert abs(wants[1.2, "geometric"] / wants[1.2, "token"] - 1) > 1e-3, "the levels must weigh this batch apart"


def test_entropy_bonus_lowers_the_loss_by_its_coefficient_times_the_mean_entropy():
  batch = _batch("toy", 1, off_policy=False)
  _, _, base = fx.one_step(TrainConfig(loss=LossConfig(group_size=G)), batch, "toy")
  _, _, bonus = fx.one_step(TrainConfig(loss=LossConfig(group_size=G, entropy_coef=0.1)), batch, "toy")
  assert base["entropy/mean"] > 1.0  # the toy's near-uniform 32-token softmax
  np.testing.assert_allclose(bonus["loss"], base["loss"] - 0.1 * base["entropy/mean"], rtol=1e-5)
  assert not np.isclose(bonus["grad_norm"], base["grad_norm"], rtol=1e-4), "the bonus must reach the gradient"


def test_kl_is_measured_against_the_initial_weights_once_the_policy_moved():
  """Two steps at lr 0.05: the second step's kl/mean is k3 between the moved policy's log-probs and the initial
  ones, by hand (a reference that followed the policy would read 0), and the reference copy is unchanged."""
  cfg = TrainConfig(loss=LossConfig(group_size=G, kl_coef=0.1, is_cap=None), optim=OptimConfig(lr=0.05))
  tx = make_optimizer(cfg.optim)
  _, fns, params, d_model, _ = fx.policy("toy")
  batch = _batch("toy", 1, off_policy=False)
  state = create_train_state(params, cfg, tx, d_model=d_model)
  initial = jax.device_get(state.params["policy"])
  with jax.disable_jit():
    state, m1 = step_lib.train_step(state, batch, fns=fns, cfg=cfg, tx=tx)
    moved = jax.device_get(state.params["policy"])
    state, m2 = step_lib.train_step(state, batch, fns=fns, cfg=cfg, tx=tx)
  assert float(m1["kl/mean"]) == 0.0
  d_BT = fx.batch_logprobs(fns, initial, batch)[0] - fx.batch_logprobs(fns, moved, batch)[0]
  mask_BT = batch.mask_MBT[0]
  want = ((np.exp(d_BT) - d_BT - 1) * mask_BT).sum() / mask_BT.sum()
  assert want > 1e-6, "the first step must move the policy"
  np.testing.assert_allclose(float(m2["kl/mean"]), want, rtol=1e-4)
  fx.assert_trees_close(jax.device_get(state.ref), initial, rtol=0.0, what="the reference after two steps")


def test_config_name_lists_match_the_registries():
  assert set(config_lib.POLICY_LOSSES) == set(loss_lib.POLICY_LOSS_FNS)
  assert set(config_lib.ADVANTAGES) == set(adv_lib.ADVANTAGE_FNS) | set(config_lib.TOKEN_REWARD_ADVANTAGES)
  assert set(config_lib.AGGREGATIONS) == set(AGG_MODES)


# ---------------------------------------------------------------- 10. learning signal


def test_grpo_raises_the_rewarded_responses_on_a_bandit():
  """One prompt; the 4 responses differ only in the first token; reward 1 iff it is 7. Each step samples
  2 groups (each a permutation of the list). After 5 AdamW steps (lr 1e-2) the rewarded responses'
  log-prob must gain on the others. Observed: mean sequence log-prob gap -0.57 -> +13.8 nats, and
  log p(7 | prompt) -5.18 -> -2.67."""
  prompt, responses = [3, 14, 15], [[7, 20, 21], [9, 20, 21], [7, 30, 31], [12, 30, 31]]
  rewarded = np.array([r[0] == 7 for r in responses])
  cfg = TrainConfig(loss=LossConfig(group_size=G, is_cap=None), optim=OptimConfig(lr=1e-2))
  state, step = fx.fresh_state(cfg, "tiny", None, make_optimizer(cfg.optim))
  _, fns, _, _, _ = fx.policy("tiny")
  probe = [Completion(prompt, r, 0.0, [0.0] * 3) for r in responses]

  def gap_and_first(params):
    logps = fx.completion_logprobs(fns, params, probe)
    seq_logp = np.array([lp.sum() for lp in logps])
    return seq_logp[rewarded].mean() - seq_logp[~rewarded].mean(), logps[0][0]  # logps[0][0] = log p(7 | prompt)

  rng = np.random.RandomState(0)
  gap_before, first_before = gap_and_first(state.params["policy"])
  for _ in range(5):
    order = np.concatenate([rng.permutation(4) for _ in range(2)])
    comps = [Completion(prompt, responses[i], float(rewarded[i]), [0.0] * 3) for i in order]
    state, m = step(state, build_batch(comps, n_micro=1, rows=8, row_len=6, resp_len=3, pack=False))
    assert m["step_ok"] == 1.0
  gap_after, first_after = gap_and_first(state.params["policy"])
  assert gap_after > gap_before + 5.0, f"GRPO did not learn the bandit: gap {gap_before:.3f} -> {gap_after:.3f}"
  assert first_after > first_before + 1.0, f"log p(7 | prompt) {first_before:.3f} -> {first_after:.3f}"


# ---------------------------------------------------------------- 11. errors before compilation


def test_check_batch_rejects_what_cannot_split():
  mesh = make_mesh({"fsdp": 8})
  comps = fx.ragged_completions(N, fx.TINY.vocab_size)
  ok = build_batch(comps, n_micro=2, rows=8, row_len=PAD_ROW_LEN, resp_len=RESP_LEN, pack=False)
  check_batch(ok, mesh, TRAIN_RULES, G)  # 8 rows, 8 sequences per microbatch over 8 devices: fine
  four_rows = build_batch(comps, n_micro=2, rows=4, row_len=32, resp_len=RESP_LEN, pack=True)
  with pytest.raises(ValueError, match=r"4 rows and 8 sequences per microbatch; both must divide by the "
                                       r"data-parallel width 8"):
    check_batch(four_rows, mesh, TRAIN_RULES, G)
  twelve_seqs = build_batch(comps[:12], n_micro=1, rows=8, row_len=32, resp_len=RESP_LEN, pack=True)
  with pytest.raises(ValueError, match="8 rows and 12 sequences"):
    check_batch(twelve_seqs, mesh, TRAIN_RULES, G)
  check_batch(twelve_seqs, None, TRAIN_RULES, G)  # one device: 12 = 3 whole groups
  six = build_batch(comps[:6], n_micro=1, rows=6, row_len=PAD_ROW_LEN, resp_len=RESP_LEN, pack=False)
  with pytest.raises(ValueError, match="6 sequences are not whole groups of group_size=4"):
    check_batch(six, None, TRAIN_RULES, G)
  V = fx.TINY.vocab_size
  check_batch(ok, mesh, TRAIN_RULES, G, vocab_size=V)
  oov = [dataclasses.replace(c, response=[*c.response[:-1], V]) if i == 3 else c for i, c in enumerate(comps)]
  with pytest.raises(ValueError, match=rf"holds 2 token ids outside the model's vocabulary \[0, {V}\), e.g. \[{V}\]"):
    check_batch(build_batch(oov, n_micro=2, rows=8, row_len=PAD_ROW_LEN, resp_len=RESP_LEN, pack=False), mesh,
                TRAIN_RULES, G, vocab_size=V)  # the token's row entry and its target


@pytest.mark.parametrize("kwargs,match", [
    (dict(advantage="gae"), r"advantage='gae' with critic='none'"),
    (dict(critic="shared"), r"advantage='grpo' with critic='shared'"),
    (dict(group_size=1), r"advantage='grpo'.*group_size must be >= 2"),
    (dict(group_size=1, advantage="rloo"), r"advantage='rloo'.*group_size must be >= 2"),
    (dict(advantage="ppo"), r"LossConfig.advantage='ppo'"),
    (dict(policy_loss="grpo"), r"LossConfig.policy_loss='grpo'"),
    (dict(critic="big"), r"LossConfig.critic='big'"),
    (dict(kl_kind="k4"), r"LossConfig.kl_kind='k4'"),
    (dict(agg="seq-mean"), r"LossConfig.agg='seq-mean'"),
    (dict(kl_coef=0.1, kl_in_reward=True), r"advantage='grpo' never reads .* use advantage='reinforce_pp' or 'gae'"),
    # Accepted before, then ignored (the first three) or failing at the first step (the last two).
    (dict(policy_loss="gspo", dual_clip=3.0), r"dual_clip bounds PPO's clipped loss; policy_loss='gspo'"),
    (dict(is_cap=None, is_mask_high=5.0), r"with is_cap=None they would be ignored"),
    (dict(temperature=float("inf")), r"temperature must be finite"),
    (dict(advantage="reinforce_pp", kl_in_reward=True), r"kl_in_reward=True .* needs kl_coef > 0"),
    (dict(is_mask_low=2.0, is_mask_high=1.0), r"is_mask_low=2.0 must be < is_mask_high=1.0"),
    (dict(is_level="seq"), r"LossConfig.is_level='seq'; expected one of \('token', 'sequence', 'geometric'\)"),
    (dict(is_cap=None, is_level="geometric"), r"is_level='geometric' says what the importance weight"),
    (dict(grpo_std_ddof=2), r"LossConfig.grpo_std_ddof=2; expected 0"),
    (dict(advantage="rloo", grpo_std_ddof=0), r"advantage='rloo' divides by none"),
    (dict(gae_whiten=False), r"advantage='grpo' is not GAE"),
])
def test_loss_config_rejects_bad_settings_naming_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LossConfig(**{"group_size": G, **kwargs})


def test_optim_config_refuses_a_nan_clip():
  """max_grad_norm=nan passed `< 0`, and clipping by it then wrote NaN weights in a step that reported success."""
  with pytest.raises(ValueError, match=r"OptimConfig.max_grad_norm=nan must be finite"):
    OptimConfig(max_grad_norm=float("nan"))


def test_loss_config_accepts_group_size_one_where_nothing_compares():
  LossConfig(group_size=1, advantage="reinforce_pp")  # REINFORCE++ whitens over the batch, not the group


def test_each_policy_loss_clips_at_its_own_range_unless_the_config_sets_one():
  """Before: LossConfig's clip_low/clip_high defaulted to PPO's 0.2/0.2 and always reached the loss, so GSPO
  clipped its sequence ratio ~500x wider than its paper's (3e-4, 4e-4) and CISPO always had a lower bound of 0.8
  (its paper has none; clip_low=None was refused). Hand-worked: two tokens of log-ratio 0.01, A = 1 (GSPO:
  s = e^0.01 = 1.01005, past 1 + 4e-4: loss -1.0004 a token, no gradient); a token of ratio 0.5, A = -1
  (CISPO: gradient -w·A = w, 0.5 unbounded, 0.8 at clip_low=0.2); a token of ratio 1.3, A = 1 (PPO: 1.2)."""
  def loss_and_grad(lc, logp, old, adv):
    mask = np.ones_like(logp)
    f = lambda lp: step_lib._policy_loss(lp, old, adv, mask, lc)[0].sum()  # noqa: E731
    return float(f(logp)), np.asarray(jax.grad(f)(logp))

  two, zero, one = np.full((1, 2), 0.01, np.float32), np.zeros((1, 2), np.float32), np.ones((1, 2), np.float32)
  loss, grad = loss_and_grad(LossConfig(group_size=G, policy_loss="gspo"), two, zero, one)
  np.testing.assert_allclose([loss, *grad[0]], [-2 * 1.0004, 0.0, 0.0], rtol=1e-6)
  loss, grad = loss_and_grad(LossConfig(group_size=G, policy_loss="gspo", clip_low=0.2, clip_high=0.2), two, zero, one)
  np.testing.assert_allclose([loss, *grad[0]], [-2 * np.exp(0.01), -np.exp(0.01), -np.exp(0.01)], rtol=1e-6)

  half, minus = np.log(np.full((1, 1), 0.5, np.float32)), -np.ones((1, 1), np.float32)
  _, grad = loss_and_grad(LossConfig(group_size=G, policy_loss="cispo"), half, np.zeros((1, 1), np.float32), minus)
  np.testing.assert_allclose(grad, [[0.5]], rtol=1e-6)
  _, grad = loss_and_grad(LossConfig(group_size=G, policy_loss="cispo", clip_low=0.2), half,
                          np.zeros((1, 1), np.float32), minus)
  np.testing.assert_allclose(grad, [[0.8]], rtol=1e-6)

  loss, _ = loss_and_grad(LossConfig(group_size=G), np.log(np.full((1, 1), 1.3, np.float32)),
                          np.zeros((1, 1), np.float32), np.ones((1, 1), np.float32))
  np.testing.assert_allclose(loss, -1.2, rtol=1e-6)  # PPO keeps 0.2 / 0.2


def test_gspo_weighs_every_sequence_alike_unless_the_config_sets_an_aggregation():
  """GSPO's objective is a mean over sequences (its token form: each sequence's token mean, then the mean over
  sequences): with agg left unset its step is the seq-mean-token-mean step, not token-mean's (the ragged toy
  completions have 1 to 10 tokens, so the two differ). PPO and CISPO keep token-mean."""
  assert [LossConfig(group_size=G, policy_loss=p).aggregation for p in ("ppo", "gspo", "cispo")] == [
      "token-mean", "seq-mean-token-mean", "token-mean"]
  assert LossConfig(group_size=G, policy_loss="gspo", agg="token-mean").aggregation == "token-mean"
  cfg = lambda **kw: TrainConfig(loss=LossConfig(group_size=G, kl_coef=0.01, policy_loss="gspo", **kw))  # noqa: E731
  got = _run(cfg(), "toy", 1)
  _assert_same_step(got, _run(cfg(agg="seq-mean-token-mean"), "toy", 1), "gspo default vs seq-mean-token-mean")
  with pytest.raises(AssertionError):
    _assert_same_step(got, _run(cfg(agg="token-mean"), "toy", 1), "gspo default vs token-mean")
