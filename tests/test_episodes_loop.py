"""Multi-turn episodes through the RL controller in all three modes (8 fake CPU devices, the topology
of test_rl_loop: trainer fsdp=4, rollout data=2 x tensor=2): every step trains on multi-turn
batches, the trainer's ids are the sampled ids and the environment's tokens carry no loss."""

from __future__ import annotations

import numpy as np
import pytest
from run_fixtures import ETA, TOPO, load_config

from jaxrl_topo.runtime import experiment, loop
from jaxrl_topo.runtime.config import from_config_dict

STEPS = 3


def _cfg(mode: str, **overrides):
  c = load_config("tool_calc", "5", **{
      "run.steps": STEPS, "run.eval_every": 0, "run.tensorboard": False, "run.plot": False, "data.batch_size": 4,
      "rl.group_size": 4, "rollout.n_slots": 16, "rollout.max_new_tokens": 48, "run.max_staleness": ETA[mode],
      "run.land_after_chunks": 1, "env.fn": "envs_for_tests:Chatty", "env.max_turns": 3, "env.n_workers": 1,
      # single-character stops end turns often, even for a barely trained model
      "rollout.stop": ("1", "2", "3", "4", "</calc>"),
      # one decode batch per shard (its 8 slots): packing's other sizes are the engine tests' subject, and
      # each is a program to compile
      "rollout.min_pack_rows": 8, **overrides})
  c.topology = TOPO[mode]
  return from_config_dict(c)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "async"])
def test_every_mode_trains_on_multi_turn_batches(mode, tmp_path):
  exp = experiment.build(_cfg(mode), str(tmp_path))
  trajs, metrics = [], []
  hooks = loop.LoopHooks(on_trained=lambda step, traj: trajs.append(traj),
                         on_step=lambda step, m: metrics.append(m))
  try:
    loop.train_loop(exp, hooks=hooks)
    assert [t.step for t in trajs] == list(range(STEPS))
    assert all(np.isfinite(m["loss"]) for m in metrics)
    assert max(m["staleness/max"] for m in metrics) <= ETA[mode]
    assert sum(m["env/errors"] + m["env/timeouts"] for m in metrics) == 0
    turns = [s.turns for t in trajs for s in t.samples]
    assert np.mean(turns) > 1.5, f"{mode}: episodes should run several turns, got {turns}"
    for traj in trajs:
      batch, _ = loop.make_batch(exp, traj)
      T = batch.targets_MBT.shape[-1]
      targets, mask = batch.targets_MBT.reshape(-1, T), batch.mask_MBT.reshape(-1, T)
      for n, s in enumerate(traj.samples):  # unpacked rows keep the group-major order
        k = len(s.tokens)
        assert targets[n, :k].tolist() == s.tokens, "the trainer's ids must be the sampled ids"
        np.testing.assert_array_equal(mask[n, :k], s.loss_mask)
        assert not mask[n, k:].any()
        env = np.asarray(s.loss_mask) == 0
        assert not np.asarray(s.logprobs)[env].any()
      # Chatty rewards turn 2: an episode's return is 1 exactly when it got a second reply
      np.testing.assert_array_equal(traj.rewards_N, [float(s.turns >= 2 and s.finish_reason != "env_error")
                                                     for s in traj.samples])
  finally:
    exp.close()


def test_an_environment_failing_every_episode_stops_the_run_keeping_its_checkpoints(tmp_path):
  """The reward functions' circuit breaker holds for an environment too (before: a run whose env.fn raised on
  every step trained on error_score to its last step). Colocated, no warm-up: step 0 trains on its failed
  episodes and is checkpointed; step 1's batch fails too, the second in a row, and the run stops."""
  import json
  import os

  from jaxrl_topo.envs.reward_pool import RewardsFailing
  from jaxrl_topo.runtime import run as run_lib

  cfg = _cfg("colocated", **{"env.fn": "envs_for_tests:RaisesOnStep", "reward.max_error_steps": 2,
                             "run.sft_steps": 0, "run.checkpoint_every": 1})
  # (an episode whose first turn ran out of tokens never called the environment: "15 of 16" is possible)
  with pytest.raises(RewardsFailing, match=r"environment 'envs_for_tests:RaisesOnStep' failed on 1\d of 16 episodes "
                                           r"in each of the last 2 scored batches .* last failure: raised "):
    run_lib.train(cfg, str(tmp_path), progress=False)
  logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in logged] == [0] and logged[0]["env/errors"] > 8
  assert os.listdir(tmp_path / "checkpoints") == ["1"]
