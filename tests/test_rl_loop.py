"""The RL controller end to end on the fake 8-device CPU: three modes, one algorithm, resume.

Each mode trains the `tiny` demo config for a few steps on an 8-device topology (trainer fsdp=4,
rollout data=2 x tensor=2): colocated on devices 0-3, disaggregated / async with the rollout on 4-7.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from run_fixtures import ETA, ROOT, load_config, tiny_cfg
from subproc import cpu_env

from jaxrl_topo.runtime import run as run_lib
from jaxrl_topo.runtime import spans as spans_lib
from jaxrl_topo.runtime.config import from_config_dict
from jaxrl_topo.runtime.export import export
from jaxrl_topo.runtime.metrics import comparable, read_histograms, read_metrics

MODE_STEPS = 8


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory):
  """The same config in each mode, run on first use: a fixed 150-step warm-up (so rewards are not all
  zero), then 8 steps. Every mode starts from the same weights, so their rewards must be comparable."""
  runs = {}

  def get(mode: str):
    if mode not in runs:
      workdir = tmp_path_factory.mktemp(mode)
      cfg = tiny_cfg(mode, steps=MODE_STEPS, **{"run.max_staleness": ETA[mode], "run.land_after_chunks": 1,
                                                "run.profile_step": 2, "run.sft_steps": 150})
      runs[mode] = (run_lib.train(cfg, str(workdir), progress=False), workdir)
    return runs[mode]
  return get


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "async"])
def test_each_mode_trains_and_stays_within_the_staleness_bound(mode, mode_runs):
  eta = ETA[mode]
  summary, workdir = mode_runs(mode)
  assert summary["mode"] == mode and summary["steps"] == MODE_STEPS
  records = read_metrics(str(workdir))
  assert [r["step"] for r in records] == list(range(MODE_STEPS))
  lags = [r["staleness/max"] for r in records]
  assert min(eta, 1) <= max(lags) <= eta, f"{mode}: observed lags {lags} (eta={eta})"
  assert all(np.isfinite(r["loss"]) for r in records)
  with open(workdir / "summary.json") as f:
    summary = json.load(f)
  assert summary["mode"] == mode and summary["prompts"]["n_skipped"] == 0
  assert summary["prompts"]["n_kept"] == summary["prompts"]["n_rows"] > 0
  traces = [f for _, _, files in os.walk(workdir / "profile") for f in files]
  assert any(f.endswith(".xplane.pb") for f in traces), f"no profiler trace of step 2: {traces}"
  spans = spans_lib.read_spans(str(workdir))
  train = {s["step"]: s for s in spans if s["phase"] == "train"}
  rollouts = {s["step"]: s for s in spans if s["phase"] == "rollout"}
  assert sorted(train) == list(range(MODE_STEPS)) and sorted(rollouts) == list(range(MODE_STEPS))
  assert all(s["end"] >= s["start"] >= 0 for s in spans)
  for r in records:  # per-phase seconds, each measured
    assert all(r[f"time/{p}_s"] >= 0 for p in ("rollout", "reward", "train", "sync")), r
  if mode == "colocated":
    assert set(train[0]["devices"]) == set(rollouts[0]["devices"]) == {0, 1, 2, 3}
    # Step 0's span opens at its dispatch, so its compile is inside it (before: between spans, the devices idle)
    assert train[0]["compile_s"] > 0.1 * (train[0]["end"] - train[0]["start"]), train[0]
    assert all(_spans_overlap(train[k], rollouts[k + 1]) <= 0 for k in range(MODE_STEPS - 1))
  else:
    assert set(train[0]["devices"]) == {0, 1, 2, 3} and set(rollouts[0]["devices"]) == {4, 5, 6, 7}
    # Rollout of batch k+1 runs while train step k is in flight: that is what the mode is for.
    assert any(_spans_overlap(train[k], rollouts[k + 1]) > 0 for k in range(MODE_STEPS - 1)), \
        "no rollout overlapped training"
  # The same algorithm from the same weights: the first batch is identical (weights version 0 in every
  # mode), and the mean reward over the run stays close to the colocated (on-policy) run's: within three
  # standard errors of the difference of the two 8-step means. Per-step rewards of 16 samples swing by 0.2-0.4
  # here, so this catches a stale mode that stops learning or collapses, not a small bias; a fixed 0.1 failed
  # when a change of rounding elsewhere (a matmul's contraction order) moved the runs' trajectories.
  ref = read_metrics(str(mode_runs("colocated")[1]))
  assert records[0]["reward_mean"] == ref[0]["reward_mean"] > 0
  got, want = np.array([r["reward_mean"] for r in records]), np.array([r["reward_mean"] for r in ref])
  se = np.sqrt(got.var(ddof=1) / len(got) + want.var(ddof=1) / len(want))
  assert abs(got.mean() - want.mean()) <= max(0.1, 3 * se), \
      f"{mode}: mean reward {got.mean():.3f} vs colocated {want.mean():.3f} (3 standard errors: {3 * se:.3f})"


def test_colocated_and_disaggregated_with_zero_staleness_give_the_same_parameters(tmp_path):
  """Same seed, same trainer mesh shape (fsdp=4), rollout data=2 x tensor=2 on the same or on other devices."""
  import jax

  from jaxrl_topo.runtime import experiment, loop

  params, start = {}, {}
  for mode in ("colocated", "disaggregated"):
    # A length reward: after 10 warm-up steps the task's own reward is 0 for every sample, so every advantage
    # would be 0 and the steps would move nothing (and both runs would match trivially).
    # (the warm-up in 2 microbatches: its numbers are test_train_updates.py's; here the loop reaches them)
    cfg = tiny_cfg(mode, steps=3, **{"run.max_staleness": 0, "reward.fn": "reward_fns_for_tests:length",
                                     "run.sft_n_micro": 2})
    exp = experiment.build(cfg, str(tmp_path / mode))  # the supervised warm-up runs here
    try:
      start[mode], ok = jax.device_get(exp.state.params), []
      loop.train_loop(exp, hooks=loop.LoopHooks(on_step=lambda step, m, ok=ok: ok.append(float(m["step_ok"]))))
      params[mode] = jax.device_get(exp.state.params)
    finally:
      exp.close()
    assert ok == [1.0] * 3, f"{mode}: a step was rejected"
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params["colocated"], params["disaggregated"])
  assert all(jax.tree.leaves(same)), "colocated and disaggregated (eta=0) runs diverged"
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), params["colocated"], start["colocated"])
  assert all(jax.tree.leaves(moved)), "the RL steps left some parameters as the warm-up did"


@pytest.mark.parametrize("policy", ["keep_kv", "finish_on_old"])
def test_async_weights_land_mid_sequence_only_under_keep_kv(policy, tmp_path):
  """rollout.update_policy in the async loop: weights that land between chunks continue live sequences under
  keep_kv (some sample's tokens carry two gen_ids), and under finish_on_old every sample is one version's."""
  from jaxrl_topo.runtime import experiment, loop

  cfg = tiny_cfg("async", steps=3, **{"run.max_staleness": 1, "run.land_after_chunks": 1,
                                      "rollout.update_policy": policy, "reward.fn": "reward_fns_for_tests:length",
                                      "rollout.max_new_tokens": 12})
  exp = experiment.build(cfg, str(tmp_path))
  versions = []
  try:
    loop.train_loop(exp, hooks=loop.LoopHooks(
        on_trained=lambda step, traj: versions.extend(len(set(s.gen_ids)) for s in traj.samples)))
  finally:
    exp.close()
  assert len(versions) == 3 * 4 * 4
  assert (max(versions) == 2) == (policy == "keep_kv"), f"{policy}: versions per sample {sorted(set(versions))}"


@pytest.mark.parametrize("fn, shaped", [("length", True), ("one", False), ("one", True)])
def test_dapo_dynamic_sampling_and_soft_overlong_by_hand(fn, shaped, tmp_path):
  """reward.dynamic_sampling over 2 rounds: with a length reward and the soft overlong penalty every group varies,
  so one round is drawn and nothing dropped, and each shaped reward is the length less 0.5 x the tokens past
  12 - 4, over 4; with overlong filtering the batch masks exactly the completions cut at 12 tokens. With a
  constant reward no group varies: both rounds run, all 8 of their groups are dropped, and the batch is filled
  from them. So it is with the overlong penalty on top: DAPO keeps a group for its accuracy (the main reward)
  varying, not for a length penalty (before, such a group was kept and trained on the penalty alone)."""
  from jaxrl_topo.runtime import experiment, loop

  shaping = ({"reward.overlong_buffer": 4, "reward.overlong_penalty": 0.5, "reward.overlong_filter": fn == "length"}
             if shaped else {})
  cfg = tiny_cfg("colocated", steps=2, **{"reward.fn": f"reward_fns_for_tests:{fn}", "rollout.max_new_tokens": 12,
                                          "reward.dynamic_sampling": True, "reward.max_sampling_rounds": 2, **shaping})
  exp = experiment.build(cfg, str(tmp_path))
  trajs, cut = [], []
  try:
    loop.train_loop(exp, hooks=loop.LoopHooks(on_trained=lambda step, traj: trajs.append(traj)))
    for traj in trajs:  # overlong filtering: a completion cut at max_new_tokens carries no loss
      batch, _ = loop.make_batch(exp, traj, None)
      cut.append(((batch.mask_MBT.sum(-1) == 0).sum(), sum(s.finish_reason == "length" for s in traj.samples)))
  finally:
    exp.close()
  if fn == "length":
    assert all(masked == n for masked, n in cut) and sum(n for _, n in cut) > 0, cut
  assert len(trajs) == 2
  if shaped:
    assert any(len(s.tokens) > 8 for t in trajs for s in t.samples), "some completion must reach the buffer"
  for traj in trajs:
    groups = traj.rewards_N.reshape(4, 4)
    if shaped:
      over = np.array([max(0, len(s.tokens) - 8) for s in traj.samples])
      np.testing.assert_allclose(traj.rewards_N, traj.correct_N - 0.5 * over / 4, rtol=1e-6)
    if fn == "length":
      assert (traj.info["dapo/rounds"], traj.info["dapo/dropped_groups"]) == (1, 0)
      assert (np.ptp(groups, axis=1) > 0).all()
    else:
      assert (traj.info["dapo/rounds"], traj.info["dapo/dropped_groups"]) == (2, 8)
      assert (np.ptp(traj.correct_N.reshape(4, 4), axis=1) == 0).all()
      assert (np.ptp(groups, axis=1) > 0).any() if shaped else (np.ptp(groups, axis=1) == 0).all()


def _launch(workdir, steps, kill_at=None, cache_dir=None, **overrides):
  import subprocess
  import sys

  # step 3 (weights 4) is evaluated: a line a resume from checkpoint 4 must rebuild, evaluation included
  flags = {"run.steps": steps, "run.checkpoint_every": 2, "run.eval_every": 4, "run.tensorboard": False,
           "run.plot": False, "reward.n_workers": 0, "run.sft_steps": 10, "run.sft_target_accuracy": 0.0,
           "data.batch_size": 4, "rl.group_size": 4, "rollout.n_slots": 16,
           # after 10 warm-up steps the task's reward is 0 for every sample: no step would move a weight
           "reward.fn": "reward_fns_for_tests:length", **overrides}
  cmd = [sys.executable, os.path.join(ROOT, "launchers", "train.py"), "--config",
         os.path.join(ROOT, "configs", "grpo_task.py") + ":tiny", f"--workdir={workdir}", "--noprogress",
         *[f"--config.{k}={v}" for k, v in flags.items()]]
  env = cpu_env(PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))  # one device; the tests' reward module
  if cache_dir:  # the launches compile the same programs: share them through JAX's persistent cache
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  env.pop("JAXRL_KILL_AT", None)
  if kill_at:
    env["JAXRL_KILL_AT"] = kill_at
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  """An uninterrupted 6-step run of the launcher (checkpoints every 2 steps), and a compile cache."""
  root = tmp_path_factory.mktemp("launched")
  done = _launch(root / "ref", steps=6, cache_dir=root / "cache")
  assert done.returncode == 0, done.stderr[-3000:]
  return root


@pytest.mark.slow
# mid-step; mid-save (async write in flight); checkpoint 4 committed, step 3's metrics line not yet written (before:
# a resume from checkpoint 4 had no line for step 3, nor its evaluation)
# mid step 1: before checkpoint 2, after checkpoint 0 (the warm-up's; before it, a relaunch redid the warm-up). (A
# kill mid step 3, resumed from checkpoint 2, was a case too: "saving:4" resumes from 2 the same way, mid-save.)
@pytest.mark.parametrize("kill_at, resumed_from", [("rollout:1", 0), ("saving:4", 2), ("saved:4", 4)])
def test_resume_after_a_kill_repeats_the_uninterrupted_run(kill_at, resumed_from, launched, tmp_path):

  run = tmp_path / "killed"
  killed = _launch(run, steps=6, kill_at=kill_at, cache_dir=launched / "cache")
  assert killed.returncode == 137, f"the kill point {kill_at} was not reached:\n{killed.stderr[-3000:]}"
  if kill_at == "saved:4":
    assert [r["step"] for r in read_metrics(str(run))] == [0, 1, 2]
  resumed = _launch(run, steps=6, cache_dir=launched / "cache")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  with open(run / "summary.json") as f:
    assert json.load(f)["resumed_from"] == resumed_from
  assert f"resumed from step {resumed_from} " in resumed.stderr and "sft warm-up" not in resumed.stderr
  want, got = comparable(read_metrics(str(launched / "ref"))), comparable(read_metrics(str(run)))
  assert [r["step"] for r in got] == list(range(6))
  assert "eval/accuracy" in got[3] and read_histograms(str(run)) == read_histograms(str(launched / "ref"))
  if kill_at == "saved:4":
    # A relaunch that trains nothing leaves the run's config.json as it was (before: it recorded the new lr)
    recorded = (run / "config.json").read_text()
    again = _launch(run, steps=6, cache_dir=launched / "cache", **{"optim.lr": 0.5})
    assert again.returncode == 0 and (run / "config.json").read_text() == recorded, again.stderr[-3000:]
    # Another batch size cannot continue the prompts where the checkpoint left them: refused, saying what changed
    more = _launch(run, steps=8, cache_dir=launched / "cache", **{"data.batch_size": 8})
    assert more.returncode == 2 and "this launch changes data.batch_size: 4 -> 8" in more.stderr, more.stderr[-3000:]
  assert all(r["grad_norm"] > 0 for r in want), "steps that move no weight would make any resume look exact"
  assert got == want, "a resumed run must repeat the uninterrupted run's metrics"


def test_a_resumed_lora_run_samples_from_the_warmed_up_base(tmp_path):
  """sync.mode=lora keeps the frozen base on the rollout side. A resume builds the experiment without the warm-up,
  then restores the checkpoint's (warmed-up) base into the trainer; the rollout kept the built one, so every
  resumed step sampled from another model than the trainer scored (log-prob gap 2.55 here, not 1e-6)."""
  lora = {"lora.rank": 4, "sync.mode": "lora", "run.checkpoint_every": 1, "reward.fn": "reward_fns_for_tests:length"}
  run_lib.train(tiny_cfg("colocated", steps=1, **lora), str(tmp_path), progress=False)
  summary = run_lib.train(tiny_cfg("colocated", steps=2, **lora), str(tmp_path), progress=False)
  assert summary["resumed_from"] == 1
  assert [r["logprob_gap/max"] < 1e-4 for r in read_metrics(str(tmp_path))] == [True, True]
  # Colocated, the adapters alias (one device list): no sync moves a byte, as the data-path review predicts (before:
  # 32,768 bytes a step predicted; test_loop_sync.py checks the disaggregated run's).
  from jaxrl_topo.review.step_bytes import step_bytes

  want = step_bytes(tiny_cfg("colocated", steps=2, **lora)).sync_per_step
  assert [r["sync/bytes"] for r in read_metrics(str(tmp_path))] == [want, want] == [0, 0]


def test_review_warns_when_the_run_is_of_another_model(launched, tmp_path):
  """launchers/review.py --config=X --workdir=RUN fits RUN's measured phase times to X; before, nothing said that
  RUN trained another model (a 7B record calibrated on the tiny run's spans)."""
  import subprocess
  import sys

  review = [sys.executable, os.path.join(ROOT, "launchers", "review.py"), f"--workdir={launched / 'ref'}",
            "--config=" + os.path.join(ROOT, "configs", "grpo_task.py") + ":tiny"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  other = subprocess.run([*review, "--config.model.preset=qwen2.5-0.5b", f"--out={tmp_path / 'a'}"], env=env,
                         capture_output=True, text=True, timeout=300)
  assert other.returncode == 0 and "WARNING: --workdir=" in other.stderr, other.stderr[-3000:]
  assert "ran another model or data than --config: model.preset: 'tiny' -> 'qwen2.5-0.5b'" in other.stderr
  same = subprocess.run([*review, f"--out={tmp_path / 'b'}"], env=env, capture_output=True, text=True, timeout=300)
  assert same.returncode == 0 and "ran another model" not in same.stderr, same.stderr[-3000:]


def test_export_writes_a_directory_transformers_loads(launched, tmp_path):
  import torch
  import transformers

  from jaxrl_topo.models import hf_io
  from jaxrl_topo.models.model import forward
  from jaxrl_topo.runtime.checkpoint import Checkpointer

  out = tmp_path / "hf"
  assert export(str(launched / "ref"), str(out), step=4) == 4
  assert json.loads((out / "exported_from.json").read_text())["step"] == 4
  assert export(str(launched / "ref"), str(out)) == 6  # an earlier export is replaced
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  tokens = np.array([[5, 9, 23, 40, 86, 7]], np.int32)
  with torch.no_grad():
    want = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  cfg, graphdef, params = hf_io.load_model(str(out), dtype="float32")
  got = np.asarray(forward(graphdef, params, tokens, np.arange(6, dtype=np.int32)[None])[0])
  np.testing.assert_allclose(got, want, atol=1e-4)
  # The exported weights are the trained ones, not the initial model's.
  _, _, init = hf_io.load_model(str(launched / "ref" / "init_model"), dtype="float32")
  assert not np.array_equal(np.asarray(init["embed_tokens"]), np.asarray(params["embed_tokens"]))
  with Checkpointer(str(launched / "ref" / "checkpoints")) as ck:
    assert ck.latest_step() == 6


@pytest.mark.slow
def test_gsm8k_config_runs_on_a_tiny_random_qwen_directory(tmp_path):
  """The GSM8K recipe end to end on a tiny random Qwen2-shaped HF directory and a 6-row JSONL."""
  import dataclasses

  from jaxrl_topo.models.fresh import write_fresh_model
  from jaxrl_topo.models.presets import get_preset

  model_dir = tmp_path / "qwen"
  write_fresh_model(str(model_dir), dataclasses.replace(get_preset("tiny"), family="qwen2", qk_norm=False,
                                                        qkv_bias=True))
  rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} plus {b} is {a + b}.\n#### {a + b}"}
          for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4)]]
  for name in ("train.jsonl", "test.jsonl"):
    with open(tmp_path / name, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  c = load_config("grpo_gsm8k", str(model_dir), **{
      "data.source": str(tmp_path / "train.jsonl"), "data.eval_source": str(tmp_path / "test.jsonl"),
      "data.batch_size": 2, "rl.group_size": 2, "rollout.max_new_tokens": 4, "rollout.n_slots": 8,
      "model.dtype": "float32", "run.steps": 2, "run.eval_every": 1, "run.eval_size": 2, "run.n_micro": 1,
      "run.checkpoint_every": 0, "run.tensorboard": False, "run.plot": False, "reward.n_workers": 0,
      "data.max_prompt_len": 160,  # the config's instruction follows each question
      "run.eval_samples": 2, "rollout.eval_greedy": False})  # pass@2 (its numbers: test_metrics.py)
  c.topology = dict(mode="disaggregated", trainer={"fsdp": 2}, rollout={"data": 2})
  summary = run_lib.train(from_config_dict(c), str(tmp_path / "run"), progress=False)
  records = read_metrics(str(tmp_path / "run"))
  assert summary["steps"] == 2 and len(records) == 2
  assert all(0.0 <= r["reward/correct"] <= 1.0 for r in records)
  assert records[0]["eval/accuracy"] <= records[0]["eval/pass@2"] <= 1.0
  for when in ("before", "after"):
    assert 0.0 <= summary[f"accuracy_{when}"] <= summary[f"pass@2_{when}"] <= 1.0, summary


def _spans_overlap(a, b):
  return min(a["end"], b["end"]) - max(a["start"], b["start"])


def test_a_reward_model_on_its_own_devices_adds_its_score(tmp_path):
  """reward.model_dir: a sequence-scoring model on the topology's reward devices (2 of the 8), its
  score of prompt + completion added with model_weight to the verifier's."""
  import jax

  from jaxrl_topo.models.presets import get_preset
  from jaxrl_topo.rl.reward_model import RewardModel, write_reward_model
  from jaxrl_topo.runtime import experiment, loop
  from jaxrl_topo.topology.rules import ROLLOUT_RULES, make_mesh

  write_reward_model(str(tmp_path / "rm"), get_preset("tiny"), seed=3)
  c = load_config("grpo_task", "tiny", **{"run.steps": 2, "run.eval_every": 0, "reward.n_workers": 0,
                                          "run.sft_steps": 0, "data.batch_size": 2, "rl.group_size": 4,
                                          "rollout.n_slots": 8, "reward.model_dir": str(tmp_path / "rm"),
                                          "reward.model_weight": 0.5, "reward.model_batch_size": 4})
  c.topology = dict(mode="disaggregated", trainer={"fsdp": 2}, rollout={"data": 2}, reward_devices=2)
  exp = experiment.build(from_config_dict(c), str(tmp_path / "run"))
  spans, seen = [], []
  try:
    assert sorted(d.id for d in exp.reward_model.mesh.devices.flat) == [4, 5]
    hooks = loop.LoopHooks(on_span=spans.append, on_trained=lambda step, traj: seen.append(traj))
    loop.train_loop(exp, hooks=hooks)
    traj = seen[0]
    seqs = [list(traj.examples[i // 4]["prompt_ids"]) + list(s.tokens) for i, s in enumerate(traj.samples)]
    rm = RewardModel.load(str(tmp_path / "rm"), make_mesh({"data": 1}, jax.devices()[:1]), ROLLOUT_RULES)
    want = traj.correct_N + 0.5 * rm.score(seqs)  # the verifier ("task") plus half the model's score
    np.testing.assert_allclose(traj.rewards_N, want, rtol=1e-5, atol=1e-6)
    assert np.ptp(traj.rewards_N) > 0
  finally:
    exp.close()
  assert {tuple(s["devices"]) for s in spans if s["phase"] == "reward"} == {(4, 5)}


def test_model_as_the_main_reward_is_validated_before_anything_runs(tmp_path):
  from jaxrl_topo.runtime import experiment
  from jaxrl_topo.runtime.sections import RewardSpec

  with pytest.raises(ValueError, match="needs reward.model_dir"):
    RewardSpec(fn="model")
  spec = RewardSpec(fn="model", model_dir="/rm", extra={"format": 0.1})
  assert spec.fns == (("format", 0.1),), "the model is scored on devices, not in the worker pool"
  # Naming the model in `extra` was accepted, then weighted by model_weight instead (or dropped without model_dir).
  with pytest.raises(ValueError, match=r'reward.extra holds "model": .* weighted by reward.model_weight'):
    RewardSpec(fn="task", model_dir="/rm", extra={"model": 0.5})
  c = load_config("grpo_task", "tiny", **{"reward.fn": "model", "reward.model_dir": str(tmp_path / "rm")})
  with pytest.raises(ValueError, match="sft_target_accuracy"):  # the demo's warm-up stops on a verifier
    experiment.build(from_config_dict(c), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run"), "the config error must come before anything is written"
  # The reward model's directory is read before anything is written: missing, or a smaller vocabulary.
  from jaxrl_topo.models.presets import get_preset
  from jaxrl_topo.rl.reward_model import write_reward_model
  from jaxrl_topo.runtime import run as run_lib

  c.run.sft_steps = 0
  with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'rm'}: no config.json"):
    run_lib.train(from_config_dict(c), str(tmp_path / "run"), progress=False)
  write_reward_model(str(tmp_path / "rm"), dataclasses.replace(get_preset("tiny"), vocab_size=110))
  with pytest.raises(ValueError, match="has vocab_size 110 < the policy's"):
    run_lib.train(from_config_dict(c), str(tmp_path / "run"), progress=False)
  assert not os.path.exists(tmp_path / "run")


def test_every_process_takes_process_0s_scores(monkeypatch):
  """Each process scores in its own reward pool against a wall-clock timeout: a timeout on one process gave it
  other rewards, and a colocated run then failed in device_put ("not the same on each process"), or logged
  another held-out accuracy. The scores now pass through a broadcast from process 0 (a stand-in here)."""
  import types

  from jaxrl_topo.runtime import rollout_side
  from jaxrl_topo.runtime.sections import RewardSpec

  class Pool:
    def submit(self, prompts, texts, meta):
      return 0

    def collect(self, tickets):
      return types.SimpleNamespace(total_N=np.array([1.0, 0.0], np.float32), per_fn={"task": np.array([1.0, 0.0])},
                                   errors=0, timeouts=0)

  cfg = types.SimpleNamespace(reward=RewardSpec(fn="task"), rl=types.SimpleNamespace(group_size=2))
  exp = types.SimpleNamespace(cfg=cfg, env=None, rewards=Pool(), reward_model=None)
  monkeypatch.setattr(rollout_side.hostcomm, "broadcast", lambda obj, src: (obj[0] * 0 + 7.0, obj[1], obj[2]))
  samples = [types.SimpleNamespace(tokens=[5]), types.SimpleNamespace(tokens=[6])]
  rewards, _, _ = rollout_side.score(exp, [{"prompt": "p", "prompt_ids": [1]}], samples, tickets=[0])
  assert rewards.tolist() == [7.0, 7.0]
