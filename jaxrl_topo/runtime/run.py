"""A whole training run: build, resume if a checkpoint exists, evaluate, train, checkpoint, summarise.

`<workdir>` afterwards holds:
  identity.json      the model and data its checkpoints belong to (runtime/workdir.py; another run's is refused)
  config.json        the run's config (config_dict): export, review and a relaunch read it back
  init_model/        the random-init HF directory (preset runs only)
  checkpoints/       orbax: train state + meta (gen_id, data-iterator state, step, seed, mode)
  metrics.jsonl, histograms.jsonl, tb/, reward_curve.png   (runtime/metrics.py)
  summary.json       accuracy_before, accuracy_after (pass@k_before|after too with run.eval_samples = k > 1), steps,
                     wall_s, mode, prompts (overlong counts), ...
  run.lock           held by the running process (workdir.held): a second run on the workdir is refused

Resume: the newest complete checkpoint restores the train state, the weights version (gen_id =
step), the batches already produced for later steps (disaggregated / async: generated under older
weights, runtime/inflight.py) and the prompt iterator as it was after the last of them. A batch still
being generated at the checkpoint (async) is regenerated from the same prompts under the restored
weights. So colocated and disaggregated runs repeat the uninterrupted run's later steps exactly
(sampling keys come from (seed, sequence id, position)); async ones do with run.deterministic=True
when no batch was mid-generation at the checkpoint, and otherwise keep every prompt and the bound.
Checkpoints every `run.checkpoint_every` steps (default 10) and at the end.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable

import jax
from absl import logging

from jaxrl_topo.runtime import experiment as experiment_lib
from jaxrl_topo.runtime import inflight, preflight
from jaxrl_topo.runtime import loop as loop_lib
from jaxrl_topo.runtime import spans as spans_lib
from jaxrl_topo.runtime import workdir as workdir_lib
from jaxrl_topo.runtime.checkpoint import Checkpointer, abstract_like
from jaxrl_topo.runtime.config import RunConfig
from jaxrl_topo.runtime.metrics import EVAL_ACCURACY, METRICS_FILE, MetricsWriter, eval_pass_at, jsonable, read_jsonl
from jaxrl_topo.runtime.rollout_side import evaluate_metrics
from jaxrl_topo.runtime.workdir import CONFIG_FILE
from jaxrl_topo.topology import hostcomm
from jaxrl_topo.topology.carve import carve


def _kill_point(name: str, step: int, before: Callable[[], None] | None = None) -> None:
  """Test hook: JAXRL_KILL_AT=<name>:<step> ends the process abruptly there (as a SIGKILL would),
  after `before()` (e.g. letting earlier checkpoints commit, so the kill lands mid-step, not mid-save)."""
  if os.environ.get("JAXRL_KILL_AT") == f"{name}:{step}":
    if before is not None:
      before()
    logging.warning("JAXRL_KILL_AT: exiting at %s of step %d", name, step)
    os._exit(137)


# Figures of the steps a launch trained; a re-launch of a finished run keeps them from its summary.json.
RUN_FIGURES = ("final_reward_mean", "steps_per_hour", "tokens_per_s", "wall_s")


def train(cfg: RunConfig, workdir: str, *, progress: bool = True) -> dict:
  """Runs (or resumes) the run described by `cfg` in `workdir`; returns the summary. Nothing is written there
  until the workdir, the devices and the meshes pass their checks; then identity.json and config.json (so
  `export(workdir, out)` reads the run back): a new run's at once, a resumed run's once its checkpoint has
  restored (a relaunch whose state does not fit the checkpoint leaves the run's record as it was)."""
  t0 = time.perf_counter()
  with experiment_lib.matmul_precision(cfg):  # every program the run traces
    # A workdir recorded under another model or data is refused before anything is read or written there.
    workdir_lib.check_workdir(cfg, workdir, need_record=False, where="workdir")
    # enough devices? the weights and batch divide over the meshes? Still unwritten (the build warns of idle devices)
    topology = carve(cfg.topology, warn=False)
    preflight.check_shapes(cfg, topology)
    preflight.check_positions(cfg)
    preflight.check_model(cfg)  # LoRA targets, the reward model's directory and vocabulary
    # One run at a time in a workdir: process 0 holds its run.lock (another launch there is refused)
    with workdir_lib.held(workdir) if _main() else contextlib.nullcontext(), spans_lib.CompileLog() as compiles:
      return _train(cfg, workdir, topology, t0, compiles, progress=progress)


def _train(cfg: RunConfig, workdir: str, topology, t0: float, compiles: spans_lib.CompileLog, *,
           progress: bool) -> dict:
  new = not workdir_lib.has_run(workdir)
  if new:  # a resumed run's record is replaced only once its checkpoint has restored (below)
    _record(cfg, workdir)
  # Only the processes holding trainer devices hold (and save) the train state; the others learn the
  # checkpoint's step and meta from the lowest of them, and keep their shard-less state arrays.
  holders = frozenset(d.process_index for d in topology.trainer.devices.flat)
  ckpt = (Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.run.keep_checkpoints, processes=holders)
          if jax.process_index() in holders else None)
  latest = hostcomm.broadcast(ckpt.latest_step() if ckpt else None, src=min(holders))
  lag = hostcomm.broadcast(inflight.max_lag(ckpt.meta(latest).get("in_flight")) if ckpt and latest is not None
                           else None, src=min(holders))
  eta = 0 if cfg.topology.mode == "colocated" else cfg.run.max_staleness
  if lag is not None and lag > eta:  # the loop would trip its staleness check on the first of them, a step later
    if ckpt is not None:
      ckpt.close()
    raise ValueError(f"{workdir}: checkpoint {latest} holds batches generated but not trained, sampled up to {lag} "
                     f"weight versions before the steps that train them; this run allows {eta} "
                     f"({cfg.topology.mode}, run.max_staleness={cfg.run.max_staleness}). Relaunch with the mode and "
                     f"run.max_staleness (>= {lag}) it was saved under, or start over with --fresh")
  try:
    exp = experiment_lib.build(cfg, workdir, warmup=latest is None)
  except Exception:
    if ckpt is not None:
      ckpt.close()
    if new and _main():  # a run that never started leaves nothing behind: the corrected call starts afresh
      with contextlib.suppress(ValueError):  # unless its folders hold another tool's files: then it stays as is
        workdir_lib.start_over(workdir)
        os.remove(os.path.join(workdir, workdir_lib.LOCK_FILE))  # the lock stays held until the file closes
    raise
  start, before, produced, landed, writer = 0, None, [], None, None
  try:
    if latest is not None:
      meta = None
      if ckpt is not None:
        try:
          exp.state, meta = ckpt.restore(latest, abstract_like(exp.state))
        except ValueError as e:  # e.g. a critic run relaunched on a critic-less run's workdir
          raise ValueError(f"{e}\n{_resume_hint(cfg, workdir)}") from e
      exp.sync.rebase(exp.state)  # LoRA: the checkpoint's (warmed-up) base, not the one built without a warm-up
      meta = hostcomm.broadcast(meta, src=min(holders))
      start, before = meta["step"], _before_rl(meta)
      try:
        exp.prompts.set_state(meta["data_state"])  # after the last saved batch
      except ValueError as e:  # e.g. another data.batch_size: the saved position means other prompts here
        raise ValueError(f"{e}\n{_resume_hint(cfg, workdir)}") from e
      saved = meta.get("in_flight")  # a list of batches; older checkpoints hold a note instead (regenerate)
      produced = [inflight.from_json(d) for d in saved] if isinstance(saved, list) else []
      landed = meta.get("landed")  # step start - 1's metrics line as it stood when the checkpoint was taken
      loop_lib.restored_weights(exp, start)  # checkpoint 0 too (the warm-up's): not the initial weights
      logging.info("resumed from step %d of %s", start, workdir)
    if not new and start < cfg.run.steps:  # a relaunch that trains nothing leaves the run's record as it is
      changed = changed_keys(cfg, workdir)
      if changed and _main():  # e.g. another algorithm's config on this run: it goes on, but not unsaid
        logging.warning("%s goes on from step %d under a changed config (its config.json is replaced): %s", workdir,
                        start, "; ".join(changed))
      _record(cfg, workdir)
    if before is None:
      before = evaluate_metrics(exp, tag=0)
      if latest is None and cfg.run.sft_steps:  # checkpoint 0: a run killed before its first RL checkpoint
        # (once the accuracy before RL is measured) keeps its warm-up on relaunch
        _save(ckpt, cfg, exp, 0, exp.prompts.get_state(), before, [])
    logging.info("held-out accuracy before RL: %.3f", before[EVAL_ACCURACY])
    # Killed after a checkpoint committed but before its step's line was written: train_loop logs that line first,
    # from the checkpoint, its evaluation (where due) run on the restored weights (in async mode the lost one may
    # have read a later version).
    lost = hostcomm.broadcast(_main() and lost_line(cfg, workdir, start, landed), src=0)
    writer = (MetricsWriter(workdir, total_steps=cfg.run.steps, tensorboard=cfg.run.tensorboard, progress=progress,
                            start_step=start - lost, resume=start > 0) if _main() else None)
    if lost:
      logging.info("step %d's metrics line was lost (a kill after its checkpoint): it is logged again from the "
                   "checkpoint", start - 1)
    hooks, seen = _hooks(cfg, exp, ckpt, writer, before, workdir, compiles, start,
                         restored={t.step for t in produced}, lost=lost)
    last = loop_lib.train_loop(exp, start_step=start, hooks=hooks, in_flight=produced,
                               lost=landed_metrics(landed) if lost else None)
    after = evaluate_metrics(exp, tag=cfg.run.steps)
    if cfg.run.steps > start:
      _save(ckpt, cfg, exp, cfg.run.steps, seen["data_state"], before, [])
    if writer is not None:
      writer.close(plot=cfg.run.plot, accuracy=(before[EVAL_ACCURACY], after[EVAL_ACCURACY]))
    summary = {"accuracy_before": before[EVAL_ACCURACY], "accuracy_after": after[EVAL_ACCURACY],
               **_pass_at_k(cfg, before, after), "steps": cfg.run.steps, "resumed_from": start,
               "wall_s": time.perf_counter() - t0, "mode": cfg.topology.mode,
               "final_reward_mean": last.get("reward_mean"), "model_dir": exp.model_dir,
               # wall clock from the end of the first step (compilation) to the last; eval excluded
               "steps_per_hour": last.get("perf/run_steps_per_hour"), "tokens_per_s": last.get("perf/run_tokens_per_s"),
               # training prompts over data.max_prompt_len: skipped or truncated per data.overlong
               "prompts": dataclasses.asdict(exp.prompts.stats)}
    if _main():
      path = os.path.join(workdir, "summary.json")
      if start >= cfg.run.steps and os.path.exists(path):  # nothing left to train: keep the run's own figures
        with open(path) as f:
          done = json.load(f)
        summary.update({k: done[k] for k in (*RUN_FIGURES, "mode") if done.get(k) is not None})
      with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    return summary
  finally:
    if writer is not None:  # a Ctrl-C too: TensorBoard's queued events are written (cli.exit_now skips atexit)
      writer.close(plot=False)
    if ckpt is not None:
      ckpt.close()
    exp.close()


