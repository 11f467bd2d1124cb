"""What a co-execution group (mux/group.py) is made of, apart from running it: the group's knobs (`MuxConfig`), a
job (`JobSpec`: id, config, workdir), the config a job runs under (`on_policy`), the pools its topology carves
(`planned_pools`, checked before anything is built) and its compiled programs' count (`compile_counts`)."""

from __future__ import annotations

import dataclasses

from absl import logging

from jaxrl_topo.runtime import experiment as experiment_lib
from jaxrl_topo.runtime.config import RunConfig
from jaxrl_topo.runtime.rollout_side import _devices


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuxConfig:
  host_memory_gb: float = 64.0  # the group's host-resident state (every member, off its pools) must fit
  migrate_at: float = 0.8  # long-tail migration once this fraction of a rollout's sequences ended (1.0: off)
  # a rollout that starts while another job's stragglers decode on their tail runs on the data shards the
  # tails leave free (fewer slots); with run.deterministic a job always uses its whole rollout mesh, since on
  # other slots its log-probs would differ from its solo run's in the last bits
  resize: bool = True

  def __post_init__(self):
    if not self.host_memory_gb > 0:
      raise ValueError(f"mux.host_memory_gb={self.host_memory_gb} must be > 0")
    if not 0 < self.migrate_at <= 1:
      raise ValueError(f"mux.migrate_at={self.migrate_at} must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class JobSpec:
  job_id: str
  cfg: RunConfig
  workdir: str


def on_policy(cfg: RunConfig) -> RunConfig:
  """The job as a group runs it: disaggregated, eta = 0 (every rollout k under weights k)."""
  topo = dataclasses.replace(cfg.topology, mode="disaggregated")
  return dataclasses.replace(cfg, topology=topo, run=dataclasses.replace(cfg.run, max_staleness=0))


def compile_counts(exp: experiment_lib.Experiment) -> dict[str, int]:
  """Cache sizes of a job's jitted programs (a recompile on a warm switch would grow one)."""
  from jaxrl_topo.rollout import device

  fns = {"train_step": exp.step_fn, "logprobs": exp.logprobs_fn, "prefill": device.prefill,
         "generate": device.generate, "patch": device.patch}
  return {k: f._cache_size() for k, f in fns.items() if f is not None and hasattr(f, "_cache_size")}


def planned_pools(jid: str, cfg: RunConfig) -> dict[str, list[int]]:
  """{"train", "rollout": device ids} the job's topology carves (as `experiment.build` will), or a ValueError
  naming the job: e.g. too few devices (the launcher adds cli.device_hint's XLA_FLAGS hint on a CPU), or weights
  or a batch that do not divide over the meshes (`preflight.check_shapes`: abstract shapes, nothing built)."""
  from jaxrl_topo.runtime.preflight import check_shapes
  from jaxrl_topo.topology.carve import carve

  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)  # its "N of M devices idle" warning comes again at the job's build
  try:
    topo = carve(cfg.topology)
    check_shapes(cfg, topo)
  except ValueError as e:
    raise ValueError(f"mux: job {jid}: {e}") from None
  finally:
    logging.set_verbosity(verbosity)
  return {"train": _devices(topo.trainer), "rollout": _devices(topo.rollout)}
