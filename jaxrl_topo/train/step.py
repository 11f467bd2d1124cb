"""The pure, sharded RL train step: `new_state, metrics = step(state, batch)`.

One step on a TrainBatch of M microbatches:
  1. (no grad) reference log-probs and old values, one microbatch at a time, unless the batch
     already carries them (`make_logprobs_fn`: the same pass as its own program, so a controller
     can time the "logprobs" phase on its own);
  2. advantages over the GLOBAL batch (group statistics, whitening, GAE);
  3. `lax.scan` over microbatches accumulating gradients of the loss, each microbatch's loss
     already divided by the global normalisers, so the sum IS the full-batch loss: results do
     not depend on the microbatch count, the padding/packing layout or the data-parallel width;
  4. optax update, rejected (params and optimizer state untouched, `rejected` + 1) if the loss
     or the gradient is not finite.
With `rl.epochs` E or `rl.minibatches` K above 1 (PPO's K-epoch, minibatch updates), steps 3-4 run E x K
times: the microbatches split into K minibatches of consecutive microbatches, each update on one (its loss
normalised over its own tokens), every epoch over all K in order. The ratio's old policy is the step's
starting weights (their log-probs, one more no-grad pass), so clip_low/clip_high bind from the second update
on; advantages stay those of step 2. One step is still one version: the whole step is kept or rejected.
The step is deterministic: nothing in it samples, so it needs no RNG. Letters as in batch.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_topo.rl import advantages as adv_lib
from jaxrl_topo.rl import losses as loss_lib
from jaxrl_topo.rl.core import aggregate, masked_mean, masked_whiten, normalizers
from jaxrl_topo.rl.offpolicy import truncated_is_weight
from jaxrl_topo.train.batch import TrainBatch
from jaxrl_topo.train.config import LossConfig, TrainConfig
from jaxrl_topo.train.lora import merge_lora
from jaxrl_topo.train.optim import learning_rate
from jaxrl_topo.train.policy import PolicyFns, sequence_hidden, sequence_logprobs
from jaxrl_topo.train.state import TrainState

_MICRO_FIELDS = ("tokens_MRS", "positions_MRS", "segment_ids_MRS", "gather_MBT", "targets_MBT", "mask_MBT",
                 "sampler_logp_MBT", "old_logp_MBT")


def _micro(batch: TrainBatch) -> dict:
  """The per-microbatch arrays, stacked on a leading M axis (what the scans iterate over)."""
  return {k: getattr(batch, k) for k in _MICRO_FIELDS if getattr(batch, k) is not None}


def _rows(mb: dict) -> tuple:
  return mb["tokens_MRS"], mb["positions_MRS"], mb["segment_ids_MRS"]


def _logprobs(fns: PolicyFns, params, mb: dict, lc: LossConfig):
  return sequence_logprobs(fns, params, _rows(mb), mb["gather_MBT"], mb["targets_MBT"],
                           temperature=lc.temperature, chunk=lc.logprob_chunk)


def _values(fns: PolicyFns, trainable: dict, mb: dict, h_BTD):
  """V(s_t) per response token: the value head on the policy's (shared) or the critic's hidden states."""
  if "critic" in trainable:
    h_BTD = sequence_hidden(fns, trainable["critic"]["backbone"], _rows(mb), mb["gather_MBT"])
    head = trainable["critic"]["value_head"]
  else:
    head = trainable["value_head"]
  return jnp.einsum("BTD,D->BT", h_BTD.astype(jnp.float32), head)


def _policy(state: TrainState, trainable: dict, cfg: TrainConfig):
  return merge_lora(state.frozen, trainable["policy"], cfg.lora) if cfg.lora.enabled else trainable["policy"]


_PRE_FIELDS = {"ref_logp": "ref_logp_MBT", "old_values": "old_values_MBT"}


def _pre_needed(lc: LossConfig) -> set[str]:
  return ({"ref_logp"} if lc.needs_ref else set()) | ({"old_values"} if lc.critic != "none" else set())


def _prepass(state: TrainState, micro: dict, fns: PolicyFns, cfg: TrainConfig) -> dict:
  """Reference log-probs and old values for every microbatch, without gradients."""
  lc = cfg.loss
  ref_params = state.frozen if cfg.lora.enabled else state.ref

  def one(mb):
    out = {}
    if lc.needs_ref:
      out["ref_logp"] = _logprobs(fns, ref_params, mb, lc)[0]
    if lc.critic != "none":
      h_BTD = None
      if lc.critic == "shared":
        h_BTD = sequence_hidden(fns, _policy(state, state.params, cfg), _rows(mb), mb["gather_MBT"])
      out["old_values"] = _values(fns, state.params, mb, h_BTD)
    return out

  if not _pre_needed(lc):
    return {}
  return jax.lax.stop_gradient(jax.lax.map(one, micro))


def _pre(state: TrainState, batch: TrainBatch, micro: dict, fns: PolicyFns, cfg: TrainConfig) -> dict:
  """What the loss needs from before the update: taken from the batch if the logprobs phase filled it."""
  need = _pre_needed(cfg.loss)
  given = {k: getattr(batch, f) for k, f in _PRE_FIELDS.items() if getattr(batch, f) is not None}
  if need <= given.keys():
    return {k: jax.lax.stop_gradient(given[k]) for k in need}
  return _prepass(state, micro, fns, cfg)


def _advantages(batch: TrainBatch, pre: dict, lc: LossConfig):
  """(adv_MBT, returns_MBT or None) over the global batch."""
  M, B, T = batch.mask_MBT.shape
  mask_NT = batch.mask_MBT.reshape(M * B, T)
  rewards_N = batch.rewards_MB.reshape(M * B)
  flat = lambda x: x.reshape(M * B, T)
  returns = None
  if lc.advantage in adv_lib.ADVANTAGE_FNS:
    options = {"std_ddof": lc.grpo_std_ddof} if lc.advantage == "grpo" else {}
    adv_NT = adv_lib.ADVANTAGE_FNS[lc.advantage](rewards_N, lc.group_size, mask_NT, **options)
  else:
    token_r_NT = adv_lib.sequence_rewards_to_tokens(rewards_N, mask_NT)
    if lc.kl_in_reward:  # the KL of the sampled tokens (sampler log-probs stand in for the old policy)
      kl_NT = loss_lib.kl_penalty(flat(batch.sampler_logp_MBT), flat(pre["ref_logp"]), lc.kl_kind, mask_BT=mask_NT)
      token_r_NT = token_r_NT - lc.kl_coef * jnp.where(mask_NT != 0, kl_NT, 0.0)
    if lc.advantage == "reinforce_pp":
      adv_NT = adv_lib.reinforce_pp(token_r_NT, mask_NT, gamma=lc.gamma)
    else:
      adv_NT, ret_NT = adv_lib.gae(token_r_NT, flat(pre["old_values"]), mask_NT, gamma=lc.gamma, lam=lc.lam)
      adv_NT, returns = masked_whiten(adv_NT, mask_NT) if lc.gae_whiten else adv_NT, ret_NT.reshape(M, B, T)
  return adv_NT.reshape(M, B, T), returns


def _policy_loss(logp, old, adv, keep, lc: LossConfig):
  clip = {k: v for k, v in (("clip_low", lc.clip_low), ("clip_high", lc.clip_high)) if v is not None}  # else the loss's
  if lc.policy_loss == "ppo":
    return loss_lib.ppo_clip(logp, old, adv, keep, dual_clip=lc.dual_clip, **clip)
  if lc.policy_loss == "gspo":
    return loss_lib.gspo(logp, old, adv, keep, **clip)
  return loss_lib.cispo(logp, old, adv, keep, **clip)


def _token_terms(logp, ent, values, mb: dict, extra: dict, lc: LossConfig):
  """(loss_BT, value_loss_BT or None, metrics) from per-token quantities: the objective in one place.

  The scan differentiates loss_BT microbatch by microbatch; after it, the same function runs once
  over the whole batch's (stopped) per-token quantities for the metrics, so the ESS, per-sequence
  ratios and clip fractions are exact global figures whatever the microbatching.
  """
  mask = mb["mask_MBT"]
  old = mb["old_logp_MBT"] if "old_logp_MBT" in mb else jax.lax.stop_gradient(logp)  # on-policy: ratio == 1
  metrics = {}
  if lc.is_cap is not None:
    w, keep, metrics = truncated_is_weight(old, mb["sampler_logp_MBT"], mask, cap=lc.is_cap,
                                           mask_low=lc.is_mask_low, mask_high=lc.is_mask_high, level=lc.is_level)
  else:
    w, keep = jnp.ones_like(logp), mask
  loss_BT, policy_metrics = _policy_loss(logp, old, extra["adv"], keep, lc)
  loss_BT = loss_BT * w
  metrics.update(policy_metrics)
  if lc.needs_ref and not lc.kl_in_reward:
    kl_BT, kl_metrics = loss_lib.kl_loss(logp, extra["ref_logp"], keep, kind=lc.kl_kind)
    loss_BT, metrics = loss_BT + lc.kl_coef * kl_BT, {**metrics, **kl_metrics}
  if lc.entropy_coef:
    loss_BT = loss_BT - lc.entropy_coef * ent
  metrics["entropy/mean"] = masked_mean(jax.lax.stop_gradient(ent), mask)
  value_BT = None
  if values is not None:
    value_BT, v_metrics = loss_lib.value_loss(values, extra["old_values"], extra["returns"], mask, clip=lc.value_clip)
    metrics.update(v_metrics)
  return jnp.where(keep != 0, loss_BT, 0.0), value_BT, metrics


def _micro_loss(trainable, state, mb, extra, norm, *, fns: PolicyFns, cfg: TrainConfig):
  """This microbatch's share of the global loss, plus its per-token quantities for the metrics."""
  lc = cfg.loss
  logp, ent, h_BTD = _logprobs(fns, _policy(state, trainable, cfg), mb, lc)
  values = _values(fns, trainable, mb, h_BTD) if lc.critic != "none" else None
  loss_BT, value_BT, _ = _token_terms(logp, ent, values, mb, extra, lc)
  total = aggregate(loss_BT, mb["mask_MBT"], lc.aggregation, norm)
  if value_BT is not None:
    total = total + lc.value_coef * aggregate(value_BT, mb["mask_MBT"], "token-mean", norm)
  per_token = {"logp": logp, "ent": ent} if values is None else {"logp": logp, "ent": ent, "values": values}
  return total, jax.lax.stop_gradient(per_token)


