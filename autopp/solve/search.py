"""The joint search: schedule x virtual stages x data parallelism x microbatches x recomputation, judged by the simulator.

1. Enumerate configurations (dp dividing the devices and the global batch, pp = devices / dp, schedules, v, m).
2. For each, the exact DP (dp.py) cuts the stages for the pipeline objective under per-stage memory budgets, and a
   closed-form estimate (costmodel.estimate_named + all-reduce) ranks it.
3. The simulator judges the best-estimated configurations in order until `shortlist` of them fit; recomputation
   ("auto") is switched on stage by stage where a rank overflows. The fastest fitting verdict wins (ties: less
   memory); its `predicted` figures and the baselines' are the simulator's.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from typing import Callable

from ..cluster import Cluster
from ..costmodel import estimate_named
from ..errors import InfeasibleError
from ..plan import Plan
from ..profile import Profile
from ..schedule import Kind, ScheduleName, build_schedule, stage_to_rank, stages_per_rank, validate
from ..errors import ScheduleError
from ..schedule.named import _BUILDERS
from .arrays import ProfileTable, UnitArrays
from .dp import Bounds, PipeSpec, fits, pipeline_bounds
from .judge import Candidate, Verdict, allreduce_time, comm_times, judge, order_peaks, stage_costs

__all__ = ["RecomputeMode", "PlanRequest", "Config", "make_plan", "microbatch_counts", "configs", "search"]

log = logging.getLogger(__name__)

RUNNABLE = (ScheduleName.ONE_F_ONE_B, ScheduleName.GPIPE)
"""Schedules autopp's runner executes today."""


