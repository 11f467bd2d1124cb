"""A run's config at the boundary: out-of-range values, typos, the shipped configs, and what reaches the engine.

Nothing here runs a step: every error is raised when the config converts, before anything compiles.
"""

from __future__ import annotations

import pytest
from run_fixtures import TOPO, load_config, tiny_cfg

from jaxrl_topo.runtime.config import from_config_dict


@pytest.mark.parametrize("key,value,says", [
    ("run.log_every", 0, "run.log_every=0 must be >= 1"),  # before: ZeroDivisionError after the first step
    ("run.sft_eval_every", 0, "run.sft_eval_every=0 must be >= 1"),  # before: ZeroDivisionError in the warm-up
    ("run.sft_batch", 0, "run.sft_batch=0 must be >= 1"),  # before: ZeroDivisionError inside JAX
    ("run.keep_checkpoints", 0, "run.keep_checkpoints=0 must be >= 1"),  # before: after config.json was written
    ("run.checkpoint_every", -1, "run.checkpoint_every=-1 must be >= 0"),  # before: a checkpoint every step
    ("run.sft_target_accuracy", 5.0, "run.sft_target_accuracy=5.0 must be in [0, 1]"),
    ("run.sft_lr", -1.0, "run.sft_lr=-1.0 must be > 0"),
    ("run.sft_max_grad_norm", -1.0, "run.sft_max_grad_norm=-1.0 must be >= 0"),
    ("run.profile_step", -2, "run.profile_step=-2 must be >= 0"),
    ("rl.kl_coef", -1.0, "LossConfig.kl_coef=-1.0 must be >= 0"),
    ("rl.gamma", 5.0, "LossConfig.gamma=5.0 must be in [0, 1]"),
    ("rl.is_cap", 0.0, "LossConfig.is_cap=0.0 must be > 0"),
    ("optim.weight_decay", -1.0, "OptimConfig.weight_decay=-1.0 must be >= 0"),
    ("optim.final_lr_frac", 5.0, "OptimConfig.final_lr_frac=5.0 must be in [0, 1]"),
    # before: "... got self.total_steps=0 self.warmup_steps=..."
    ("optim.total_steps", -1, "OptimConfig.total_steps=-1 must be > warmup_steps="),
    ("lora.rank", -1, "LoraConfig.rank=-1 must be >= 0"),
    ("reward.error_score", float("nan"), "reward.error_score=nan must be a finite number"),
    ("rollout.stop", (1, 2), "rollout.stop[0] must be str, got int 1"),  # before: a TypeError's traceback
    ("rollout.stop", ("",), "holds an empty string"),  # before: refused at the first rollout, after the warm-up
    ("rollout.n_pages", -8, "rollout.n_pages=-8 must be >= 0"),
    ("run.seed", 2**32 + 7, "run.seed=4294967303 must be in [0, 2**32)"),  # before: sampled as seed 7 does
    # before: accepted, then dropped (the run rebuilds its model from config.json)
    ("model.overrides", {"attention": "reference"}, "model.overrides.attention: not part of the model's config.json"),
    # before: accepted, then "unexpected keyword argument" once the run wrote its init_model
    ("model.overrides", {"n_layer": 3}, "model.overrides: 'n_layer' is not a model config field; did you mean"),
    ("run.sft_lr", float("inf"), "run.sft_lr=inf must be finite"),
    ("optim.lr", float("inf"), "OptimConfig.lr=inf must be finite"),  # before: NaN weights after step 0, exit 0
    ("optim.max_grad_norm", float("inf"), "OptimConfig.max_grad_norm=inf must be finite"),
    ("run.eval_samples", 0, "run.eval_samples=0 must be >= 1"),
    ("run.sft_n_micro", 3, "run.sft_batch=64 must be a multiple of run.sft_n_micro=3"),
    ("run.sft_weight_decay", -0.1, "run.sft_weight_decay=-0.1 must be >= 0"),
    ("run.eval_samples", 4, "set rollout.eval_greedy=False to sample them"),  # the config evaluates greedily
    ("run.eval_samples", 512, "run.eval_samples=512 > rollout.n_slots"),
])
def test_values_out_of_range_are_refused_naming_the_key(key, value, says):
  """Values a run cannot mean, found by a new user's trial: each was accepted, or failed late with a traceback."""
  raw = load_config("grpo_task", "tiny").to_dict()
  section, name = key.split(".")
  raw[section][name] = value
  with pytest.raises(ValueError) as err:
    from_config_dict(raw)
  assert says in str(err.value)


def test_config_typos_are_rejected_with_a_suggestion():
  c = load_config("grpo_task", "tiny")
  with pytest.raises(AttributeError, match="group_size"):
    c.rl.gruop_size = 8  # a locked ConfigDict: ml-collections suggests the valid key
  raw = c.to_dict()
  raw["rl"]["gruop_size"] = 8
  with pytest.raises(ValueError, match="unknown key rl.gruop_size; did you mean 'group_size'"):
    from_config_dict(raw)
  raw = c.to_dict()
  raw["rollout"]["max_new_tokens"] = "many"
  with pytest.raises(ValueError, match="rollout.max_new_tokens must be int"):  # a user's error: one line
    from_config_dict(raw)
  raw = c.to_dict()
  raw["topology"]["mode"] = "colocted"
  with pytest.raises(ValueError, match="colocated"):
    from_config_dict(raw)
  raw = c.to_dict()
  raw["rollout"]["impl"] = "paged"
  with pytest.raises(ValueError, match=r"rollout.impl='paged'; expected one of \('auto', 'reference', 'fast'"):
    from_config_dict(raw)


