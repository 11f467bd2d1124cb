"""A launch's checks of its config before anything is built or written: what the build would refuse later.

`check_data` builds the prompts as `experiment.build` will (and refuses a batch far larger than them),
`check_model` reads the LoRA targets and a reward model's directory, `check_positions` the model's position limit
and `check_shapes` the meshes from the model's abstract shapes. So bad data or a config the build would refuse
fails a launch before its workdir is touched (runtime/workdir.py holds the checks of the workdir itself).
"""

from __future__ import annotations

import math
import tempfile

from jaxrl_topo.runtime.config import RunConfig

# A batch may hold each training prompt a few times (the pipeline repeats the reshuffled data to fill it: a toy
# file of 4 rows under a shipped config's batch of 16 runs), not ~100 times (batch 100000 on 1000 prompts ran
# minutes, then ran out of device memory).
MAX_BATCH_PER_PROMPT = 8


def check_data(cfg: RunConfig) -> None:
  """Builds the training and held-out prompts as `experiment.build` will (tokenized, length-filtered, the
  task's distinct prompts drawn), with nothing written: their errors come before the workdir is touched. A
  `data.batch_size` over MAX_BATCH_PER_PROMPT x the training prompts kept is refused."""
  from jaxrl_topo.data import pipeline
  from jaxrl_topo.models.fresh import save_char_tokenizer
  from jaxrl_topo.models.tokenizer import Tokenizer

  with tempfile.TemporaryDirectory() as tmp:
    if cfg.model.hf_dir is None:  # a preset: the char tokenizer its init_model/ will hold
      save_char_tokenizer(tmp)
    tokenizer = Tokenizer.from_dir(cfg.model.hf_dir or tmp)
    train = pipeline.load_prompts(cfg.data, tokenizer, "train")
    heldout = pipeline.load_prompts(cfg.data, tokenizer, "heldout")
  if "task" in [name for name, _ in cfg.reward.fns]:
    # An environment's episodes score themselves: reward.fn then scores only the warm-up's accuracy stop, on
    # training prompts (experiment.sft_accuracy).
    if not cfg.env.fn or (cfg.run.sft_steps > 0 and cfg.run.sft_target_accuracy > 0):
      _check_task_fields(train.examples, "data.source", cfg.data.source)
    if not cfg.env.fn:
      _check_task_fields(heldout.examples, "data.eval_source", cfg.data.eval_source or cfg.data.source)
  n = train.stats.n_kept
  batch, most = cfg.data.batch_size, MAX_BATCH_PER_PROMPT * n
  if batch > most:
    raise ValueError(f"data.batch_size={batch} is over {MAX_BATCH_PER_PROMPT} x the {n} training prompts ({most}): "
                     f"each step would hold every prompt about {round(batch / n)} times; lower data.batch_size to "
                     f"{most} or less ({n} or less holds a prompt at most once a step, twice in a step that crosses "
                     f"an epoch), or add prompts")


def _check_task_fields(examples, key: str, source) -> None:
  """The `task` reward reads each row's "task" (its verifier: data/tasks.VERIFIERS): before, a prompt file without
  one trained through the warm-up and a few steps, then stopped on a reward error."""
  from jaxrl_topo.data.tasks import VERIFIERS

  for ex in examples:
    task = ex.get("task")
    if not (isinstance(task, str) and task in VERIFIERS):
      row = ex.get("source_row", "?")
      said = "has no 'task' field" if task is None else f"names task {task!r}, which has no verifier"
      raise ValueError(f"reward.fn='task' scores each row by its 'task' field (one of {sorted(VERIFIERS)}; "
                       f"'exact' matches 'answer'): {key}={source!r} row {row} {said}; add it, or set reward.fn "
                       "to a reward of your own")