class RecomputeMode(enum.Enum):
    """Activation recomputation policy."""

    NONE = "none"
    ALL = "all"
    AUTO = "auto"
    """Recompute only the stages of ranks that would not fit otherwise."""


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What the user asked for; None for a field means "search it"."""

    cluster: Cluster
    global_batch: int
    """Samples per training step over all replicas: dp x microbatches x microbatch size."""
    num_microbatches: int | None = None
    """Microbatches per replica; None: every count that divides global_batch / dp."""
    schedule: ScheduleName | None = ScheduleName.ONE_F_ONE_B
    """None: every named schedule."""
    pp: int | None = None
    """Pipeline ranks; None: devices / dp."""
    dp: int | None = 1
    """Data-parallel replicas; None: every divisor of the devices."""
    virtual_stages: int | None = None
    """Stages per rank for interleaved schedules; None: 2 and 4 (V schedules always use 2)."""
    recompute: RecomputeMode = RecomputeMode.NONE
    shortlist: int = 4
    """Configurations the simulator must find fitting before the search stops."""

    def __post_init__(self) -> None:
        d = self.cluster.num_devices
        if self.global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {self.global_batch}")
        if self.pp is not None and self.dp is not None and self.pp * self.dp != d:
            raise ValueError(f"dp({self.dp}) * pp({self.pp}) != devices ({d})")
        for name, value in (("pp", self.pp), ("dp", self.dp)):
            if value is not None and (value < 1 or d % value):
                raise ValueError(f"{name}={value} does not divide the {d} devices")
        if self.num_microbatches is not None and self.global_batch % self.num_microbatches:
            raise ValueError(f"global batch {self.global_batch} is not divisible by {self.num_microbatches} microbatches")
        if not self.cluster.homogeneous and self.dp not in (1, None):
            raise ValueError("data parallelism needs identical devices; give --dp 1 with a heterogeneous cluster")


@dataclass(frozen=True)
class Config:
    """One point of the outer search (the split is chosen inside it)."""

    schedule: ScheduleName
    pp: int
    dp: int
    v: int
    m: int
    b: int


def _dps(req: PlanRequest) -> list[int]:
    d = req.cluster.num_devices
    if req.dp is not None:
        return [req.dp]
    if req.pp is not None:
        return [d // req.pp]
    return [x for x in range(1, d + 1) if d % x == 0 and req.cluster.homogeneous or x == 1]


def _vs(req: PlanRequest, name: ScheduleName) -> list[int]:
    if name in RUNNABLE:
        return [1]
    if name in (ScheduleName.ZBV_ZERO_BUBBLE, ScheduleName.DUAL_PIPE_V):
        return [2]
    return [req.virtual_stages] if req.virtual_stages else [2, 4]


def microbatch_counts(req: PlanRequest, dp: int) -> list[int]:
    """Candidate microbatch counts per replica: divisors of global_batch / dp (or the pinned count)."""
    if req.global_batch % dp:
        return []
    per = req.global_batch // dp
    if req.num_microbatches is not None:
        return [req.num_microbatches] if per % req.num_microbatches == 0 else []
    return [m for m in range(1, per + 1) if per % m == 0]


def configs(req: PlanRequest, n: int) -> list[Config]:
    """Every valid configuration of the request for a model of `n` units."""
    names = [req.schedule] if req.schedule else list(ScheduleName)
    out = []
    for dp in _dps(req):
        pp = req.cluster.num_devices // dp
        for name in names:
            for v in _vs(req, name):
                if pp * stages_per_rank(name, v) > n:
                    continue
                for m in microbatch_counts(req, dp):
                    try:
                        validate(name, pp, m, v)
                    except ScheduleError:
                        continue
                    out.append(Config(name, pp, dp, stages_per_rank(name, v), m, req.global_batch // (dp * m)))
    return out


def inflight(name: ScheduleName, pp: int, m: int, v: int) -> tuple[int, ...]:
    """Per stage, microbatches of activations held at its peak: exact for GPipe (m) and 1F1B (min(p - s, m)); for
    multi-stage schedules, chunk c of every rank gets the count of chunk c on rank 0, which warms up the most."""
    if name is ScheduleName.GPIPE:
        return (m,) * pp
    if name is ScheduleName.ONE_F_ONE_B:
        return tuple(min(pp - s, m) for s in range(pp))
    return _walked(name, pp, m, v)


@lru_cache(maxsize=256)
def _walked(name: ScheduleName, pp: int, m: int, v: int) -> tuple[int, ...]:
    owner = stage_to_rank(name, pp, v)
    live: dict[int, int] = {}
    top: dict[int, int] = {}
    for stage, kind, _ in _BUILDERS[name](0, pp, m, v):  # rank 0's order only: a full build costs p times more
        live[stage] = live.get(stage, 0) + (1 if kind is Kind.F else -1 if kind in (Kind.B, Kind.W) else 0)
        top[stage] = max(top.get(stage, 0), live[stage])
    chunk = {s: c for c, s in enumerate(sorted(top))}  # rank 0's stages in chunk order
    ranks_chunk = [sum(1 for t in range(s) if owner[t] == owner[s]) for s in range(len(owner))]
    by_chunk = [top[s] for s in sorted(top, key=chunk.get)]
    return tuple(min(m, by_chunk[c]) for c in ranks_chunk)


def _spec(req: PlanRequest, c: Config, recompute: bool, walk: bool = True) -> PipeSpec:
    """The DP's view of a configuration; `walk=False` bounds every stage's in-flight count by m (no order walk)."""
    owner = stage_to_rank(c.schedule, c.pp, c.v)
    cl = req.cluster
    links = tuple(None if owner[k] == owner[k + 1] else cl.link_between(owner[k], owner[k + 1])
                  for k in range(len(owner) - 1))
    return PipeSpec(num_stages=len(owner), microbatches=c.m, recompute=recompute,
                    speed=tuple(cl.device(r).speed for r in owner),
                    memory=tuple(cl.device(r).memory_bytes / c.v for r in owner),
                    inflight=inflight(c.schedule, c.pp, c.m, c.v) if walk else (c.m,) * len(owner), links=links)


def _bounds(a: UnitArrays, req: PlanRequest, c: Config, recompute: bool) -> Bounds | None:
    """The DP's split; when the memory-free split already fits with every stage holding all m microbatches,
    memory does not bind and the schedule's order need not be walked."""
    if c.schedule not in RUNNABLE:
        loose = _spec(req, c, recompute, walk=False)
        free = pipeline_bounds(a, replace(loose, memory=()))
        if free is not None and fits(a, loose, free):
            return free
    return pipeline_bounds(a, _spec(req, c, recompute))


