"""Placement across co-execution groups (RollMux's inter-group planning), on job profiles.

A job is described by a `JobProfile`: one rollout phase's seconds at max tokens (worst case) on the
rollout nodes it needs, one train phase's seconds on the train nodes it needs, its weight-sync seconds,
its SLO (tolerated slowdown over running alone) and the bytes it keeps in host memory while off its
pools. A `GroupPlan` is a set of members sharing one train pool (`train_nodes`) and a set of rollout
nodes, each member pinned to some of them.

`cycle_periods` simulates the group's intra-group round-robin (mux/pools.py RoundRobin): per pool (the
train pool, and each rollout node) phases run one at a time in the members' fixed cyclic order, each
paying the warm-switch cost `w` when the group has more than one member; a job's rollout c starts once
its train c-1 and sync are done. The steady-state period of each member over the last cycles, against
its solo iteration R + T + S, is its slowdown.

`Placer.place(job)` puts an arriving job where the added cost ($/h of new nodes) is least, over:
  pack    an existing group as is (pinned to its least-loaded rollout nodes): no new nodes
  scale   an existing group plus just enough new rollout nodes (the fewest that meet every SLO; the rest of
          the job's rollout nodes are the group's least-loaded)
  new     a group of its own (its rollout + train nodes)
A candidate is kept only if every member's simulated period meets its SLO (worst-case lengths) and each
node's host memory holds its residents; a saturated group (its busiest pool's load reaches its longest
solo iteration) is skipped. Ties go to the fuller group (best fit). Placements are static.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np

KINDS = ("pack", "scale", "new")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobProfile:
  job: str
  rollout_s: float  # one rollout phase at max tokens (admission's worst case), on `rollout_nodes` nodes
  train_s: float  # one train phase on `train_nodes` nodes
  sync_s: float = 0.0  # trainer -> host-side rollout copy after each train phase
  rollout_nodes: int = 1
  train_nodes: int = 1
  slo: float = 1.2  # tolerated slowdown: co-run period <= slo * solo iteration
  host_bytes: int = 0  # state kept in host memory while off the pools
  arrival_s: float = 0.0  # trace replay (mux/trace.py): when the job arrives
  iters: int = 100  # trace replay: iterations the job runs
  actual_frac: float = 1.0  # trace replay: its actual rollout seconds / rollout_s (lengths under max tokens)

  def __post_init__(self):
    if not (self.rollout_s > 0 and self.train_s > 0 and self.sync_s >= 0):
      raise ValueError(f"job {self.job}: rollout_s and train_s must be > 0, sync_s >= 0")
    if self.rollout_nodes < 1 or self.train_nodes < 1:
      raise ValueError(f"job {self.job}: rollout_nodes and train_nodes must be >= 1")
    if self.slo < 1:
      raise ValueError(f"job {self.job}: slo={self.slo} < 1 (a slowdown over running alone)")
    if not 0 < self.actual_frac <= 1:
      raise ValueError(f"job {self.job}: actual_frac={self.actual_frac} must be in (0, 1]")

  @property
  def solo_s(self) -> float:
    return self.rollout_s + self.train_s + self.sync_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
  """Prices per node-hour and per-node host memory. Defaults are assumptions, not measurements: a train
  node rents for twice a rollout node (H800 vs H20 class), 2 TB of host DRAM per node."""

  rollout_node_per_h: float = 1.0
  train_node_per_h: float = 2.0
  host_bytes_per_node: int = 2 * 2**40
  switch_s: float = 2.0  # warm switch: load a job's state from host memory (the paper: about 2 s)
  # Admission checks SLOs with every rollout at max tokens and at these fractions of it: a slowdown is a
  # ratio, and shorter rollouts than the worst case can raise it (a shared train pool weighs more).
  check_fracs: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class GroupPlan:
  members: tuple[JobProfile, ...]
  train_nodes: int
  rollout_nodes: int
  pins: tuple[tuple[int, ...], ...]  # per member: the rollout node indices it runs on

  def cost_per_h(self, cluster: Cluster) -> float:
    return self.rollout_nodes * cluster.rollout_node_per_h + self.train_nodes * cluster.train_node_per_h


def train_s_on(job: JobProfile, train_nodes: int) -> float:
  """A member trains on the whole group train pool: ideal scaling from its own node count."""
  return job.train_s * job.train_nodes / train_nodes


def cycle_periods(rollout_J: Sequence[float], train_J: Sequence[float], sync_J: Sequence[float],
                  pins: Sequence[Sequence[int]], w: float, n_cycles: int = 12) -> np.ndarray:
  """Each member's steady-state iteration period under strict round-robin (module docstring)."""
  J = len(rollout_J)
  w = w if J > 1 else 0.0
  node_free: dict[int, float] = {}
  train_free = 0.0
  end_JC = np.zeros((J, n_cycles))
  for c in range(n_cycles):
    for j in range(J):
      ready = end_JC[j, c - 1] + sync_J[j] if c else 0.0
      start = max([ready] + [node_free.get(n, 0.0) for n in pins[j]])
      r_end = start + rollout_J[j] + w
      for n in pins[j]:
        node_free[n] = r_end
      train_free = max(train_free, r_end) + train_J[j] + w
      end_JC[j, c] = train_free
  k = n_cycles // 2
  return (end_JC[:, -1] - end_JC[:, -1 - k]) / k