def _before_rl(meta: dict) -> dict | None:
  """The held-out evaluation before RL a checkpoint holds (older ones: the accuracy only); None: none yet."""
  if meta.get("eval_before") is not None:
    return meta["eval_before"]
  return None if meta.get("accuracy_before") is None else {EVAL_ACCURACY: meta["accuracy_before"]}


def _pass_at_k(cfg: RunConfig, before: dict, after: dict) -> dict:
  """summary.json's pass@k before and after RL (run.eval_samples = k > 1); {} for one sample a prompt."""
  k = cfg.run.eval_samples
  return {} if k == 1 else {f"pass@{k}_before": before.get(eval_pass_at(k)), f"pass@{k}_after": after[eval_pass_at(k)]}


def _main() -> bool:
  return jax.process_index() == 0


def _save(ckpt: Checkpointer | None, cfg: RunConfig, exp, step: int, data_state, before, produced,
          landed: dict | None = None) -> None:
  """`data_state`: the iterator after the last trained batch; `produced`: the batches after it, not trained;
  `landed`: step - 1's metrics when its weights landed, its line not yet written (a resume writes it if lost)."""
  if ckpt is None:  # this process holds no part of the train state
    return
  meta = {"step": step, "gen_id": step, "data_state": produced[-1].data_state if produced else data_state,
          "seed": cfg.run.seed, "mode": cfg.topology.mode, "accuracy_before": before[EVAL_ACCURACY],
          "eval_before": before,
          "in_flight": [inflight.to_json(t) for t in produced], "landed": landed}
  ckpt.save(step, exp.state, meta)