def _comm_floor(a: UnitArrays, req: PlanRequest, c: Config) -> float:
    """2 sum c over rank-crossing boundaries (/ v for zero bubble) is at least 2 x crossings x the cheapest cut."""
    if a.n < 2:
        return 0.0
    owner = stage_to_rank(c.schedule, c.pp, c.v)
    crossings = sum(owner[k] != owner[k + 1] for k in range(len(owner) - 1))
    links = req.cluster.links or (req.cluster.link,)
    cheapest = min(lk.transfer_s(float(np.min(a.cut[1:-1]))) for lk in links + (req.cluster.link,))
    ratio = 1.0 if c.schedule in RUNNABLE or c.schedule in (ScheduleName.INTERLEAVED_1F1B, ScheduleName.LOOPED_BFS) \
        else 1.0 / c.v
    return 2 * crossings * cheapest * ratio


def _lower_bound(a: UnitArrays, req: PlanRequest, c: Config) -> float:
    """A lower bound of the configuration's estimate: its formula with perfectly balanced ranks and free links,
    (m + p - 1) W / p for GPipe and 1F1B, (m + (p - 1) / v) W / p for interleaving, m W / p for zero bubble,
    plus the least all-reduce."""
    speed = sum(req.cluster.device(r).speed for r in range(c.pp))
    slots = {ScheduleName.GPIPE: c.m + c.pp - 1, ScheduleName.ONE_F_ONE_B: c.m + c.pp - 1,
             ScheduleName.INTERLEAVED_1F1B: c.m + (c.pp - 1) / c.v, ScheduleName.LOOPED_BFS: c.m + (c.pp - 1) / c.v}
    work = slots.get(c.schedule, c.m) * float(a.work().sum()) / speed
    if c.schedule not in slots:  # the zero-bubble tail: the largest stage's F + I - W is at least the mean one
        gap = float((a.forward + a.backward_input - a.backward_weight).sum()) / (c.pp * c.v) / max(
            req.cluster.device(r).speed for r in range(c.pp))
        work += (c.pp - 1) / c.v * max(0.0, gap)
    return work + _comm_floor(a, req, c) + allreduce_time(float(a.grads.sum()) / c.pp, c.dp, req.cluster)


def _estimate(a: UnitArrays, req: PlanRequest, c: Config, bounds: Bounds, recompute: bool) -> float:
    owner = stage_to_rank(c.schedule, c.pp, c.v)
    costs = stage_costs(a, bounds, [req.cluster.device(r).speed for r in owner])
    redo = [x.forward_s if recompute else 0.0 for x in costs]
    est = estimate_named(c.schedule.value, [x.forward_s for x in costs],
                         [x.backward_input_s + r for x, r in zip(costs, redo)], [x.backward_weight_s for x in costs],
                         owner, comm_times(a, req.cluster, bounds, owner), c.m)
    grads = max(float(a.grads[i:j].sum()) for i, j in bounds) * c.v
    return est + allreduce_time(grads, c.dp, req.cluster)


@dataclass(frozen=True)
class _Option:
    estimate: float
    index: int
    config: Config
    bounds: Bounds
    recompute: bool