def check_model(cfg: RunConfig) -> None:
  """Raises when `lora.targets` (with lora.rank > 0) names a projection the model lacks, listing the ones it has,
  or when `reward.model_dir` holds no model (config.json, weights) or one whose vocabulary is smaller than the
  policy's: from config files and abstract shapes alone (the build would fail after the warm-up)."""
  from jaxrl_topo.review.step_bytes import model_config

  if cfg.reward.model_dir is not None:
    from jaxrl_topo.models import hf_io

    rm = hf_io.read_config(cfg.reward.model_dir, tie_embeddings=True)
    hf_io.tensor_files(cfg.reward.model_dir)
    policy_vocab = model_config(cfg)[0].vocab_size
    if rm.vocab_size < policy_vocab:
      raise ValueError(f"reward model {cfg.reward.model_dir} has vocab_size {rm.vocab_size} < the policy's "
                       f"{policy_vocab}: it must read the policy's token ids")
  if not cfg.lora.enabled:
    return
  from jaxrl_topo.review.bytes import param_leaves

  model_cfg, name = model_config(cfg)
  valid = sorted({leaf.path[-2] for leaf in param_leaves(model_cfg) if leaf.path[-1] == "kernel"
                  and len(leaf.path) > 1})
  unknown = [t for t in cfg.lora.targets if t not in valid]
  if unknown:
    raise ValueError(f"lora.targets {tuple(cfg.lora.targets)}: {', '.join(map(repr, unknown))} "
                     f"{'names' if len(unknown) == 1 else 'name'} no projection of the model {name}; its projections "
                     f"are {', '.join(valid)}")


def check_positions(cfg: RunConfig) -> None:
  """Refuses prompt + response past the model's position limit, naming the run's keys (the engine would refuse
  its max_len, a value the config does not name). From the model's config alone."""
  from jaxrl_topo.review.step_bytes import model_config

  limit, need = model_config(cfg)[0].max_position, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
  if limit and need > limit:
    raise ValueError(f"data.max_prompt_len + rollout.max_new_tokens = {cfg.data.max_prompt_len} + "
                     f"{cfg.rollout.max_new_tokens} = {need} > the model's position limit {limit} "
                     "(max_position_embeddings): lower one of them")


def check_shapes(cfg: RunConfig, topology) -> None:
  """Raises ValueError when the model's weights do not divide over the carved `topology`'s meshes (the build's
  `carve.check_model_fits`: heads, kv heads, mlp, vocab over `tensor`, embed over `fsdp`), or a step's
  data.batch_size x rl.group_size sequences do not split into run.n_micro microbatches that divide over the
  trainer's data-parallel axes (the first step's `check_batch`), or model.attention='cudnn' has no GPU. From
  abstract shapes: nothing is compiled, allocated or written."""
  from jaxrl_topo.models.attention import training_attention
  from jaxrl_topo.models.model import abstract_model
  from jaxrl_topo.review.step_bytes import model_config
  from jaxrl_topo.topology.carve import check_model_fits
  from jaxrl_topo.topology.rules import TRAIN_RULES
  from jaxrl_topo.train.step import batch_axes

  model_cfg = model_config(cfg)[0]
  _, abstract = abstract_model(model_cfg)
  check_model_fits(topology, abstract)
  training_attention(cfg.model.attention, platform=topology.trainer.devices.flat[0].platform, dtype=cfg.model.dtype,
                     packed=cfg.train.max_tokens_per_row > 0, head_dim=model_cfg.head_dim)  # cuDNN needs a GPU
  batch, group, n_micro = cfg.data.batch_size, cfg.rl.group_size, cfg.run.n_micro
  seqs, axes = batch * group, batch_axes(topology.trainer, TRAIN_RULES)
  ways = math.prod(topology.trainer.shape[a] for a in axes)
  if n_micro % cfg.rl.minibatches:
    raise ValueError(f"rl.minibatches={cfg.rl.minibatches} does not divide run.n_micro={n_micro}: each optimizer "
                     "update takes whole microbatches")
  if seqs % n_micro:
    raise ValueError(f"data.batch_size x rl.group_size = {batch} x {group} = {seqs} sequences per step do not split "
                     f"into run.n_micro={n_micro} equal microbatches")
  if (seqs // n_micro) % ways:
    raise ValueError(f"data.batch_size x rl.group_size / run.n_micro = {batch} x {group} / {n_micro} = "
                     f"{seqs // n_micro} sequences per microbatch do not divide over the trainer's data-parallel "
                     f"width {ways} (mesh axes {axes}): make them a multiple of {ways}")