def landed_meta(m: dict | None) -> dict | None:
  """A landed step's metrics as a checkpoint's meta keeps them: the JSON-able metrics, and each token's lag
  (`_lags`, one a token) as tokens per lag."""
  if m is None:
    return None
  lags = m.get("_lags")
  counts = None if lags is None else collections.Counter(map(int, lags))
  return {"metrics": jsonable({k: v for k, v in m.items() if not k.startswith("_")}),
          "lags": None if counts is None else {str(k): n for k, n in counts.items()}}


def landed_metrics(landed: dict) -> dict:
  """A checkpoint's `landed` meta (landed_meta) back as the loop's metrics: each token's lag as `_lags`."""
  lags = landed["lags"]  # {lag: tokens}: the staleness histogram's counts
  return {**landed["metrics"], "_lags": None if lags is None else [int(k) for k, n in lags.items() for _ in range(n)]}


def lost_line(cfg: RunConfig, workdir: str, start: int, landed: dict | None) -> bool:
  """Whether step start - 1's line should be in `workdir`'s metrics.jsonl, is not, and its checkpoint kept it."""
  return landed is not None and _logs(cfg, start - 1, _should_eval(cfg, start)) and not _has_line(workdir, start - 1)


def _should_eval(cfg: RunConfig, done: int) -> bool:
  return bool(cfg.run.eval_every) and done % cfg.run.eval_every == 0 and done < cfg.run.steps


