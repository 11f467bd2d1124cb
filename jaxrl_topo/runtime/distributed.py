"""`jax.distributed` start-up: explicit flags/config first, then our env vars, then JAX's own
cluster auto-detection (SLURM, Open MPI, Kubernetes, TPU pods), else single-process.

Env vars (set by launchers/local_multiprocess.py): JAXRL_COORDINATOR (host:port),
JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID. On CPU the cross-process collectives use gloo.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from absl import logging

_ENV = ("JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID")
_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
  coordinator: str | None = None  # "host:port" of process 0
  num_processes: int | None = None
  process_id: int | None = None
  cpu_collectives: str = "gloo"  # CPU cross-process collectives

  def __post_init__(self):
    given = [f for f in ("coordinator", "num_processes", "process_id") if getattr(self, f) is not None]
    if given and len(given) != 3:
      missing = sorted({"coordinator", "num_processes", "process_id"} - set(given))
      raise ValueError(f"explicit jax.distributed set-up needs coordinator, num_processes and process_id; "
                       f"missing {missing}")
    if self.num_processes is not None and not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process_id={self.process_id} is outside [0, num_processes={self.num_processes})")

  @classmethod
  def from_env(cls, environ=os.environ) -> DistributedConfig:
    if not any(k in environ for k in _ENV):
      return cls()
    missing = [k for k in _ENV if k not in environ]
    if missing:
      raise ValueError(f"partial multi-process environment: {missing} unset")
    return cls(coordinator=environ["JAXRL_COORDINATOR"], num_processes=int(environ["JAXRL_NUM_PROCESSES"]),
               process_id=int(environ["JAXRL_PROCESS_ID"]))


def initialize(cfg: DistributedConfig | None = None, environ=os.environ) -> str:
  """Starts jax.distributed if this is a multi-process run; returns how ("explicit", "auto", "single")."""
  cfg = cfg if cfg is not None and cfg.coordinator is not None else DistributedConfig.from_env(environ)
  if cfg.coordinator is not None:
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    jax.distributed.initialize(cfg.coordinator, num_processes=cfg.num_processes, process_id=cfg.process_id)
    how = "explicit"
  elif any(k in environ for k in _CLUSTER_ENV):
    jax.distributed.initialize()  # JAX reads the cluster's own environment
    how = "auto"
  else:
    how = "single"
  logging.info("jax.distributed: %s; process %d/%d, %d local / %d global devices", how, jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return how
