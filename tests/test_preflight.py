"""Tests for runtime/preflight.py: a config checked against its data, model and meshes before a launch builds or
writes anything. Before, bad data (a task with too few distinct prompts, every prompt over max_prompt_len), LoRA
targets that name no projection, or weights that do not divide over a mesh failed inside `build` or the first step,
after config.json and init_model/ were written."""

import json
import os
import re

import pytest
from test_rl_loop import load_config

from jaxrl_topo.runtime import preflight, workdir
from jaxrl_topo.runtime.config import from_config_dict


def _config(**overrides):
  return load_config("grpo_task", "tiny", **overrides)


@pytest.mark.parametrize("overrides, match", [
    ({"data.task.length": 3}, "only 216 distinct prompts"),
    ({"data.max_prompt_len": 4}, "No prompts left from reversal: 1000 of 1000 rows are over"),
])
def test_bad_data_is_refused_with_nothing_written(tmp_path, monkeypatch, overrides, match):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=match):
    preflight.check_data(from_config_dict(_config(**overrides)))
  assert not os.listdir(tmp_path)
  preflight.check_data(from_config_dict(_config()))  # the config as shipped builds its prompts


def test_a_task_config_takes_a_file_source(tmp_path):
  """configs/grpo_task.py with --config.data.source=FILE: the file's rows are the prompts (the task's knobs go
  unused). Before: 'task.name 'reversal' does not match source', and no way to unset data.task from the command
  line. A file source needs held-out prompts of its own, which check_data asks for before anything is written, and
  the config's `task` reward a "task" field in each row (before: missing, the run trained through the warm-up and
  a few steps, then stopped on the reward's error)."""
  rows = tmp_path / "rev.jsonl"
  rows.write_text("".join(json.dumps({"prompt": f"reverse {w}=", "answer": w[::-1]}) + "\n"
                          for w in ("abcd", "fade", "cafe", "bead")))
  cfg = from_config_dict(_config(**{"data.source": str(rows)}))
  assert cfg.data.task is None and workdir.identity(cfg)["data.task"] is None
  with pytest.raises(ValueError, match="No held-out prompts: set eval_source"):
    preflight.check_data(cfg)
  files = {"data.source": str(rows), "data.eval_source": str(rows)}
  with pytest.raises(ValueError, match=re.escape(f"data.source={str(rows)!r} row 0 has no 'task' field; add it")):
    preflight.check_data(from_config_dict(_config(**files)))
  rows.write_text("".join(json.dumps({"prompt": f"reverse {w}=", "answer": w[::-1], "task": t}) + "\n"
                          for w, t in (("abcd", "reversal"), ("fade", "exact"), ("cafe", "revers"))))
  with pytest.raises(ValueError, match="row 2 names task 'revers', which has no verifier"):
    preflight.check_data(from_config_dict(_config(**files)))
  rows.write_text(rows.read_text().replace("revers\"", "reversal\""))
  preflight.check_data(from_config_dict(_config(**files)))
  rows.write_text(rows.read_text().replace(', "task": "exact"', ""))  # row 1 without one
  episodes = {**files, "env.fn": "calc", "run.sft_target_accuracy": 0.0}  # the environment scores its episodes
  preflight.check_data(from_config_dict(_config(**episodes)))
  with pytest.raises(ValueError, match="row 1 has no 'task' field"):  # ... but the warm-up's accuracy stop reads it
    preflight.check_data(from_config_dict(_config(**{**episodes, "run.sft_target_accuracy": 0.3})))
  with pytest.raises(ValueError, match=re.escape(  # a task source still must match its task, and says how
      "does not match source 'arithmetic': another built-in task needs both (--config.data.source=arithmetic "
      "--config.data.task.name=arithmetic)")):
    from_config_dict(_config(**{"data.source": "arithmetic"}))
  with pytest.raises(ValueError, match="'reversl' is neither a .jsonl/.parquet path nor a task in"):  # a typo
    from_config_dict(_config(**{"data.source": "reversl"}))  # before: "task.name 'reversal' does not match source"