def _logs(cfg: RunConfig, step: int, evaluated: bool) -> bool:
  """Whether step's line goes to metrics.jsonl: every run.log_every-th step, and every evaluated one."""
  return step % cfg.run.log_every == 0 or evaluated


def _has_line(workdir: str, step: int) -> bool:
  path = os.path.join(workdir, METRICS_FILE)
  return os.path.exists(path) and any(r["step"] == step for r in read_jsonl(path))


def _log_step(cfg: RunConfig, writer: MetricsWriter | None, step: int, m: dict) -> None:
  lags = m.pop("_lags", None)  # each token's staleness: the step's histogram
  if writer is not None and _logs(cfg, step, "eval/accuracy" in m):
    if lags is not None:  # first: the metrics.jsonl line marks the step logged (lost_line), a kill between
      writer.log_histogram(step, "staleness", [int(x) for x in lags])  # the two leaves both redone on resume
    writer.log(step, {k: v for k, v in m.items() if not k.startswith("_")})


def _hooks(cfg: RunConfig, exp, ckpt: Checkpointer | None, writer: MetricsWriter | None, before: dict | None,
           workdir: str, compiles: spans_lib.CompileLog, start: int = 0, restored: set[int] = frozenset(),
           lost: bool = False):
  """(LoopHooks, {"data_state": the prompt iterator's state after the last trained batch}). `restored`: the
  steps of the in-flight batches a resume restored (their rollout and reward spans are kept, not redone). `lost`:
  step start - 1's line is logged again (train_loop's `lost`), its evaluation redone."""
  seen = {"data_state": None, "in_flight": [], "landed": None}

  def in_flight(trajs: list) -> None:
    seen["in_flight"] = trajs

  def on_landed(step: int, m: dict) -> None:
    seen["landed"] = dict(m)  # made a checkpoint's meta only when one is saved (landed_meta)

  def on_trained(step: int, traj: loop_lib.Trajectories) -> None:
    done = step + 1
    seen["data_state"] = traj.data_state
    if step == cfg.run.profile_step:
      jax.profiler.stop_trace()  # view <workdir>/profile in Perfetto or TensorBoard's profile plugin
    _kill_point("trained", done)
    if cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0 and done < cfg.run.steps:
      _save(ckpt, cfg, exp, done, traj.data_state, before, seen["in_flight"], landed_meta(seen["landed"]))
      _kill_point("saving", done)
      _kill_point("saved", done, ckpt.wait if ckpt else None)  # committed; step `step`'s line not yet written

  def on_step(step: int, m: dict) -> None:
    _log_step(cfg, writer, step, m)

  def on_produced(step: int) -> None:
    _kill_point("rollout", step, ckpt.wait if ckpt else None)  # the middle of a step: rolled out, not yet trained
    if step == cfg.run.profile_step:  # trace from this batch's rollout end to its weights landing
      jax.profiler.start_trace(os.path.join(workdir, "profile"))

  # A resumed run keeps the spans of the steps it does not redo, and of the in-flight batches it restored
  def keep(r: dict) -> bool:
    return spans_lib.kept_span(r, start, lost) or (r["step"] in restored and r["phase"] in ("rollout", "reward"))

  on_span = spans_lib.span_writer(workdir, compiles, start=start, keep=keep, write=_main())
  return loop_lib.LoopHooks(on_step=on_step, on_landed=on_landed, on_trained=on_trained,
                            should_eval=functools.partial(_should_eval, cfg),
                            on_produced=on_produced, on_span=on_span, in_flight=in_flight), seen