def _fracs(g: GroupPlan, actual) -> list[float]:
  """Per member: its rollout's fraction of max tokens. `actual`: False max tokens, True each job's actual,
  a float the same fraction for all, a sequence one per member."""
  if isinstance(actual, bool):
    return [m.actual_frac if actual else 1.0 for m in g.members]
  return [float(actual)] * len(g.members) if np.isscalar(actual) else [float(f) for f in actual]


def periods(g: GroupPlan, w: float, actual=False) -> np.ndarray:
  """Members' periods with rollouts at `actual` (see _fracs): max tokens for admission, actual in replay."""
  r = [m.rollout_s * f for m, f in zip(g.members, _fracs(g, actual), strict=True)]
  t = [train_s_on(m, g.train_nodes) for m in g.members]
  return cycle_periods(r, t, [m.sync_s for m in g.members], g.pins, w)


def solo_s(job: JobProfile, actual: bool | float = False) -> float:
  f = (job.actual_frac if actual else 1.0) if isinstance(actual, bool) else float(actual)
  return job.rollout_s * f + job.train_s + job.sync_s


def slowdowns(g: GroupPlan, w: float, actual=False) -> np.ndarray:
  fr = _fracs(g, actual)
  return periods(g, w, fr) / np.array([solo_s(m, f) for m, f in zip(g.members, fr, strict=True)])


def meets_slos(g: GroupPlan, w: float, fracs: Sequence[float] = ()) -> bool:
  """Every member within its SLO with all rollouts at max tokens, and, for each f in `fracs`, with its own
  rollout at f of max tokens while the others' stay at max (its solo time shrinks, its waits do not)."""
  slo = np.array([m.slo for m in g.members]) * (1 + 1e-9)
  if np.any(slowdowns(g, w) > slo):
    return False
  for f in fracs:
    for k in range(len(g.members)):
      mix = [f if j == k else 1.0 for j in range(len(g.members))]
      if slowdowns(g, w, mix)[k] > slo[k]:
        return False
  return True


def load_s(g: GroupPlan, w: float) -> float:
  """The busiest pool's work per cycle: the train pool's, or a rollout node's."""
  train = sum(train_s_on(m, g.train_nodes) + w for m in g.members)
  per_node: dict[int, float] = {}
  for m, pin in zip(g.members, g.pins, strict=True):
    for n in pin:
      per_node[n] = per_node.get(n, 0.0) + m.rollout_s + w
  return max(train, max(per_node.values()))


def saturated(g: GroupPlan, w: float) -> bool:
  return load_s(g, w) >= max(m.solo_s for m in g.members)


def fits_host(g: GroupPlan, cluster: Cluster) -> bool:
  """Each rollout node holds its pinned members' state, the train pool every member's."""
  per_node: dict[int, int] = {}
  for m, pin in zip(g.members, g.pins, strict=True):
    for n in pin:
      per_node[n] = per_node.get(n, 0) + m.host_bytes
  cap = cluster.host_bytes_per_node
  return max(per_node.values()) <= cap and sum(m.host_bytes for m in g.members) <= cap * g.train_nodes


def _least_loaded(g: GroupPlan, k: int) -> tuple[int, ...]:
  load = {n: 0.0 for n in range(g.rollout_nodes)}
  for m, pin in zip(g.members, g.pins, strict=True):
    for n in pin:
      load[n] += m.rollout_s
  return tuple(sorted(sorted(load), key=lambda n: load[n])[:k])


