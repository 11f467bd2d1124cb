"""The run config's sections as typed, frozen dataclasses (runtime/config.py assembles them into RunConfig):
each validates its own fields in `__post_init__`; rules that span sections live in RunConfig."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxrl_topo.models.config import ATTENTION_IMPLS
from jaxrl_topo.models.presets import check_fields
from jaxrl_topo.rollout import engine_config
from jaxrl_topo.rollout.engine_config import UPDATE_POLICIES
from jaxrl_topo.rollout.paged import check_read
from jaxrl_topo.rollout.sampling import SamplingConfig
from jaxrl_topo.runtime.dataclass_io import check_ranges
from jaxrl_topo.topology.transfer import ROUTES


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
  """A preset shape with random init (`preset`, plus `overrides` of ModelConfig fields) or `hf_dir`."""

  preset: str = "tiny"
  hf_dir: str | None = None  # local HF directory: weights, config.json, tokenizer.json
  dtype: str = "float32"  # compute dtype; params stay fp32 for training
  overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # ModelConfig fields over the preset
  init_seed: int = 0
  # training attention (models/attention.py): auto (cuDNN on a GPU for bf16 padded rows, else flash) | flash |
  # reference | xla | cudnn
  attention: str = "auto"
  attn_block: int = 128  # flash: tokens per tile
  # jax.default_matmul_precision for every program of the run (train, logprobs, rollout): "default" keeps
  # the backend's (TF32 for fp32 matmuls on recent NVIDIA GPUs, full fp32 on CPU); "highest" = full fp32
  # everywhere (the tests); "high" = bf16_3x. The sampler-vs-trainer log-prob gap is logged every step.
  matmul_precision: str = "default"

  def __post_init__(self):
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"model.dtype={self.dtype!r}; expected 'float32' or 'bfloat16'")
    if self.attention not in ("auto", *ATTENTION_IMPLS):
      raise ValueError(f"model.attention={self.attention!r}; expected one of {('auto', *ATTENTION_IMPLS)}")
    if self.matmul_precision not in PRECISIONS:
      raise ValueError(f"model.matmul_precision={self.matmul_precision!r}; expected one of {PRECISIONS}")
    if self.attn_block < 8:
      raise ValueError(f"model.attn_block={self.attn_block} must be >= 8")
    if self.hf_dir is not None and self.overrides:
      raise ValueError("model.overrides apply to presets; an HF directory brings its own config.json")
    try:
      check_fields(self.overrides)
    except ValueError as e:
      raise ValueError(f"model.overrides: {e}") from None
    for name in sorted(set(self.overrides) & set(NOT_ARCHITECTURE)):  # the run rebuilds the model from config.json
      raise ValueError(f"model.overrides.{name}: not part of the model's config.json, so the run would not see it; "
                       f"{NOT_ARCHITECTURE[name]}")


# ModelConfig fields the run sets from its own keys, not from the model directory: an override would be dropped.
NOT_ARCHITECTURE = {"attention": "set model.attention", "attn_block": "set model.attn_block",
                     "dtype": "set model.dtype (the compute dtype)",
                     "param_dtype": "training keeps fp32 parameters (model.dtype sets the compute dtype)"}


PRECISIONS = ("default", "high", "highest")
LOGPROBS = ("fused", "separate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSpec:
  """How the train step is laid out in memory (the objective is `rl`, the optimizer `optim`)."""

  # Token budget of a packed row: completions are packed first-fit-decreasing into rows of this many
  # tokens (segment ids, positions restarting per completion); 0 = one completion per row, padded to
  # data.max_prompt_len + rollout.max_new_tokens. The row count per microbatch is the smallest multiple of
  # the data-parallel width that holds the batch, so each distinct count compiles once.
  max_tokens_per_row: int = 0
  remat: str = "none"  # none | block (recompute each block) | a jax.checkpoint_policies name (dots_saveable...)
  # fused: reference log-probs / old values inside the train step's program (one program reads the weights);
  # separate: their own program first (a "logprobs" span of its own in the timeline).
  logprobs: str = "fused"

  def __post_init__(self):
    from jaxrl_topo.models.transformer import remat_policy

    if self.max_tokens_per_row < 0:
      raise ValueError(f"train.max_tokens_per_row={self.max_tokens_per_row} must be >= 0 (0: no packing)")
    if self.logprobs not in LOGPROBS:
      raise ValueError(f"train.logprobs={self.logprobs!r}; expected one of {LOGPROBS}")
    try:
      remat_policy(self.remat)
    except ValueError as e:
      raise ValueError(f"train.{e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSpec:
  """How completions are sampled (the group size lives in rl.group_size)."""

  max_new_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  n_slots: int = 64  # engine decode slots
  page_size: int = 16
  n_pages: int = 0  # 0: enough for every slot at full length (no preemption)
  decode_chunk: int = 8
  # with nobody watching chunk boundaries (colocated batches, launchers/generate.py) a chunk doubles up to
  # this many decode steps while its longest row needs them (fewer host round trips); 0: never past tail_chunk's
  max_chunk: int = 256
  # with the loop watching chunk boundaries (disaggregated, async, episodes), steps per chunk: how often weights may
  # land and groups free their slots, against host round trips; 0: 4 x decode_chunk
  tail_chunk: int = 0
  overlap: bool = True  # dispatch decode chunk k+1 before reading chunk k's tokens (host and device work overlap)
  min_bucket: int = 16  # prompts are prefilled padded to a power of two >= this (fewer programs, more padding)
  # how weights land between decode chunks: async, and disaggregated under rollout.continuous (the stream may hold
  # later batches' live sequences when a step's weights land)
  update_policy: str = "keep_kv"
  stop: tuple[str, ...] = ()  # a completion also ends at any of these strings (e.g. "\n")
  eval_greedy: bool = True  # held-out accuracy with greedy decoding
  kv_dtype: str | None = None  # KV pool dtype ("bfloat16", "float32", ...); None = the model's compute dtype
  # the paged decode read (rollout/paged.py): auto = window on CPU (gathers a decode chunk's pages once), the
  # Pallas kernel on GPU where it works, else bucketed; fast | reference | pallas read each row on its own (its
  # numbers never depend on the rows beside it)
  impl: str = "auto"
  min_window_tokens: int = 64  # impl window: no narrower window or read (fewer programs to compile); 0 = none
  min_pack_rows: int = 2  # a chunk decodes its live rows packed into >= this many per shard (a program per size)
  # impl pallas (GPU): programs each row's page walk is divided over, flash-decoding style; 0 = the kernel's
  # default (1). Measured slower at batch 256 on an H200 (benchmarks/RESULTS.md); for a few long rows
  pallas_splits: int = 0
  # disaggregated / async: one generation stream for the whole run; batch k's prompts take slots as soon as
  # k <= version + eta, and groups are scored as they finish (runtime/rollout_side.py). False: batch by
  # batch, each drained before the next starts. (Colocated and DAPO dynamic sampling are always batch by batch.)
  continuous: bool = True

  def __post_init__(self):
    engine_config.check_fields({name: getattr(self, name) for name in engine_config.SHARED_FIELDS}, "rollout.")
    check_read(self.impl, "rollout.impl")
    if self.update_policy not in UPDATE_POLICIES:
      raise ValueError(f"rollout.update_policy={self.update_policy!r}; expected one of {UPDATE_POLICIES}")
    if self.pallas_splits and self.impl not in ("auto", "pallas"):
      raise ValueError(f"rollout.pallas_splits={self.pallas_splits} sets the Pallas kernel; rollout.impl="
                       f"{self.impl!r} never runs it (use 'pallas', or 'auto' on a GPU)")
    if self.max_new_tokens <= 0:
      raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens} must be positive")
    if self.n_pages < 0:
      raise ValueError(f"rollout.n_pages={self.n_pages} must be >= 0 (0: every slot at full length)")
    if "" in self.stop:  # the empty string is in every text: each completion would end at its first token
      raise ValueError(f"rollout.stop={self.stop!r} holds an empty string; stop strings must be non-empty")
    self.sampling  # noqa: B018  (validates temperature / top-k / top-p / min-p now)

  @property
  def sampling(self) -> SamplingConfig:
    return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)


MODEL_REWARD = "model"  # the reward model's name among the reward functions


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSpec:
  """Reward functions (import paths or built-in names, envs/rewards.py) and the shaping around them."""

  fn: str = "task"  # the main reward: "task", "math_answer", "format", "pkg.module:fn", or "model"
  extra: dict[str, float] = dataclasses.field(default_factory=dict)  # more functions: name -> weight
  # A learned reward model (rl/reward_model.py): an HF *ForSequenceClassification directory (num_labels=1),
  # on the topology's "reward" role (its own `topology.reward_devices`), else on the rollout devices.
  # Its score of prompt + completion is added with `model_weight`; with fn="model" it is the main reward.
  model_dir: str | None = None
  model_weight: float = 1.0
  model_batch_size: int = 32
  n_workers: int = 2  # reward worker processes; 0 = in the controller (no timeout)
  timeout_s: float = 10.0  # per call; a hung function is killed and its items scored `error_score`
  error_score: float = 0.0
  chunk_size: int = 0  # items per worker call (finer = better balanced, more calls); 0 = a batch split evenly
  start_timeout_s: float = 60.0  # a worker must have imported the functions' modules by then (slow imports: raise it)
  # Circuit breaker (envs/reward_pool.py): a function failing on more than this fraction of the items of
  # `max_error_steps` consecutive scoring calls stops the run with an error (checkpoints kept); 0 steps = off.
  # A multi-turn run's environment (env.fn) is held to the same limits over each scored batch's episodes.
  max_error_frac: float = 0.5
  max_error_steps: int = 3
  dynamic_sampling: bool = False  # DAPO: drop groups whose main reward (accuracy) never varies, sample more prompts
  max_sampling_rounds: int = 4  # dynamic sampling gives up (trains on what it has) after this many
  overlong_buffer: int = 0  # DAPO soft overlong: the last `buffer` tokens before max_new_tokens cost
  overlong_penalty: float = 1.0  # ...up to this much, linearly
  overlong_filter: bool = False  # DAPO: completions cut at max_new_tokens get no loss

  def __post_init__(self):
    if self.n_workers < 0 or not self.timeout_s > 0 or self.max_sampling_rounds < 1 or self.overlong_buffer < 0:
      raise ValueError("reward: n_workers >= 0, timeout_s > 0, max_sampling_rounds >= 1, overlong_buffer >= 0")
    if self.fn == MODEL_REWARD and self.model_dir is None:
      raise ValueError('reward.fn="model" needs reward.model_dir (an HF *ForSequenceClassification directory)')
    if MODEL_REWARD in self.extra:
      raise ValueError(f'reward.extra holds "{MODEL_REWARD}": the reward model is set by reward.model_dir and '
                       f"weighted by reward.model_weight (here {self.model_weight}), not through extra")
    if self.model_batch_size < 1:
      raise ValueError(f"reward.model_batch_size={self.model_batch_size} must be >= 1")
    check_ranges("reward", self, chunk_size=">=0", start_timeout_s=">0")
    if not 0 <= self.max_error_frac <= 1 or self.max_error_steps < 0:
      raise ValueError("reward: 0 <= max_error_frac <= 1, max_error_steps >= 0")
    check_ranges("reward", self, error_score="finite", model_weight="finite", overlong_penalty="finite")

  @property
  def fns(self) -> tuple[tuple[str, float], ...]:
    """The reward functions the worker pool runs (the model is scored on devices instead)."""
    return tuple((name, w) for name, w in ((self.fn, 1.0), *self.extra.items()) if name != MODEL_REWARD)

  @property
  def pool_options(self) -> dict:
    """RewardPool's keyword arguments (envs/reward_pool.py)."""
    return dict(n_workers=self.n_workers, timeout_s=self.timeout_s, error_score=self.error_score,
                chunk_size=self.chunk_size or None, start_timeout_s=self.start_timeout_s,
                max_error_frac=self.max_error_frac, max_error_calls=self.max_error_steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
  """The loop around the steps."""

  steps: int = 20
  # launchers/train.py: start the workdir over (delete its checkpoints, init_model, metrics) instead of
  # refusing a workdir of another run; the same as --fresh. Saved as False in the run's config.json.
  fresh: bool = False
  seed: int = 0  # rollout sampling keys come from (seed, sequence id unique over the run, position)
  n_micro: int = 1  # microbatches per train step
  eval_every: int = 0  # held-out accuracy every N steps (0: only before and after)
  eval_size: int = 0  # held-out prompts per evaluation (0: all)
  # samples per held-out prompt (k): > 1 logs eval/pass@k too, each prompt's best score averaged (pass@k where the
  # main reward is 0 or 1), with eval/accuracy the mean over every sample; needs rollout.eval_greedy=False
  eval_samples: int = 1
  max_staleness: int = 1  # eta, in weight versions: disaggregated uses 1 (0 = no overlap); async >= 1
  # True: every landing decision is a function of step and chunk counters (async: a step's weights land
  # after `land_after_chunks` decode chunks, waiting for the step if it is still running): bit-reproducible
  # runs and tests. False: async lands a finished step's weights at the next decode-chunk boundary and waits
  # only when eta forces it. Multi-process runs always take the counter schedule (every process decides alike).
  deterministic: bool = False
  land_after_chunks: int = 4  # deterministic async: a finished train step's weights land after this many chunks
  # steps between checkpoints (0: only at the end); at most this many steps are redone. A warm-up (sft_steps) is
  # checkpointed as step 0 once the accuracy before RL is measured: a relaunch after that does not redo it
  checkpoint_every: int = 10
  keep_checkpoints: int = 2
  log_every: int = 1
  tensorboard: bool = True
  plot: bool = True  # reward curve PNG at the end
  profile_step: int = -1  # jax.profiler trace of this step into <workdir>/profile (-1: none)
  sft_steps: int = 0  # supervised warm-up on the training split's answers before RL (fresh runs only): at most
  sft_target_accuracy: float = 0.0  # > 0: stop the warm-up once greedy accuracy on training prompts reaches it
  sft_eval_every: int = 5
  sft_dev_size: int = 256
  sft_lr: float = 3e-3
  # the warm-up's gradients clipped to this global norm (0: none, the default so far). Unclipped, seed 1 of the demo
  # spiked three times and stalled for 990 steps (RL then went 0.254 -> 0.555); clipped at 1, it warmed up in 55
  # (0.340 -> 1.000), and seeds 0 and 2 ended at 1.000 and 0.996 (benchmarks/RESULTS.md)
  sft_max_grad_norm: float = 0.0
  sft_batch: int = 64
  sft_n_micro: int = 1  # microbatches a warm-up step's rows are split into (less activation memory, the same step)
  sft_weight_decay: float = 1e-4  # the warm-up's AdamW decoupled weight decay

  def __post_init__(self):
    check_ranges("run", self, steps=">=0", n_micro=">=1", max_staleness=">=0", land_after_chunks=">=1",
                 eval_every=">=0", eval_size=">=0", eval_samples=">=1", checkpoint_every=">=0", keep_checkpoints=">=1",
                 log_every=">=1",
                 sft_steps=">=0", sft_target_accuracy="0..1", sft_eval_every=">=1", sft_dev_size=">=1", sft_lr=">0",
                 sft_batch=">=1", sft_max_grad_norm=">=0", sft_n_micro=">=1", sft_weight_decay=">=0")
    if self.sft_batch % self.sft_n_micro:
      raise ValueError(f"run.sft_batch={self.sft_batch} must be a multiple of run.sft_n_micro={self.sft_n_micro}")
    if self.profile_step < -1:
      raise ValueError(f"run.profile_step={self.profile_step} must be >= 0 (a step to trace) or -1 (none)")
    if not 0 <= self.seed < 2**32:  # a sampling key keeps 32 bits: 2**32 + 7 would sample as 7 does
      raise ValueError(f"run.seed={self.seed} must be in [0, 2**32)")
    if not math.isfinite(self.sft_lr):
      raise ValueError(f"run.sft_lr={self.sft_lr} must be finite")


SYNC_MODES = ("full", "delta", "lora")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncSpec:
  """Weight sync after every train step (topology/transfer.py TransferPlan), trainer -> rollout layout."""

  # full: every bucket, cast to the rollout dtype; delta: only the buckets whose cast values changed bitwise
  # (logs sync/changed_frac); lora: only the LoRA adapters (fp32), merged into the rollout's own base copy.
  mode: str = "full"
  # Destination MiB per bucket. The old rollout weights are freed bucket by bucket just before each new
  # bucket lands, so a sync needs about one bucket of extra rollout memory (not a second copy).
  bucket_mib: float = 64.0
  # where a leaf whose layout differs between the meshes is resharded (topology/transfer.py): auto (whichever ships
  # fewer bytes between the device sets), source (on the trainer's devices, then the shards are copied: the extra
  # copy is on the trainer side), destination (copied in the trainer's layout, resharded on the rollout devices:
  # the extra copy is on the rollout side), device_put (JAX's own routing)
  route: str = "auto"

  def __post_init__(self):
    if self.mode not in SYNC_MODES:
      raise ValueError(f"sync.mode={self.mode!r}; expected one of {SYNC_MODES}")
    if self.route not in ROUTES:
      raise ValueError(f"sync.route={self.route!r}; expected one of {ROUTES}")
    if not self.bucket_mib > 0:
      raise ValueError(f"sync.bucket_mib={self.bucket_mib} must be > 0")

  @property
  def bucket_bytes(self) -> int:
    return max(1, int(self.bucket_mib * 2**20))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSpec:
  """Multi-turn episodes with an environment (envs/env.py, rollout/episodes.py); fn="" = single-turn.
  With an environment its episode return is the reward (reward.fn / reward.extra are not used)."""

  fn: str = ""  # "calc" (data/tool_calc.py) or "pkg.module:Env"
  max_turns: int = 4  # model turns per episode; rollout.max_new_tokens bounds all tokens after the prompt
  role: str = "user"  # the chat role the environment's observations are rendered as
  n_workers: int = 2  # environment worker processes; 0 = in the controller (no timeout)
  timeout_s: float = 10.0  # per call; a hung environment is killed and its episode scored `error_score`
  error_score: float = 0.0
  start_timeout_s: float = 60.0  # a worker must have imported the environment's module by then

  def __post_init__(self):
    if self.max_turns < 1 or self.n_workers < 0 or not self.timeout_s > 0:
      raise ValueError("env: max_turns >= 1, n_workers >= 0, timeout_s > 0")
    check_ranges("env", self, error_score="finite", start_timeout_s=">0")