# ---------------------------------------------------------------- the run's config on disk

def _record(cfg: RunConfig, workdir: str) -> None:
  """identity.json and config.json: what export, review and a relaunch read back (load_config)."""
  if _main():
    workdir_lib.write_identity(cfg, workdir)
    save_config(config_dict(cfg), workdir)


def changed_keys(cfg: RunConfig, workdir: str) -> list[str] | None:
  """'key: old -> new' for every config key a relaunch changes against the workdir's config.json (run.fresh
  aside); None when that file does not load."""
  try:
    old = config_dict(load_config(workdir))
  except (OSError, ValueError, TypeError):
    return None
  return workdir_lib.config_changes(old, config_dict(cfg))


def _resume_hint(cfg: RunConfig, workdir: str) -> str:
  """What a relaunch changed against the workdir's recorded config.json, for a checkpoint that does not fit."""
  diff = changed_keys(cfg, workdir)
  if diff is None:
    return f"{workdir}'s checkpoints were saved by another configuration; start over with --fresh (run.fresh=True)"
  return (f"{workdir}'s checkpoints were saved under its config.json (kept as it was); this launch changes "
          f"{'; '.join(diff[:8]) or 'nothing recorded'}{' ...' if len(diff) > 8 else ''}. Relaunch with that "
          f"config, or start over with --fresh (run.fresh=True)")


def save_config(config, workdir: str) -> None:
  """The ConfigDict as the launcher saw it (overrides applied): export and resume read it back. `train()` writes
  the RunConfig's own (`config_dict`); mux jobs, which do not go through it, save theirs here."""
  if _main():  # replaced whole: another process checking the workdir never reads half a file
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CONFIG_FILE)
    with open(path + ".tmp", "w") as f:
      f.write(config.to_json(indent=2) if hasattr(config, "to_json") else json.dumps(config, indent=2))
    os.replace(path + ".tmp", path)


def config_dict(cfg: RunConfig) -> dict:
  """`cfg` as the plain dict `from_config_dict` reads back to an equal RunConfig (JSON-ready: tuples as lists),
  with run.fresh=False: a relaunch from the saved config resumes, it does not start over."""
  def plain(x):
    if dataclasses.is_dataclass(x):
      return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
    if isinstance(x, dict):
      return {k: plain(v) for k, v in x.items()}
    return [plain(v) for v in x] if isinstance(x, tuple | list) else x

  t = cfg.topology
  out = {f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "topology"}
  out["run"]["fresh"] = False
  out["topology"] = {"mode": t.mode, "trainer": dict(t.trainer_axes), "rollout": dict(t.rollout_axes),
                     "reward_devices": t.reward_devices, "roles": dict(t.roles or ())}
  return out


def load_config(workdir: str) -> RunConfig:
  from jaxrl_topo.runtime.config import from_config_dict

  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: is {workdir} the workdir of a run (run.train, launchers/train.py)?")
  with open(path) as f:
    saved = json.load(f)
  if "architectures" in saved or "model_type" in saved:  # a Hugging Face config.json, not a run's
    raise ValueError(f"{workdir} is a model directory (Hugging Face config.json), not a run's workdir: give the "
                     "workdir of a run (launchers/train.py --workdir), or use the model directly "
                     "(launchers/generate.py --model)")
  return from_config_dict(saved)
