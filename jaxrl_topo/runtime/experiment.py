"""Everything a run needs, built once from a `RunConfig` before the first step (nothing compiles here).

Order: carve the devices (topology), load the policy (a local HF directory; a preset is first written
as one, with the built-in char tokenizer, so both paths are the same), place it on the trainer mesh
(TRAIN_RULES), build the train state and its jitted step, a rollout copy on the rollout mesh
(ROLLOUT_RULES) through a TransferPlan (runtime/sync.py), the rollout engine, the reward worker pool and the prompts.
Every size is checked here, so a bad config fails before anything is compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import jax
import numpy as np
from absl import logging

from jaxrl_topo.data import pipeline
from jaxrl_topo.envs.env import resolve as resolve_env
from jaxrl_topo.envs.env_pool import EnvPool
from jaxrl_topo.envs.reward_pool import CircuitBreaker, RewardPool, score_inline
from jaxrl_topo.envs.turns import EnvTurns, demonstrations
from jaxrl_topo.models import hf_io
from jaxrl_topo.models.attention import training_attention
from jaxrl_topo.models.config import ModelConfig
from jaxrl_topo.models.fresh import write_fresh_model
from jaxrl_topo.models.model import abstract_model
from jaxrl_topo.models.presets import get_preset
from jaxrl_topo.models.tokenizer import Tokenizer
from jaxrl_topo.rl.reward_model import RewardModel
from jaxrl_topo.rollout.dense import DecodeConfig
from jaxrl_topo.rollout.engine import EngineConfig, RolloutEngine
from jaxrl_topo.rollout.engine_config import SHARED_FIELDS
from jaxrl_topo.rollout.generate import generate_ids
from jaxrl_topo.rollout.sampling import SamplingConfig
from jaxrl_topo.runtime.config import RunConfig
from jaxrl_topo.runtime.preflight import check_model
from jaxrl_topo.runtime.sections import MODEL_REWARD
from jaxrl_topo.runtime.sync import WeightSync
from jaxrl_topo.topology.carve import Topology, carve, check_model_fits, log_sharding_table
from jaxrl_topo.topology.hostcomm import broadcast, to_host
from jaxrl_topo.topology.rules import TRAIN_RULES, ActivationSharding
from jaxrl_topo.train.batch import Completion, build_batch
from jaxrl_topo.train.optim import make_optimizer
from jaxrl_topo.train.policy import PolicyFns, model_fns
from jaxrl_topo.train.sft import make_sft_step, sft_optimizer
from jaxrl_topo.train.state import TrainState, create_train_state
from jaxrl_topo.train.step import batch_axes, make_logprobs_fn, make_train_step


@dataclasses.dataclass
class Experiment:
  cfg: RunConfig
  model_dir: str
  model_cfg: ModelConfig
  graphdef: object
  tokenizer: Tokenizer
  topology: Topology
  fns: PolicyFns
  state: TrainState
  step_fn: object  # the jitted train step (state donated)
  logprobs_fn: object | None  # the jitted "logprobs" phase (reference log-probs, old values), None if unused
  sync: WeightSync  # trainer params -> rollout layout (sync.mode)
  engine: RolloutEngine
  rewards: RewardPool
  reward_model: RewardModel | None  # reward.model_dir, on the "reward" role's mesh (else the rollout's)
  prompts: pipeline.PromptIterator
  heldout: list[dict]
  stop_ids: tuple[int, ...]  # rollout.stop entries that are one token: stopped on device
  stop_strings: tuple[str, ...]  # the others: matched on the decoded text after each chunk
  resp_len: int
  row_len: int  # prompt + response limit: the row length when completions are not packed
  dp_width: int  # the trainer's data-parallel width: row counts are multiples of it
  env: EnvTurns | None = None  # env.fn: the engine's turns handler over the environment's worker pool

  def close(self) -> None:
    self.rewards.close()
    if self.env is not None:
      self.env.pool.close()


def matmul_precision(cfg: RunConfig):
  """A context with the run's model.matmul_precision as JAX's default: every program traced inside takes it (a solo
  run wraps its whole run, a mux group each job's build and loop)."""
  if cfg.model.matmul_precision == "default":
    return contextlib.nullcontext()
  return jax.default_matmul_precision(cfg.model.matmul_precision)


def model_dir_for(cfg: RunConfig, workdir: str) -> str:
  """The HF directory the policy starts from: `model.hf_dir`, or a preset written once to the workdir."""
  if cfg.model.hf_dir is not None:
    if not os.path.isfile(os.path.join(cfg.model.hf_dir, "config.json")):
      raise FileNotFoundError(f"model.hf_dir={cfg.model.hf_dir!r} has no config.json")
    return cfg.model.hf_dir
  path = os.path.join(workdir, "init_model")
  # Process 0's answer: a process that looked after process 0 had written the model would skip the barrier.
  if not broadcast(os.path.isfile(os.path.join(path, "config.json")), src=0):
    try:
      model_cfg = get_preset(cfg.model.preset, **cfg.model.overrides)
    except ValueError as e:  # ModelConfig's own checks, e.g. n_heads not a multiple of n_kv_heads
      raise ValueError(f"model.overrides: {e}") from None
    if jax.process_index() == 0:
      write_fresh_model(path, model_cfg, seed=cfg.model.init_seed)
    _barrier("init_model")
  return path


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def split_stops(tokenizer: Tokenizer, stops) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """(stop token ids, stop strings): a stop that encodes to one token stops on device, the rest on text."""
  encoded = [(s, tokenizer.encode(s)) for s in stops]
  return (tuple(ids[0] for _, ids in encoded if len(ids) == 1), tuple(s for s, ids in encoded if len(ids) != 1))


def dev_accuracy(cfg: RunConfig, graphdef, params, tokenizer: Tokenizer, examples: list[dict]) -> float:
  """Greedy accuracy (the main reward's mean) on `examples` with the dense decoder; single-token stop
  strings end a completion like EOS. The same number on every process of a multi-process run: when
  one process holds all of `params` it decodes and tells the others (who cannot read its arrays);
  when they span processes, each decodes a host copy (hostcomm) on its own first device."""
  if jax.process_count() == 1:
    return _dev_accuracy(cfg, graphdef, params, tokenizer, examples)
  holders = sorted({d.process_index for x in jax.tree.leaves(params) for d in x.sharding.device_set})
  if len(holders) > 1:
    local = jax.device_put(to_host(params), jax.local_devices()[0])
    return _dev_accuracy(cfg, graphdef, local, tokenizer, examples)
  acc = _dev_accuracy(cfg, graphdef, params, tokenizer, examples) if jax.process_index() == holders[0] else None
  return broadcast(acc, src=holders[0])


def _dev_accuracy(cfg: RunConfig, graphdef, params, tokenizer: Tokenizer, examples: list[dict]) -> float:
  stop_ids, _ = split_stops(tokenizer, cfg.rollout.stop)
  decode = DecodeConfig(max_new_tokens=cfg.rollout.max_new_tokens, sampling=SamplingConfig(greedy=True),
                        eos_ids=tuple(tokenizer.eos_token_ids) + stop_ids, pad_id=tokenizer.pad_token_id or 0)
  outs = generate_ids(graphdef, params, [ex["prompt_ids"] for ex in examples], decode, batch_size=64, impl="dense")
  result = score_inline([(cfg.reward.fn, 1.0)], [ex["prompt"] for ex in examples],
                        [tokenizer.decode(o.completion_ids) for o in outs], examples)
  return float(np.mean(result.total_N))


def warm_up(cfg: RunConfig, graphdef, params, fns: PolicyFns, tokenizer: Tokenizer, train_examples: list[dict], *,
            row_len: int, resp_len: int):
  """Supervised warm-up (train/sft.py) on the training split's reference answers, each followed by the
  first stop string (or EOS), so the model learns where an answer ends. At most `run.sft_steps`; with
  `run.sft_target_accuracy` > 0 it stops as soon as greedy accuracy on the first `run.sft_dev_size`
  TRAINING prompts reaches the target (checked every `run.sft_eval_every` steps): after a fixed step
  count the accuracy RL starts from varies a lot with the seed, and RL needs a start that is right
  sometimes but not mostly."""
  rc = cfg.run
  dev = train_examples[: rc.sft_dev_size]
  end = tokenizer.encode(cfg.rollout.stop[0]) if cfg.rollout.stop else list(tokenizer.eos_token_ids[:1])
  pairs = [(ex["prompt_ids"], (tokenizer.encode(str(ex["answer"])) + end)[:resp_len], ()) for ex in train_examples
           if ex.get("answer")]
  if cfg.env.fn:  # multi-turn demonstrations, the environment's replies masked (envs/turns.py)
    pairs = demonstrations(tokenizer, resolve_env(cfg.env.fn), [ex for ex in train_examples if ex.get("demo_turns")],
                           chat=cfg.data.chat_template, role=cfg.env.role, resp_len=resp_len, name=cfg.env.fn)
  if not pairs:
    raise ValueError("run.sft_steps > 0 needs training prompts with reference answers")
  step, opt_state = make_sft_step(fns, sft_optimizer(rc.sft_lr, rc.sft_max_grad_norm, rc.sft_weight_decay), params)
  rng = np.random.default_rng(rc.seed)
  t0 = time.perf_counter()
  for i in range(rc.sft_steps):
    pick = rng.choice(len(pairs), size=rc.sft_batch, replace=len(pairs) < rc.sft_batch)
    comps = [Completion(pairs[j][0], pairs[j][1], 0.0, [0.0] * len(pairs[j][1]), pairs[j][2]) for j in pick]
    batch = build_batch(comps, n_micro=rc.sft_n_micro, rows=rc.sft_batch // rc.sft_n_micro, row_len=row_len,
                        resp_len=resp_len, pack=False)
    params, opt_state, loss = step(params, opt_state, batch)
    if (i + 1) % 10 == 0 or i + 1 == rc.sft_steps:
      logging.info("sft warm-up %d/%d: loss %.3f (%.0f s)", i + 1, rc.sft_steps, float(to_host(loss)),
                   time.perf_counter() - t0)
    if rc.sft_target_accuracy > 0 and (i + 1) % rc.sft_eval_every == 0:
      acc = dev_accuracy(cfg, graphdef, params, tokenizer, dev)
      if acc >= rc.sft_target_accuracy:
        logging.info("sft warm-up: dev accuracy %.3f >= %.2f after %d steps; stopping", acc,
                     rc.sft_target_accuracy, i + 1)
        break
  return params


def _cuda_capability(device) -> str | None:
  """A CUDA GPU's compute capability ("9.0"); None elsewhere (CPU, a ROCm GPU: no cuDNN there)."""
  if "cuda" not in str(getattr(getattr(device, "client", None), "platform_version", "")).lower():
    return None
  return getattr(device, "compute_capability", None)


def engine_config(cfg: RunConfig, eos_ids: tuple[int, ...], pad_id: int) -> EngineConfig:
  """The rollout engine's config for a run: rows of prompt + completion, in whole pages; rollout.n_pages = 0 gives
  every slot a full row's pages."""
  rollout = cfg.rollout
  max_len = -(-(cfg.data.max_prompt_len + rollout.max_new_tokens) // rollout.page_size) * rollout.page_size
  n_pages = rollout.n_pages or rollout.n_slots * (max_len // rollout.page_size)
  same = (*SHARED_FIELDS, "sampling", "impl")  # rollout.* of the same name
  return EngineConfig(n_pages=n_pages, max_len=max_len, eos_ids=eos_ids, pad_id=pad_id,
                      **{k: getattr(rollout, k) for k in same})


def build(cfg: RunConfig, workdir: str, *, warmup: bool = True) -> Experiment:
  """`warmup=False` skips the supervised warm-up (a resumed run restores its trained state)."""
  if cfg.reward.fn == MODEL_REWARD and cfg.run.sft_steps and cfg.run.sft_target_accuracy > 0:
    raise ValueError("run.sft_target_accuracy stops the warm-up on a verifier's accuracy; with reward.fn='model' "
                     "there is none: set run.sft_target_accuracy=0 (a fixed run.sft_steps) or run.sft_steps=0")
  check_model(cfg)  # LoRA targets, the reward model's directory and vocabulary (run.train checks before writing)
  os.makedirs(workdir, exist_ok=True)
  topology = carve(cfg.topology)
  model_dir = model_dir_for(cfg, workdir)
  tokenizer = Tokenizer.from_dir(model_dir)
  model_cfg = hf_io.read_config(model_dir, dtype=cfg.model.dtype, attn_block=cfg.model.attn_block)
  device = topology.trainer.devices.flat[0]
  model_cfg = dataclasses.replace(model_cfg, attention=training_attention(
      cfg.model.attention, platform=device.platform, dtype=cfg.model.dtype, packed=cfg.train.max_tokens_per_row > 0,
      head_dim=model_cfg.head_dim, compute_capability=_cuda_capability(device)))
  graphdef, abstract = abstract_model(model_cfg)  # the rollout's (no trainer constraints, no remat)
  # The trainer's: activation sharding constraints on its mesh and the configured remat (the graph
  # tests/test_model.py checks sharded), used by the train step, the logprobs phase and the warm-up.
  train_graphdef, _ = abstract_model(model_cfg, ActivationSharding(topology.trainer, TRAIN_RULES), cfg.train.remat)
  shardings = check_model_fits(topology, abstract)
  log_sharding_table(abstract, topology)

  resp_len = cfg.rollout.max_new_tokens
  row_len = cfg.data.max_prompt_len + resp_len
  ecfg = engine_config(cfg, tuple(tokenizer.eos_token_ids), tokenizer.pad_token_id or 0)
  # Every process reads the whole global batch: each one drives the same global program and must
  # take the same decisions (prompts are a few KB of token ids).
  prompts = pipeline.make_prompt_iterator(cfg.data, tokenizer, process_index=0, process_count=1)
  heldout = pipeline.load_prompts(cfg.data, tokenizer, "heldout").examples
  if cfg.run.eval_size:
    heldout = heldout[: cfg.run.eval_size]
  rewards = RewardPool(cfg.reward.fns, **cfg.reward.pool_options)

  _, _, params = hf_io.load_model(model_dir, topology.trainer, TRAIN_RULES, dtype=cfg.model.dtype)
  tcfg = cfg.train_config
  tx = make_optimizer(tcfg.optim, tcfg.loss.updates)  # the schedule counts steps, not updates
  fns = model_fns(train_graphdef)
  if warmup and cfg.run.sft_steps:
    train_examples = pipeline.load_prompts(cfg.data, tokenizer, "train").examples
    params = warm_up(cfg, graphdef, params, fns, tokenizer, train_examples, row_len=row_len, resp_len=resp_len)
  state = create_train_state(params, tcfg, tx, d_model=model_cfg.d_model)  # donates `params`
  step_fn = make_train_step(fns, tcfg, tx, state, mesh=topology.trainer, rules=TRAIN_RULES)
  logprobs_fn = (make_logprobs_fn(fns, tcfg, state, mesh=topology.trainer, rules=TRAIN_RULES)
                 if cfg.train.logprobs == "separate" else None)  # fused: inside the train step's program
  # Same layout and dtype on both sides (colocated, fp32) makes the plan zero-copy: the engine then
  # reads the trainer's arrays, which the next train step donates; every sync replaces them.
  sync = WeightSync(cfg, state, shardings["rollout"], jax.numpy.dtype(model_cfg.dtype), topology.rollout)
  rollout_params = sync.initial(state)
  reward_model = None
  if cfg.reward.model_dir is not None:
    role = "reward" if "reward" in dict(topology.roles) else "rollout"
    reward_model = RewardModel.load(cfg.reward.model_dir, topology.mesh_for(role), topology.rules_for(role),
                                    dtype=cfg.model.dtype, batch_size=cfg.reward.model_batch_size)
  detok = lambda ids: tokenizer.decode(ids)  # noqa: E731
  engine = RolloutEngine(graphdef, model_cfg, rollout_params, ecfg, seed=cfg.run.seed, mesh=topology.rollout,
                         detokenize=detok)
  stop_ids, stop_strings = split_stops(tokenizer, cfg.rollout.stop)
  env = None
  if cfg.env.fn:
    breaker = CircuitBreaker(cfg.reward.max_error_frac, cfg.reward.max_error_steps, what="environment",
                             unit="episodes", calls="scored batches")
    env = EnvTurns(EnvPool(cfg.env.fn, n_workers=cfg.env.n_workers, timeout_s=cfg.env.timeout_s,
                               start_timeout_s=cfg.env.start_timeout_s), tokenizer,
                   chat=cfg.data.chat_template, role=cfg.env.role, error_score=cfg.env.error_score,
                   max_prompt_len=cfg.data.max_prompt_len, breaker=breaker)
  dp_width = int(np.prod([topology.trainer.shape[a] for a in batch_axes(topology.trainer, TRAIN_RULES)]))
  logging.info("experiment: mode=%s model=%s (%d layers, d=%d, %s attention) trainer=%s rollout=%s", topology.mode,
               model_dir, model_cfg.n_layers, model_cfg.d_model, model_cfg.attention, dict(topology.trainer.shape),
               dict(topology.rollout.shape))
  return Experiment(cfg=cfg, model_dir=model_dir, model_cfg=model_cfg, graphdef=graphdef, tokenizer=tokenizer,
                    topology=topology, fns=fns, state=state, step_fn=step_fn, logprobs_fn=logprobs_fn, sync=sync,
                    engine=engine, rewards=rewards, reward_model=reward_model, prompts=prompts, heldout=heldout,
                    stop_ids=stop_ids, stop_strings=stop_strings, resp_len=resp_len, row_len=row_len,
                    dp_width=dp_width, env=env)