def with_member(g: GroupPlan, job: JobProfile, new_nodes: int) -> GroupPlan | None:
  """The group plus `job` on `new_nodes` new rollout nodes and the rest of its `rollout_nodes` on the
  group's least-loaded ones (0: packed as is; job.rollout_nodes: on new nodes only)."""
  if job.train_nodes > g.train_nodes:
    return None  # it would need a bigger train pool: a new group
  old = job.rollout_nodes - new_nodes
  if old > g.rollout_nodes:
    return None
  pin = _least_loaded(g, old) + tuple(range(g.rollout_nodes, g.rollout_nodes + new_nodes))
  return GroupPlan(g.members + (job,), g.train_nodes, g.rollout_nodes + new_nodes, g.pins + (pin,))


def alone(job: JobProfile) -> GroupPlan:
  return GroupPlan((job,), job.train_nodes, job.rollout_nodes, (tuple(range(job.rollout_nodes)),))


@dataclasses.dataclass(frozen=True)
class Decision:
  job: str
  kind: str  # pack | scale | new
  group: int  # index into Placer.groups
  added_per_h: float


class Placer:
  """Online placement: `place(job)` for each arriving job; `remove(job)` when one leaves (trace replay)."""

  def __init__(self, cluster: Cluster):
    self.cluster = cluster
    self.groups: list[GroupPlan | None] = []  # None: a group whose members all left

  def candidates(self, job: JobProfile) -> list[tuple[float, float, str, int, GroupPlan]]:
    """(added $/h, -load after, kind, group index, plan) for every admissible placement."""
    w, out = self.cluster.switch_s, []
    for i, g in enumerate(self.groups):
      if g is None or saturated(g, w):
        continue
      for new_nodes in range(job.rollout_nodes + 1):  # rollout scaling: just enough new nodes
        plan = with_member(g, job, new_nodes)
        if plan is not None and fits_host(plan, self.cluster) and meets_slos(plan, w, self.cluster.check_fracs):
          added = plan.cost_per_h(self.cluster) - g.cost_per_h(self.cluster)
          out.append((added, -load_s(plan, w) / max(m.solo_s for m in plan.members), "scale" if new_nodes else
                      "pack", i, plan))
          break
    own = alone(job)
    if not fits_host(own, self.cluster):
      raise ValueError(f"job {job.job}: {job.host_bytes:,} B of host-resident state exceed one node's "
                       f"{self.cluster.host_bytes_per_node:,} B")
    out.append((own.cost_per_h(self.cluster), 0.0, "new", len(self.groups), own))
    return out

  def place(self, job: JobProfile) -> Decision:
    added, _, kind, i, plan = min(self.candidates(job), key=lambda c: (c[0], c[1], KINDS.index(c[2]), c[3]))
    if i == len(self.groups):
      self.groups.append(plan)
    else:
      self.groups[i] = plan
    return Decision(job.job, kind, i, added)

  def remove(self, job: str) -> int:
    """Drops `job` from its group (rollout nodes no member pins any more are given back); returns the index."""
    for i, g in enumerate(self.groups):
      if g is None or job not in [m.job for m in g.members]:
        continue
      keep = [(m, p) for m, p in zip(g.members, g.pins, strict=True) if m.job != job]
      if not keep:
        self.groups[i] = None
        return i
      used = sorted({n for _, p in keep for n in p})
      renum = {n: k for k, n in enumerate(used)}
      self.groups[i] = GroupPlan(tuple(m for m, _ in keep), g.train_nodes, len(used),
                                 tuple(tuple(renum[n] for n in p) for _, p in keep))
      return i
    raise KeyError(f"job {job} is in no group")

  def cost_per_h(self) -> float:
    return sum(g.cost_per_h(self.cluster) for g in self.groups if g is not None)


# ------------------------------------------------------------------------------------------ trace files


def _is_number(v) -> bool:
  return isinstance(v, int | float) and not isinstance(v, bool)


_TYPES = {"str": (lambda v: isinstance(v, str), "a string"), "float": (_is_number, "a number"),
          "int": (lambda v: _is_number(v) and float(v).is_integer(), "an integer"),
          "tuple[float, ...]": (lambda v: isinstance(v, list) and all(map(_is_number, v)), "a list of numbers")}