@pytest.mark.parametrize("name, arg", [("grpo_task", "tiny"), ("grpo_task", "small"), ("ppo_critic", "tiny"),
                                       ("dapo", "tiny"), ("grpo_gsm8k", "/models/qwen")])
def test_every_shipped_config_converts(name, arg):
  cfg = from_config_dict(load_config(name, arg))
  assert cfg.rl.group_size >= 1 and cfg.run.steps > 0


def test_slots_and_pages_must_split_over_the_rollout_data_axis():
  """Raised at config time, before any device work (the engine would raise only once built)."""
  for key, value in (("n_slots", 15), ("n_pages", 63)):
    c = load_config("grpo_task", "tiny", **{f"rollout.{key}": value})
    c.topology = TOPO["disaggregated"]
    with pytest.raises(ValueError, match=f"rollout.{key}={value} must be a multiple of the rollout mesh's data"):
      from_config_dict(c)


def test_only_a_plain_colocated_loop_lets_the_engine_grow_decode_chunks():
  """The engine grows chunks (EngineConfig.max_chunk, rollout.max_chunk) only for a hook that says it needs no
  boundaries (tests/test_engine.py): a colocated loop's, unless a caller hooks in between chunks."""
  from jaxrl_topo.runtime.loop import LoopHooks, needs_chunk_boundaries

  assert not needs_chunk_boundaries("colocated", LoopHooks())
  assert needs_chunk_boundaries("colocated", LoopHooks(on_chunk=lambda engine: None))  # e.g. a mux group's
  assert needs_chunk_boundaries("disaggregated", LoopHooks()) and needs_chunk_boundaries("async", LoopHooks())
  with pytest.raises(ValueError, match="rollout.max_chunk=-1 must be >= 0"):
    tiny_cfg("colocated", 1, **{"rollout.max_chunk": -1})
  with pytest.raises(ValueError, match="rollout.min_window_tokens=-1 must be >= 0"):
    tiny_cfg("colocated", 1, **{"rollout.min_window_tokens": -1})
  assert tiny_cfg("colocated", 1, **{"rollout.max_chunk": 64}).rollout.max_chunk == 64


def test_the_rollout_config_reaches_the_engine():
  """rollout.* keys the engine reads arrive in its EngineConfig (experiment.engine_config), rows in whole pages."""
  from jaxrl_topo.runtime.experiment import engine_config

  rc = tiny_cfg("colocated", 1, **{"rollout.min_window_tokens": 16, "rollout.max_chunk": 64,
                                   "rollout.impl": "bucketed", "rollout.page_size": 4, "data.max_prompt_len": 10,
                                   "rollout.max_new_tokens": 5, "rollout.min_pack_rows": 4, "rollout.tail_chunk": 6,
                                   "rollout.overlap": False, "rollout.min_bucket": 8})
  e = engine_config(rc, (2,), 0)
  assert (e.min_window_tokens, e.max_chunk, e.impl, e.page_size, e.min_pack_rows) == (16, 64, "bucketed", 4, 4)
  assert (e.tail_chunk, e.overlap, e.min_bucket) == (6, False, 8)
  assert e.max_len == 16 and e.n_pages == 16 * 4 and e.window_min_pages == 4 and e.eos_ids == (2,)
  e = engine_config(tiny_cfg("colocated", 1, **{"rollout.impl": "pallas", "rollout.pallas_splits": 3}), (2,), 0)
  assert (e.impl, e.pallas_splits) == ("pallas", 3)
  with pytest.raises(ValueError, match="pallas_splits=3 sets the Pallas kernel; rollout.impl='window' never runs it"):
    tiny_cfg("colocated", 1, **{"rollout.impl": "window", "rollout.pallas_splits": 3})


def test_the_cosine_decay_follows_run_steps_unless_given_its_own_length():
  """Before: configs/grpo_task.py linked optim.total_steps to run.steps (a FieldReference), so
  --config.optim.total_steps=10 also cut the run to 10 steps."""
  cfg = from_config_dict(load_config("grpo_task", "tiny"))
  assert cfg.optim.schedule == "cosine" and cfg.optim.total_steps == cfg.run.steps == 300
  cfg = from_config_dict(load_config("grpo_task", "tiny", **{"run.steps": 40}))
  assert cfg.optim.total_steps == cfg.run.steps == 40
  cfg = from_config_dict(load_config("grpo_task", "tiny", **{"optim.total_steps": 10}))
  assert cfg.optim.total_steps == 10 and cfg.run.steps == 300
  cfg = from_config_dict(load_config("grpo_task", "tiny", **{"run.steps": 0, "optim.warmup_steps": 5}))
  assert cfg.optim.total_steps == 6  # a run within its warm-up never reaches the decay
  cfg = from_config_dict(load_config("grpo_task", "small"))  # the constant schedule keeps its 0
  assert cfg.optim.schedule == "constant" and cfg.optim.total_steps == 0
