r"""Run several RL jobs as one co-execution group on one rollout pool and one train pool (jaxrl_topo/mux/).

  XLA_FLAGS=--xla_force_host_platform_device_count=2 python launchers/mux.py \
      --job=configs/grpo_task.py:tiny --job=configs/dapo.py:tiny,run.seed=3 --workdir=/tmp/mux \
      [--config.run.steps=20 ...] [--host_memory_gb=64] [--migrate_at=0.8] [--noresize]
  python launchers/mux.py --plan=TRACE.jsonl          # print the placement of a trace; nothing runs

Every job is an ordinary config file (`path:arg`), run in `<workdir>/<job id>` (job ids: `0-grpo_task`,
`1-dapo`, ...) as a disaggregated, strictly on-policy run (eta = 0; a job's topology.mode=async is run so, with
a note saying it). `--config.a.b=v` applies to every job; a job's own overrides follow its config,
comma-separated (`--job=configs/dapo.py:tiny,run.seed=3,rl.group_size=8`; a value cannot hold a comma). All
jobs must carve the same pools (same topology). Every job is checked before anything is written (config,
prompts, whether its subfolder holds another run: `mux.jobs.check_job`; then the group's host memory and
devices: `Group.admit`); a job failing those stops the launch. A job that fails while running is reported
with its id; the others go on. `<workdir>` gets mux_spans.jsonl (every phase, with its job id),
mux_summary.json (per job: ok/error and steps; per pool: busy fraction) and mux_timeline.png. Each job
checkpoints every `run.checkpoint_every` steps and at its end; running the launcher again on the same
workdir resumes every job from its newest checkpoint (a finished job has nothing left to do).
"""

import contextlib
import json
import os
import re
import sys
from collections.abc import Sequence

from absl import app, flags

from jaxrl_topo import cli
from jaxrl_topo.mux.jobs import check_job, mode_notice, parse_job, split_overrides

_JOB = flags.DEFINE_multi_string("job", [], "A job: config file[:arg][,key=value,...] (repeat per job).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Group directory: one subfolder per job, plus the group's spans.")
_PLAN = flags.DEFINE_string("plan", None, "A trace (JSON lines of job profiles): print its placement and exit.")
_HOST_GB = flags.DEFINE_float("host_memory_gb", 64.0, "mux.host_memory_gb: host memory for the group's parked state.")
_MIGRATE_AT = flags.DEFINE_float("migrate_at", 0.8, "mux.migrate_at: pass the rollout turn on at this fraction done.")
_RESIZE = flags.DEFINE_bool("resize", True, "mux.resize: a rollout that starts beside another job's tail runs on the "
                            "shards the tail leaves free (ignored with run.deterministic).")