def _global_metrics(per_token_MBT: dict, micro: dict, extras: dict, lc: LossConfig) -> dict:
  """The objective's diagnostics over the whole batch at once (M folded into B)."""
  flat = lambda x: x.reshape(-1, *x.shape[2:])
  t = {k: flat(v) for k, v in per_token_MBT.items()}
  micro, extras = jax.tree.map(flat, micro), jax.tree.map(flat, extras)
  return _token_terms(t["logp"], t["ent"], t.get("values"), micro, extras, lc)[2]


def _logprob_gap(logp_MBT, batch: TrainBatch) -> dict:
  """|trainer - sampler| log-prob of the tokens sampled under this step's starting weights: 0 up to
  numerics (matmul precision, bf16, kernel differences); what the IS correction sees when nothing is stale."""
  on = batch.mask_MBT if batch.onpolicy_MBT is None else batch.onpolicy_MBT
  gap = jnp.abs(logp_MBT - batch.sampler_logp_MBT)
  return {"logprob_gap/max": jnp.max(jnp.where(on != 0, gap, 0.0)), "logprob_gap/mean": masked_mean(gap, on),
          "logprob_gap/tokens": jnp.sum(on)}


def _accumulate(params, state: TrainState, micro: dict, extras: dict, norm, grad_fn):
  """(grads, loss, per-token quantities) of `params` summed over the microbatches (`lax.scan`, one at a time)."""

  def body(carry, xs):
    grads_acc, loss_acc = carry
    mb, extra = xs
    (loss, per_token), grads = grad_fn(params, state, mb, extra, norm)
    return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss), per_token

  zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
  (grads, loss), per_token_MBT = jax.lax.scan(body, zeros, (micro, extras))
  return grads, loss, per_token_MBT


