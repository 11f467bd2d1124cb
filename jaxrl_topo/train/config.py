"""Typed, frozen settings of the trainer: what the ml-collections config becomes at the boundary."""

from __future__ import annotations

import dataclasses
import math

from jaxrl_topo.rl.core import AGG_MODES
from jaxrl_topo.rl.losses import KL_KINDS
from jaxrl_topo.rl.offpolicy import IS_LEVELS
from jaxrl_topo.runtime.dataclass_io import check_ranges, check_types

SCHEDULES = ("constant", "cosine")
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
TOKEN_REWARD_ADVANTAGES = ("reinforce_pp", "gae")  # the advantages computed from per-token rewards
POLICY_LOSSES = ("ppo", "gspo", "cispo")
POLICY_LOSS_AGG = {"ppo": "token-mean", "gspo": "seq-mean-token-mean", "cispo": "token-mean"}  # agg=None
AGGREGATIONS = AGG_MODES  # rl/core.py
CRITICS = ("none", "shared", "separate")
DECAY_MASKS = ("all", "matrices")  # OptimConfig.weight_decay_mask


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  """AdamW with linear warm-up, then constant or cosine decay to `final_lr_frac * lr`; global-norm clip."""

  lr: float = 1e-6
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: int = 0  # the cosine schedule's length (from a run's config, 0 means run.steps)
  final_lr_frac: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  # what weight_decay applies to: all (every trained parameter) | matrices (parameters of 2+ dims: the projections,
  # embeddings, LoRA factors and value head; not the norms' scales or any bias)
  weight_decay_mask: str = "all"
  max_grad_norm: float = 1.0  # 0 = no clipping

  def __post_init__(self):
    check_types("OptimConfig", self)  # first: the checks below compare the fields
    for name in ("lr", "max_grad_norm", "eps", "weight_decay"):  # lr=inf: NaN weights after one step, exit 0
      if getattr(self, name) is not None and not math.isfinite(getattr(self, name)):
        raise ValueError(f"OptimConfig.{name}={getattr(self, name)} must be finite")
    if not self.lr > 0:
      raise ValueError(f"OptimConfig.lr={self.lr} must be > 0")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"OptimConfig.schedule={self.schedule!r}; expected one of {SCHEDULES}")
    if self.weight_decay_mask not in DECAY_MASKS:
      raise ValueError(f"OptimConfig.weight_decay_mask={self.weight_decay_mask!r}; expected one of {DECAY_MASKS}")
    if self.schedule == "cosine" and self.total_steps <= self.warmup_steps:
      raise ValueError(f"OptimConfig.total_steps={self.total_steps} must be > warmup_steps={self.warmup_steps} for "
                       "the cosine schedule (a run's config may leave it 0: the decay then ends at run.steps)")
    check_ranges("OptimConfig", self, warmup_steps=">=0", max_grad_norm=">=0", final_lr_frac="0..1", b1="0..1",
                 b2="0..1", eps=">0", weight_decay=">=0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """The RL objective, every choice by name (rl/ holds the formulas)."""

  group_size: int  # completions per prompt; sequences are group-major
  advantage: str = "grpo"
  policy_loss: str = "ppo"
  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm; None = the policy loss's own
  # (POLICY_LOSS_AGG): GSPO's objective weighs every sequence alike (seq-mean-token-mean), PPO's and CISPO's every
  # token (token-mean, as DAPO and MiniMax-M1 do)
  agg: str | None = None
  # The ratio's clip range [1 - clip_low, 1 + clip_high]; None = the policy loss's own (rl/losses.py): ppo 0.2 and
  # 0.2, gspo 3e-4 and 4e-4 (its sequence ratio lives near 1), cispo none below and 0.28. clip_high > clip_low
  # is DAPO's clip-higher
  clip_low: float | None = None
  clip_high: float | None = None
  dual_clip: float | None = None  # c > 1 bounds the loss of negative-advantage tokens by c*|A|
  kl_coef: float = 0.0
  kl_kind: str = "k3"  # k1 | k2 | k3
  kl_in_reward: bool = False  # True: -kl_coef*KL is added to the token rewards (reinforce_pp, gae); False: a loss term
  entropy_coef: float = 0.0
  is_cap: float | None = 2.0  # truncated importance weight min(pi_old/mu, cap) vs the sampler; None = off
  is_mask_low: float | None = None  # drop tokens whose pi_old/mu lies outside [low, high]
  is_mask_high: float | None = None
  # what one IS weight covers (rl/offpolicy.py): token | sequence (the product over the sequence) | geometric (its
  # geometric mean, GSPO's own ratio form); sequence-level weights cap and mask whole sequences
  is_level: str = "token"
  critic: str = "none"  # none | shared (value head on the policy backbone) | separate (own backbone)
  value_coef: float = 0.5
  value_clip: float = 0.2
  gamma: float = 1.0
  lam: float = 0.95
  # GRPO's group std: 1 = the unbiased estimate (torch.std's default, as TRL, verl and OpenRLHF compute it), 0 = the
  # population std. Only advantage="grpo" divides by a std
  grpo_std_ddof: int = 1
  gae_whiten: bool = True  # GAE's advantages whitened over the global batch's tokens (False: raw GAE)
  temperature: float = 1.0  # the rollout temperature: logits are divided by it (sampling convention)
  logprob_chunk: int = 1024  # tokens per chunk of the output projection
  # PPO's updates per batch: `epochs` passes over it, each in `minibatches` optimizer updates (whole
  # microbatches: run.n_micro must divide by it). 1 and 1: one update, where every ratio is 1 and the clip
  # never binds; more: the ratio is against the step's starting weights, so clip_low/clip_high act.
  epochs: int = 1
  minibatches: int = 1

  def __post_init__(self):
    check_types("LossConfig", self)  # first: the checks below compare the fields
    if self.advantage not in ADVANTAGES:
      raise ValueError(f"LossConfig.advantage={self.advantage!r}; expected one of {ADVANTAGES}")
    if self.policy_loss not in POLICY_LOSSES:
      raise ValueError(f"LossConfig.policy_loss={self.policy_loss!r}; expected one of {POLICY_LOSSES}")
    if self.agg is not None and self.agg not in AGGREGATIONS:
      raise ValueError(f"LossConfig.agg={self.agg!r}; expected one of {AGGREGATIONS}")
    if self.critic not in CRITICS:
      raise ValueError(f"LossConfig.critic={self.critic!r}; expected one of {CRITICS}")
    if (self.advantage == "gae") != (self.critic != "none"):
      raise ValueError(f"advantage={self.advantage!r} with critic={self.critic!r}: GAE needs a critic and only "
                       "GAE uses one")
    if self.advantage in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline") and self.group_size < 2:
      raise ValueError(f"advantage={self.advantage!r} compares completions of a prompt: group_size must be >= 2")
    if self.kl_in_reward and self.advantage not in TOKEN_REWARD_ADVANTAGES:
      raise ValueError(f"kl_in_reward=True subtracts the KL from per-token rewards, which advantage="
                       f"{self.advantage!r} never reads (it compares outcome rewards within a group), so the KL would "
                       f"apply nowhere: keep it a loss term (kl_in_reward=False), or use advantage="
                       f"{' or '.join(map(repr, TOKEN_REWARD_ADVANTAGES))}")
    if self.kl_kind not in KL_KINDS:
      raise ValueError(f"LossConfig.kl_kind={self.kl_kind!r}; expected k1, k2 or k3")
    if any(c is not None and c < 0 for c in (self.clip_low, self.clip_high)) or (
        self.dual_clip is not None and self.dual_clip <= 1):
      raise ValueError("clip_low/clip_high must be >= 0 and dual_clip > 1")
    if not 0 < self.temperature < math.inf or self.logprob_chunk <= 0:
      raise ValueError("temperature must be finite and > 0, and logprob_chunk positive")
    if self.dual_clip is not None and self.policy_loss != "ppo":
      raise ValueError(f"dual_clip bounds PPO's clipped loss; policy_loss={self.policy_loss!r} has none, so it would "
                       "be ignored: leave dual_clip None")
    if self.kl_in_reward and not self.kl_coef > 0:
      raise ValueError("kl_in_reward=True subtracts kl_coef x KL from the token rewards: it needs kl_coef > 0")
    if self.is_cap is None and (self.is_mask_low is not None or self.is_mask_high is not None):
      raise ValueError("is_mask_low/is_mask_high mask tokens by the importance ratio that is_cap turns on; with "
                       "is_cap=None they would be ignored: set is_cap too")
    if self.is_level not in IS_LEVELS:
      raise ValueError(f"LossConfig.is_level={self.is_level!r}; expected one of {IS_LEVELS}")
    if self.is_cap is None and self.is_level != "token":
      raise ValueError(f"is_level={self.is_level!r} says what the importance weight of is_cap covers; with "
                       "is_cap=None there is none: set is_cap too")
    if self.grpo_std_ddof not in (0, 1):
      raise ValueError(f"LossConfig.grpo_std_ddof={self.grpo_std_ddof}; expected 0 (population std) or 1 (unbiased)")
    if self.grpo_std_ddof != 1 and self.advantage != "grpo":
      raise ValueError(f"grpo_std_ddof sets GRPO's group std; advantage={self.advantage!r} divides by none, so it "
                       "would be ignored: leave it at 1")
    if not self.gae_whiten and self.advantage != "gae":
      raise ValueError(f"gae_whiten=False leaves GAE's advantages raw; advantage={self.advantage!r} is not GAE, so it "
                       "would be ignored: leave it True")
    if None not in (self.is_mask_low, self.is_mask_high) and not self.is_mask_low < self.is_mask_high:
      raise ValueError(f"is_mask_low={self.is_mask_low} must be < is_mask_high={self.is_mask_high}")
    check_ranges("LossConfig", self, group_size=">=1", epochs=">=1", minibatches=">=1", kl_coef=">=0",
                 entropy_coef=">=0", is_cap=">0", is_mask_low=">=0", is_mask_high=">0", value_coef=">=0",
                 value_clip=">=0", gamma="0..1", lam="0..1")

  @property
  def needs_ref(self) -> bool:
    return self.kl_coef > 0

  @property
  def updates(self) -> int:
    """Optimizer updates per train step."""
    return self.epochs * self.minibatches

  @property
  def aggregation(self) -> str:
    """`agg`, or the policy loss's own where it is None (POLICY_LOSS_AGG)."""
    return self.agg if self.agg is not None else POLICY_LOSS_AGG[self.policy_loss]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """Low-rank adapters W + (alpha/rank) A B on the named projections; rank 0 = full fine-tuning."""

  rank: int = 0
  alpha: float = 16.0
  targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

  def __post_init__(self):
    check_ranges("LoraConfig", self, rank=">=0", alpha=">0")
    if not isinstance(self.targets, tuple | list) or not all(isinstance(t, str) for t in self.targets):
      # a bare string matched by letters: targets="qkv_proj" adapted v_proj alone ("v_proj" in "qkv_proj")
      raise ValueError(f"LoraConfig.targets={self.targets!r} must be a tuple of projection names, e.g. "
                       "('q_proj', 'v_proj')")
    if self.rank > 0 and not self.targets:
      raise ValueError("LoraConfig.targets is empty: name the projections to adapt (q_proj, ...) or set rank 0")

  @property
  def enabled(self) -> bool:
    return self.rank > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  loss: LossConfig
  optim: OptimConfig = OptimConfig()
  lora: LoraConfig = LoraConfig()
  seed: int = 0

  def __post_init__(self):
    check_types("TrainConfig", self)  # seed="0" passed before
    for name, kind in (("loss", LossConfig), ("optim", OptimConfig), ("lora", LoraConfig)):
      if not isinstance(getattr(self, name), kind):  # loss={...} passed before, then failed deep in a trace
        raise ValueError(f"TrainConfig.{name} must be a {kind.__name__}, not {type(getattr(self, name)).__name__}")