def checked_group(workdir: str):
  """The Group: every job parsed and checked (a one-line error names the first that fails), then the group admitted
  (host memory, devices, same pools), all before anything is written."""
  from jaxrl_topo.mux.group import Group
  from jaxrl_topo.mux.spec import JobSpec, MuxConfig

  parsed = [parse_job(spec, COMMON, i) for i, spec in enumerate(_JOB.value)]
  if others := other_job_folders(workdir, [jid for jid, _ in parsed]):  # before: a note, then the group's spans
    raise cli.UserError(  # and summary were rewritten without those jobs
        f"--workdir {workdir} holds jobs this group does not run: {', '.join(others)}. A job's folder is its position "
        "and config name (<i>-<config>): give every earlier job, in its earlier order, to go on (a finished one has "
        "nothing to do), or give this group a new --workdir; nothing was changed")
  specs = []
  for jid, config in parsed:
    jobdir = os.path.join(workdir, jid)
    specs.append(JobSpec(jid, check_job(jid, config, jobdir), jobdir))
    if note := mode_notice(jid, specs[-1].cfg):
      print(note, file=sys.stderr)
  group = Group(specs, MuxConfig(host_memory_gb=_HOST_GB.value, migrate_at=_MIGRATE_AT.value,
                                   resize=_RESIZE.value), workdir, checkpoints=True)
  group.admit()
  return group


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _PLAN.value and (_JOB.value or _WORKDIR.value):
    raise app.UsageError("--plan=TRACE only places a trace's jobs and runs nothing: drop --job and --workdir")
  if _PLAN.value:
    from jaxrl_topo.mux import placement

    if not os.path.isfile(_PLAN.value):
      raise cli.UserError(f"--plan={_PLAN.value}: no such file (a JSON-lines trace, one job per line)")
    print(placement.plan_file(_PLAN.value))
    return
  if not _JOB.value or not _WORKDIR.value:
    raise app.UsageError("give --job (one per job) and --workdir, or --plan=TRACE.jsonl")
  from jaxrl_topo.models import hf_io
  from jaxrl_topo.runtime.workdir import CONFIG_FILE, IDENTITY_FILE, has_run, held, model_files

  workdir = _WORKDIR.value
  if os.path.isfile(workdir):  # before: "File exists" from the lock, after every job's checks
    raise cli.UserError(f"--workdir {workdir} is a file: name a directory (made if missing)")
  try:  # a path under a file, or in a folder this user cannot write
    hf_io.check_parent(workdir, "--workdir")
  except OSError as e:
    raise cli.UserError(str(e)) from None
  if model := model_files(workdir):
    raise cli.UserError(f"--workdir {workdir} holds {', '.join(model)}: a model directory, not a group's; nothing was "
                        "changed. Give the group its own directory (each job gets a folder inside it)")
  if has_run(workdir) or os.path.isfile(os.path.join(workdir, IDENTITY_FILE)) or os.path.isfile(
      os.path.join(workdir, CONFIG_FILE)):  # before: the group's folders and files went in beside the run's
    raise cli.UserError(f"--workdir {workdir} holds a run of launchers/train.py, not a group: give the group its own "
                        "directory (each job gets a folder inside it)")
  group = checked_group(workdir)
  specs = [job.spec for job in group.jobs.values()]
  with contextlib.ExitStack() as locks:  # one process at a time: on the group, and on each job's folder (train.py too)
    for d in (workdir, *(s.workdir for s in specs)):
      locks.enter_context(held(d))
    try:
      _run_group(group, workdir, specs)
    except KeyboardInterrupt:  # Group.run let the checkpoints being written commit first
      # The jobs' threads are still inside XLA (before: status 134, 'Fatal Python error: Aborted'): leave at once;
      # each job's metrics lines are on disk as they were logged.
      print(f"interrupted; {RESUME}", file=sys.stderr, flush=True)
      cli.exit_now(130)