def _updates(state: TrainState, micro: dict, extras: dict, grad_fn, lc: LossConfig, tx):
  """lc.epochs passes of lc.minibatches optax updates (`lax.scan` over the E x K updates; K consecutive
  microbatches each): (params, opt_state, mean loss, mean grad norm, all finite, the last pass's per-token
  quantities [M, B, T])."""
  K, M = lc.minibatches, micro["mask_MBT"].shape[0]
  if M % K:
    raise ValueError(f"rl.minibatches={K} does not divide the step's {M} microbatches (run.n_micro)")
  mini = jax.tree.map(lambda x: x.reshape(K, M // K, *x.shape[1:]), (micro, extras))

  def update(carry, i):
    params, opt_state = carry
    mb, extra = jax.tree.map(lambda x: x[i % K], mini)
    m, B, T = mb["mask_MBT"].shape
    grads, loss, per_token = _accumulate(params, state, mb, extra, normalizers(mb["mask_MBT"].reshape(m * B, T)),
                                         grad_fn)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    return (optax.apply_updates(params, updates), opt_state), (loss, grad_norm, ok, per_token)

  (params, opt_state), (loss, grad_norm, ok, per_token) = jax.lax.scan(
      update, (state.params, state.opt_state), jnp.arange(lc.updates))
  last = jax.tree.map(lambda x: x[-K:].reshape(M, *x.shape[2:]), per_token)
  return params, opt_state, jnp.mean(loss), jnp.mean(grad_norm), jnp.all(ok), last


def train_step(state: TrainState, batch: TrainBatch, *, fns: PolicyFns, cfg: TrainConfig,
               tx: optax.GradientTransformation):
  """(state, batch) -> (state, metrics): see the module docstring. Metrics (scalars): loss, grad_norm (means over
  the step's updates when it makes several), lr, step_ok (0: rejected), reward/mean|std, adv/mean, tokens,
  response_len/mean, entropy/mean, logprob_gap/max|mean|tokens, the policy loss's policy/... (clip_frac,
  ratio_mean, ...: over the last pass when the step makes several updates), and as configured is/... (truncated
  IS), kl/mean, value/...."""
  lc = cfg.loss
  micro = _micro(batch)
  M, B, T = batch.mask_MBT.shape
  norm = normalizers(batch.mask_MBT.reshape(M * B, T))
  pre = _pre(state, batch, micro, fns, cfg)
  adv_MBT, returns_MBT = _advantages(batch, pre, lc)
  extras = {"adv": adv_MBT, **pre}
  if returns_MBT is not None:
    extras["returns"] = returns_MBT
  grad_fn = jax.value_and_grad(functools.partial(_micro_loss, fns=fns, cfg=cfg), has_aux=True)
  if lc.updates == 1:
    grads, loss, per_token_MBT = _accumulate(state.params, state, micro, extras, norm, grad_fn)
    start_logp_MBT = per_token_MBT["logp"]
  else:
    start_logp_MBT = jax.lax.stop_gradient(jax.lax.map(lambda mb: _logprobs(fns, _policy(state, state.params, cfg),
                                                                            mb, lc)[0], micro))
    micro = {"old_logp_MBT": start_logp_MBT, **micro}  # a proximal policy the batch carries wins
    params, opt_state, loss, grad_norm, ok, per_token_MBT = _updates(state, micro, extras, grad_fn, lc, tx)
  metrics = _global_metrics(per_token_MBT, micro, extras, lc)
  metrics.update(_logprob_gap(start_logp_MBT, batch))
  if lc.updates == 1:
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
  keep_old = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
  rewards = batch.rewards_MB.reshape(-1)
  n_tokens = jnp.sum(batch.mask_MBT.astype(jnp.float32))
  metrics.update({
      "loss": loss, "grad_norm": grad_norm, "lr": learning_rate(cfg.optim)(state.step),
      "reward/mean": jnp.mean(rewards), "reward/std": jnp.std(rewards),
      "adv/mean": masked_mean(adv_MBT, batch.mask_MBT), "tokens": n_tokens,  # the count (norm's is at least 1)
      "response_len/mean": n_tokens / (M * B), "step_ok": ok.astype(jnp.float32),
  })
  new_state = state.replace(step=state.step + 1, params=keep_old(params, state.params),
                            opt_state=advance_schedule(keep_old(opt_state, state.opt_state), opt_state),
                            rejected=state.rejected + (~ok).astype(jnp.int32))
  return new_state, metrics


def advance_schedule(kept, new):
  """`kept` (a rejected step's restored optimizer state) with the learning-rate schedule's counters of `new`: the
  schedule counts train steps, rejected ones included, as `TrainState.step` and the logged `lr` do. AdamW's own
  count (its bias correction) stays with the moments it corrects."""
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
  return jax.tree.map(lambda k, n: n if is_schedule(k) else k, kept, new, is_leaf=is_schedule)


def batch_axes(mesh, rules) -> tuple[str, ...]:
  """The mesh axes the rules send the logical `batch` dim to (those the mesh has)."""
  target = dict(rules).get("batch")
  axes = (target,) if isinstance(target, str) else tuple(target or ())
  return tuple(a for a in axes if a in mesh.shape)


def batch_sharding_for(mesh, rules) -> NamedSharding:
  """The TrainBatch arrays' sharding: dim 1 (rows / sequences) over the rules' batch axes."""
  return NamedSharding(mesh, PartitionSpec(None, batch_axes(mesh, rules) or None))


def make_train_step(fns: PolicyFns, cfg: TrainConfig, tx: optax.GradientTransformation, state: TrainState,
                    *, mesh=None, rules=None):
  """The jitted step: in/out shardings from `state` (and batch over the rules' `batch` axes), state donated.

  Batch arrays are [M, rows or sequences, ...]: dim 1 is split over the data-parallel axes, so
  the per-microbatch row/sequence counts must divide by their product (checked in `check_batch`).
  """
  if cfg.loss.critic != "none" and fns.hidden is None:
    raise ValueError(f"rl.critic={cfg.loss.critic!r} reads the policy's hidden states: give PolicyFns(hidden=..., "
                     "unembed=...) (e.g. policy.model_fns(graphdef)), not apply=...")
  per = getattr(tx, "updates_per_step", None)  # optim.Optimizer's; a plain optax chain counts its own updates
  if per is not None and per != cfg.loss.updates:
    raise ValueError(f"the optimizer counts {per} update(s) a train step, but the loss makes {cfg.loss.updates} "
                     f"(LossConfig epochs x minibatches = {cfg.loss.epochs} x {cfg.loss.minibatches}): its schedule "
                     "would run that many times too fast or slow; build it with "
                     "optim.make_optimizer(cfg.optim, cfg.loss.updates)")
  shardings = jax.tree.map(lambda x: x.sharding, state)
  batch_sharding = metric_sharding = None
  if mesh is not None:
    batch_sharding = batch_sharding_for(mesh, rules)
    metric_sharding = NamedSharding(mesh, PartitionSpec())
  step = functools.partial(train_step, fns=fns, cfg=cfg, tx=tx)
  return jax.jit(step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, metric_sharding),
                 donate_argnums=0)


def make_logprobs_fn(fns: PolicyFns, cfg: TrainConfig, state: TrainState, *, mesh=None, rules=None):
  """The "logprobs" phase as its own jitted program: (state, batch) -> {"ref_logp", "old_values"}
  (the [M, B, T] arrays the loss needs; put them in the batch as ref_logp_MBT / old_values_MBT).
  None when the loss needs neither. The state is read, not donated: the train step follows."""
  if not _pre_needed(cfg.loss):
    return None
  shardings = jax.tree.map(lambda x: x.sharding, state)
  batch_sharding = batch_sharding_for(mesh, rules) if mesh is not None else None
  return jax.jit(lambda st, batch: _prepass(st, _micro(batch), fns, cfg), in_shardings=(shardings, batch_sharding),
                 out_shardings=batch_sharding)


def with_logprobs(batch: TrainBatch, pre: dict) -> TrainBatch:
  """`batch` carrying the logprobs phase's output."""
  return batch.replace(**{f: pre[k] for k, f in _PRE_FIELDS.items() if k in pre})


def check_batch(batch: TrainBatch, mesh, rules, group_size: int, *, vocab_size: int | None = None) -> None:
  """Raises before compilation if `batch` can't be split over the mesh, breaks prompt groups, or holds a token id
  outside [0, vocab_size) (the model would read a NaN embedding, and the step would reject the batch as non-finite
  without saying why). Reads the host arrays `build_batch` made; nothing is sent to a device."""
  M, R, _ = batch.tokens_MRS.shape
  if vocab_size is not None:
    ids = np.concatenate([np.asarray(batch.tokens_MRS).ravel(), np.asarray(batch.targets_MBT).ravel()])
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
      raise ValueError(f"the batch holds {bad.size} token ids outside the model's vocabulary [0, {vocab_size}), "
                       f"e.g. {sorted(set(bad.tolist()))[:5]}")
  B = batch.mask_MBT.shape[1]
  ways = 1
  if mesh is not None:
    for a in batch_axes(mesh, rules):
      ways *= mesh.shape[a]
  if R % ways or B % ways:
    raise ValueError(f"batch has {R} rows and {B} sequences per microbatch; both must divide by the "
                     f"data-parallel width {ways} ({batch_axes(mesh, rules)})")
  if (M * B) % group_size:
    raise ValueError(f"{M * B} sequences are not whole groups of group_size={group_size}")