def test_a_batch_the_prompts_cannot_fill_is_refused_with_nothing_written(tmp_path, monkeypatch):
  """Before: data.batch_size=100000 on the task's 1000 prompts passed every check; the run then spent ~4 minutes
  and died with XLA's RESOURCE_EXHAUSTED. The pipeline repeats the reshuffled prompts to fill a batch, so up to
  8 x the prompts kept (after the length filter) still runs: a 4-row file under the tiny config's batch of 16."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=re.escape(
      "data.batch_size=100000 is over 8 x the 1000 training prompts (8000): each step would hold every prompt about "
      "100 times; lower data.batch_size to 8000 or less (1000 or less holds a prompt at most once a step, twice in a "
      "step that crosses an epoch), or add prompts")):
    preflight.check_data(from_config_dict(_config(**{"data.batch_size": 100000})))
  assert not os.listdir(tmp_path)
  preflight.check_data(from_config_dict(_config(**{"data.batch_size": 8000})))
  rows = tmp_path / "rev.jsonl"  # 4 rows kept, 1 over the tiny config's max_prompt_len=16 (skipped)
  rows.write_text("".join(json.dumps({"prompt": f"reverse {w}=", "answer": w[::-1], "task": "reversal"}) + "\n"
                          for w in ("abcd", "fade", "cafe", "bead", "a" * 40)))
  files = {"data.source": str(rows), "data.eval_source": str(rows)}
  with pytest.raises(ValueError, match=re.escape("data.batch_size=33 is over 8 x the 4 training prompts (32)")):
    preflight.check_data(from_config_dict(_config(**files, **{"data.batch_size": 33})))
  preflight.check_data(from_config_dict(_config(**files, **{"data.batch_size": 32})))


def test_lora_targets_that_name_no_projection_are_refused_from_the_config():
  """Before: ('qproj',) passed every check; the run wrote its workdir, ran the supervised warm-up and only then
  failed in init_lora ('match no kernel in the params'); ('q_proj', 'v_prj') adapted q_proj alone, silently."""
  projections = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
  with pytest.raises(ValueError, match=re.escape(
      f"lora.targets ('qproj',): 'qproj' names no projection of the model tiny; its projections are {projections}")):
    preflight.check_model(from_config_dict(_config(**{"lora.rank": 8, "lora.targets": ("qproj",)})))
  with pytest.raises(ValueError, match=re.escape("('q_proj', 'v_prj', 'up'): 'v_prj', 'up' name no projection")):
    preflight.check_model(from_config_dict(_config(**{"lora.rank": 8, "lora.targets": ("q_proj", "v_prj", "up")})))
  preflight.check_model(from_config_dict(_config(**{"lora.rank": 8})))  # every default target
  preflight.check_model(from_config_dict(_config(**{"lora.targets": ("qproj",)})))  # rank 0: no LoRA, targets unused


@pytest.mark.parametrize("topology, overrides, says", [
    (dict(mode="colocated", trainer={"tensor": 3}, rollout={"tensor": 3}), {},
     "role 'actor' (trainer mesh {'tensor': 3}): ['embed_tokens']: dim 0 (vocab=128) does not divide over mesh axes "
     "tensor (3 ways)"),
    (dict(mode="colocated", trainer={"fsdp": 8}, rollout={"tensor": 8}), {},  # (KV heads would be replicated)
     "role 'rollout' (rollout mesh {'tensor': 8}): ['layers'][0]['self_attn']['o_proj']['kernel']: dim 0 "
     "(heads=4) does not divide over mesh axes tensor (8 ways)"),
    (dict(mode="disaggregated", trainer={"data": 2, "fsdp": 2}, rollout={"data": 2}),
     {"data.batch_size": 3, "rl.group_size": 2, "rollout.n_slots": 16},
     "data.batch_size x rl.group_size / run.n_micro = 3 x 2 / 1 = 6 sequences per microbatch do not divide over the "
     "trainer's data-parallel width 4 (mesh axes ('data', 'fsdp')): make them a multiple of 4"),
    (dict(mode="disaggregated", trainer={"fsdp": 4}, rollout={"data": 2}), {"run.n_micro": 3},
     "data.batch_size x rl.group_size = 16 x 16 = 256 sequences per step do not split into run.n_micro=3 equal "
     "microbatches"),
])
def test_weights_or_a_batch_that_do_not_divide_over_the_meshes_are_refused_unbuilt(topology, overrides, says):
  """Before: found by experiment.build (the weights) or the first train step (the batch), after train.py had
  written config.json; now from abstract shapes and the carved meshes (tests/test_cli.py: nothing written)."""
  from jaxrl_topo.topology.carve import carve

  c = _config(**overrides)
  c.topology = topology
  cfg = from_config_dict(c)
  with pytest.raises(ValueError, match=re.escape(says)):
    preflight.check_shapes(cfg, carve(cfg.topology))
  c = _config()
  c.topology = dict(mode="disaggregated", trainer={"data": 2, "fsdp": 2}, rollout={"data": 2, "tensor": 2})
  cfg = from_config_dict(c)
  preflight.check_shapes(cfg, carve(cfg.topology))  # 16 x 16 sequences over 4 ways; 4 heads, 2 kv heads over 2


def test_cudnn_attention_without_a_gpu_is_refused_unbuilt():
  """Before: --config.model.attention=cudnn on a CPU failed in the warm-up with JAX's 'cuDNN is not detected'
  traceback (exit 1), leaving a workdir."""
  import jax

  from jaxrl_topo.topology.carve import carve

  c = _config(**{"model.attention": "cudnn"})
  c.topology = dict(mode="colocated", trainer={"fsdp": 2}, rollout={"data": 2})
  cfg = from_config_dict(c)
  if jax.default_backend() == "gpu":
    pytest.skip("cuDNN may run here")
  with pytest.raises(ValueError, match=r"model.attention='cudnn' runs on a GPU only \(the trainer's devices are cpu\)"):
    preflight.check_shapes(cfg, carve(cfg.topology))
  c.model.attention = "auto"
  preflight.check_shapes(from_config_dict(c), carve(cfg.topology))