def _run_group(group, workdir: str, specs) -> None:
  from jaxrl_topo.mux import report
  from jaxrl_topo.runtime import run
  from jaxrl_topo.runtime.metrics import MetricsWriter
  from jaxrl_topo.runtime.spans import CompileLog
  from jaxrl_topo.runtime.workdir import MUX_SUMMARY, MUX_TIMELINE, write_identity

  for note in changed_configs(specs):  # as train.py says it: a relaunch may change a job's config, but not unsaid
    print(note, file=sys.stderr)
  for s in specs:  # the job as the group runs it (disaggregated, eta 0: spec.on_policy), so review reads what ran
    run.save_config(run.config_dict(s.cfg), s.workdir)
    write_identity(s.cfg, s.workdir)  # a relaunch with another model or data on this workdir is refused
  group.build()
  writers = {}

  def hooks_for(jid, exp):  # each job's metrics.jsonl and spans.jsonl, as a solo run writes them
    job = group.jobs[jid]
    cfg, start = job.spec.cfg, job.start
    writers[jid] = MetricsWriter(exp_dir(jid), total_steps=cfg.run.steps, tensorboard=False, progress=False,
                                 start_step=start - (job.lost is not None), resume=start > 0)
    hooks, _ = run._hooks(cfg, exp, None, writers[jid], None, exp_dir(jid), compiles, start,  # the group
                          lost=job.lost is not None)  # checkpoints
    return hooks

  def exp_dir(jid):
    return group.jobs[jid].spec.workdir

  with CompileLog() as compiles:  # each job's compiles, taken out of its spans by the review
    results = group.run(hooks_for, compiles)
  for w in writers.values():
    w.close(plot=False)
  path = os.path.join(workdir, MUX_SUMMARY)
  earlier = {}
  try:
    with open(path) as f:
      earlier = json.load(f).get("jobs", {})
  except (OSError, ValueError, AttributeError):  # none yet, or not a summary: nothing kept from it
    pass
  finished = kept_results(results, earlier, {jid: job.spec.cfg.run.steps for jid, job in group.jobs.items()})
  summary = {"jobs": results}
  if group.spans:
    summary["busy_fraction"] = report.busy_fractions(group.spans)
    report.plot_timeline(group.spans, os.path.join(workdir, MUX_TIMELINE))
  with open(path + ".tmp", "w") as f:  # replaced whole: a Ctrl-C here leaves the earlier one, not half a file
    json.dump(summary, f, indent=2)
  os.replace(path + ".tmp", path)
  for jid, r in results.items():
    done = f"{r['steps']} steps" + (f" (resumed at step {r['resumed_from']})" if r["resumed_from"] else "")
    if jid in finished:
      done = f"already trained to step {r['resumed_from']}; nothing to do"
    print(f"{jid}: " + (done if r["ok"] else f"FAILED: {r['error'].strip().splitlines()[-1]}"))
  if "busy_fraction" in summary:
    print("busy fraction: " + ", ".join(f"{p} pool {v:.2f}" for p, v in summary["busy_fraction"].items()))
  failed = [jid for jid, r in results.items() if not r["ok"]]
  if len(failed) == len(results):
    raise cli.UserError("every job failed")
  if failed:  # the others' results stand; a script must still see that the group did not finish
    print(f"error: {len(failed)} of {len(results)} jobs failed ({', '.join(failed)}); the others finished. Run the "
          "same command again to retry the failed ones from their newest checkpoints", file=sys.stderr)
    sys.exit(1)


def changed_configs(specs) -> list[str]:
  """A note for each job that goes on from a checkpoint under a config other than its folder's config.json."""
  from jaxrl_topo.runtime import run
  from jaxrl_topo.runtime.workdir import latest_checkpoint_step

  notes = []
  for s in specs:
    latest = latest_checkpoint_step(s.workdir)
    if latest is not None and latest < s.cfg.run.steps and (changed := run.changed_keys(s.cfg, s.workdir)):
      notes.append(f"note: {s.job_id} goes on from step {latest} under a changed config (its config.json is "
                   "replaced): " + "; ".join(changed))
  return notes


def kept_results(results: dict, earlier: dict, steps: dict) -> set[str]:
  """The jobs this session found with nothing left to train (their `steps` reached); each takes, in `results`, the
  figures `earlier` (the last mux_summary.json's jobs) holds for it, where that session trained it to its end
  (`trained_to`; not one killed before: its figures would be an older session's). Kept figures keep their
  `trained_to`; `resumed_from` becomes this session's."""
  finished = {jid for jid, r in results.items() if r["ok"] and not r["steps"] and r["resumed_from"] >= steps[jid]}
  for jid in finished & set(earlier):
    before = earlier[jid]
    reached = before.get("trained_to", before.get("steps", 0) + before.get("resumed_from", 0))  # older summaries
    if before.get("ok") and reached >= steps[jid]:
      results[jid] = {**before, "resumed_from": results[jid]["resumed_from"]}
  return finished


def other_job_folders(workdir: str, job_ids: Sequence[str]) -> list[str]:
  """The <i>-<name> folders in `workdir` that hold a job's run (its config.json) and are not among `job_ids`."""
  if not os.path.isdir(workdir):
    return []
  return sorted(d for d in os.listdir(workdir) if d not in job_ids and re.fullmatch(r"\d+-.+", d)
                and os.path.isfile(os.path.join(workdir, d, "config.json")))


COMMON: list[str] = []
RESUME = "run the same command again to resume every job from its newest checkpoint"

if __name__ == "__main__":
  try:
    sys.argv, COMMON[:] = split_overrides(sys.argv)
  except cli.UserError as e:  # exit 2, as every other usage error
    print(f"error: {e}", file=sys.stderr)
    sys.exit(cli.USER_ERROR_EXIT)
  cli.launch(main, interrupted=RESUME)