def _options(arrays: Callable[[int], UnitArrays], req: PlanRequest, cfgs: list[Config]) -> list[_Option]:
    """Configurations with their DP split and estimate, best estimate first. Configurations are visited in order
    of a lower bound, and the visit stops once the bound reaches the shortlist-th best estimate found (none
    after it could enter the short-list)."""
    modes = {RecomputeMode.NONE: (False,), RecomputeMode.ALL: (True,), RecomputeMode.AUTO: (False, True)}[req.recompute]
    keep = req.shortlist
    order = sorted((_lower_bound(arrays(c.b), req, c), idx) for idx, c in enumerate(cfgs))
    out: list[_Option] = []
    for bound, idx in order:
        if len(out) >= keep and bound >= sorted(o.estimate for o in out)[keep - 1]:
            break
        c = cfgs[idx]
        a = arrays(c.b)
        for rc in modes:
            bounds = _bounds(a, req, c, rc)
            if bounds is not None:
                out.append(_Option(_estimate(a, req, c, bounds, rc), idx, c, bounds, rc))
                break  # AUTO: recompute only when the plain split does not fit
    return sorted(out, key=lambda o: (o.estimate, o.index, o.recompute))


def _auto_flags(a: UnitArrays, req: PlanRequest, cand: Candidate) -> tuple[bool, ...]:
    """Greedy: while a rank overflows, recompute its stage that saves the most bytes (order walk, no timing)."""
    owner = cand.owner
    costs = stage_costs(a, cand.bounds, [1.0] * len(owner))
    order = build_schedule(cand.schedule, cand.pp, cand.microbatches, cand.v)
    flags = list(cand.recompute)
    while True:
        peaks = order_peaks(order, costs, owner, flags)
        over = [r for r, p in enumerate(peaks) if p > req.cluster.device(r).memory_bytes]
        if not over:
            return tuple(flags)
        choices = [s for s, r in enumerate(owner) if r == over[0] and not flags[s]]
        if not choices:
            return tuple(flags)
        flags[max(choices, key=lambda s: (costs[s].activation_bytes - costs[s].input_bytes, -s))] = True


def _candidate(opt: _Option) -> Candidate:
    c = opt.config
    return Candidate(schedule=c.schedule, pp=c.pp, dp=c.dp, v=c.v, microbatches=c.m, microbatch_size=c.b,
                     bounds=opt.bounds, recompute=(opt.recompute,) * len(opt.bounds))


def search(profile: Profile, req: PlanRequest, table: ProfileTable | None = None) -> tuple[Verdict | None, int, int]:
    """The best fitting verdict (or None), the number of configurations and the number simulated."""
    cache: dict[int, UnitArrays] = {}
    table = table or ProfileTable(profile)

    def arrays(b: int) -> UnitArrays:
        if b not in cache:
            cache[b] = table.arrays(b)
        return cache[b]

    cfgs = configs(req, profile.num_units)
    opts = _options(arrays, req, cfgs)
    fitting: list[Verdict] = []
    simulated = 0
    for opt in opts:
        if len(fitting) >= req.shortlist:
            break
        cand = _candidate(opt)
        a = arrays(cand.microbatch_size)
        if req.recompute is RecomputeMode.AUTO:
            cand = Candidate(**{**cand.__dict__, "recompute": _auto_flags(a, req, cand)})
        verdict = judge(a, req.cluster, cand)
        simulated += 1
        log.info("%s pp=%d dp=%d v=%d m=%d: estimate %.6g s, simulated %.6g s%s", cand.schedule.value, cand.pp,
                 cand.dp, cand.v, cand.microbatches, opt.estimate, verdict.step_s, "" if verdict.fits else " (too big)")
        if verdict.fits:
            fitting.append(verdict)
    best = min(fitting, key=lambda v: v.key) if fitting else None
    return best, len(cfgs), simulated


def make_plan(profile: Profile, request: PlanRequest) -> Plan:
    """The fastest simulated plan for `request` (ties: least peak memory), with baselines beside it."""
    from .build import build_plan
    from .explain import explain_infeasible
    table = ProfileTable(profile)
    best, n_cfg, n_sim = search(profile, request, table)
    if best is None:
        raise explain_infeasible(profile, request, n_cfg)
    return build_plan(profile, request, best, table.arrays(best.candidate.microbatch_size))