def _fields(cls, d: dict, where: str, also: str = "") -> dict:
  """`d` checked against the dataclass `cls`: no unknown key, every required key, each value of its field's
  type; else a ValueError naming `where` and the key."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  if unknown := sorted(set(d) - set(fields)):
    raise ValueError(f"{where}: unknown keys {unknown}; expected some of {sorted(fields)}{also}")
  required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
  if missing := [n for n in required if n not in d]:
    raise ValueError(f"{where}: missing {', '.join(map(repr, missing))} (required: {', '.join(required)})")
  for k, v in d.items():
    ok, kind = _TYPES[fields[k].type]
    if not ok(v):
      raise ValueError(f"{where}: {k}={json.dumps(v)} must be {kind}")
  return {k: int(v) if fields[k].type == "int" else v for k, v in d.items()}


def _job_line(d: dict, line: str) -> JobProfile:
  """A trace line's JobProfile ("host_gb" may stand for host_bytes); errors name the line, the job and the key."""
  where = f"{line}: job {d['job']!r}" if isinstance(d.get("job"), str) else line
  if "host_gb" in d:
    if not _is_number(d["host_gb"]):
      raise ValueError(f"{where}: host_gb={json.dumps(d['host_gb'])} must be a number")
    d["host_bytes"] = int(float(d.pop("host_gb")) * 2**30)
  try:
    return JobProfile(**_fields(JobProfile, d, where, " (or host_gb)"))
  except ValueError as e:
    raise ValueError(str(e) if str(e).startswith(line) else f"{line}: {e}") from None  # __post_init__'s: job named


def _cluster_line(c, where: str) -> Cluster:
  if not isinstance(c, dict):
    raise ValueError(f"{where}: cluster must be an object of Cluster's fields")
  c = _fields(Cluster, c, f"{where}: cluster")
  return Cluster(**{**c, **({"check_fracs": tuple(c["check_fracs"])} if "check_fracs" in c else {})})


def read_trace(path: str) -> tuple[list[JobProfile], Cluster | None]:
  """A JSON-lines trace: one job per line, {"job", "rollout_s", "train_s", ...} (JobProfile's fields;
  "host_gb" may stand for host_bytes), and optionally one {"cluster": {...}} line (Cluster's fields: prices,
  host memory, the switch cost in the trace's time units). A line that is not JSON, an unknown or missing key
  or a value of the wrong type is an error naming the file, the line, the job and the key."""
  jobs, cluster = [], None
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{n}"
      try:
        d = json.loads(line)
      except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
      if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object (a job's profile, or {{\"cluster\": {{...}}}})")
      if "cluster" in d:
        cluster = _cluster_line(d["cluster"], where)
      else:
        jobs.append(_job_line(d, where))
  if len({j.job for j in jobs}) != len(jobs):
    raise ValueError(f"{path}: job ids must be distinct")
  return jobs, cluster


def load_trace(path: str) -> list[JobProfile]:
  return read_trace(path)[0]


def dump_trace(jobs: Sequence[JobProfile], path: str, cluster: Cluster | None = None) -> None:
  """Writes `jobs` (and `cluster`, if given) as the JSON-lines trace `read_trace` reads."""
  with open(path, "w") as f:
    if cluster is not None:
      f.write(json.dumps({"cluster": dataclasses.asdict(cluster)}) + "\n")
    f.writelines(json.dumps(dataclasses.asdict(j)) + "\n" for j in jobs)


def plan(jobs: Sequence[JobProfile], cluster: Cluster) -> tuple[Placer, list[Decision]]:
  """Places `jobs` in arrival order (nobody leaves): the static plan `launchers/mux.py --plan` prints."""
  placer = Placer(cluster)
  return placer, [placer.place(j) for j in sorted(jobs, key=lambda j: j.arrival_s)]


def format_plan(placer: Placer, decisions: Sequence[Decision]) -> str:
  w = placer.cluster.switch_s
  lines = [f"{d.job}: {d.kind} -> group {d.group} (+${d.added_per_h:.2f}/h)" for d in decisions]
  for i, g in enumerate(placer.groups):
    if g is None:
      continue
    slow = slowdowns(g, w)
    each = ", ".join(f"{m.job} x{s:.2f}/{m.slo:.2f}" for m, s in zip(g.members, slow, strict=True))
    lines.append(f"group {i}: {g.train_nodes} train + {g.rollout_nodes} rollout nodes, "
                 f"${g.cost_per_h(placer.cluster):.2f}/h; worst-case slowdown/SLO: {each}")
  lines.append(f"total ${placer.cost_per_h():.2f}/h for {len(decisions)} jobs in "
               f"{sum(g is not None for g in placer.groups)} groups")
  return "\n".join(lines)


def plan_file(path: str, cluster: Cluster | None = None) -> str:
  """The plan of a trace file, under `cluster`, else the trace's own cluster line, else Cluster()."""
  jobs, own = read_trace(path)
  placer, decisions = plan(jobs, cluster or own or Cluster())
  return format_plan(placer, decisions)
