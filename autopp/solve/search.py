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
import heapq
import logging
from dataclasses import dataclass, replace
from functools import lru_cache

from typing import Callable

from ..cluster import Cluster
from ..costmodel import estimate_named
from ..errors import InfeasibleError
from ..plan import Plan
from ..profile import Profile
from ..schedule import COMPUTE_KINDS, SPLIT_BACKWARD, Kind, ScheduleName, stage_to_rank, stages_per_rank, validate
from ..errors import ScheduleError
from ..schedule.named import _BUILDERS
from ..schedule import SINGLE_STAGE
from .arrays import ProfileTable, UnitArrays
from .bounds import lower_bound
from .dp import Bounds, DpMemo, PipeSpec, feasible, fits, pipeline_bounds
from .judge import (Candidate, Verdict, allreduce_time, comm_times, judge, message_overheads, named_order,
                    optimizer_time, rank_peak, stage_costs)
from .runnable import schedule_refusal, split_backward_refusal

__all__ = ["RecomputeMode", "PlanRequest", "Config", "make_plan", "microbatch_counts", "configs", "search"]

log = logging.getLogger(__name__)


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
    synthesize: bool = False
    """Also try a CP-SAT-synthesized order for the best candidate's split (autopp.solve.custom)."""
    synth_time_limit_s: float = 10.0
    """CP-SAT time limit of that synthesis."""
    placement_time_limit_s: float = 10.0
    """CP-SAT time limit for choosing the device order of a heterogeneous cluster (autopp.solve.placement)."""

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
        if self.virtual_stages not in (None, 1) and self.schedule in SINGLE_STAGE:
            raise ValueError(f"{self.schedule.value} runs one stage per rank, so --virtual-stages "
                             f"{self.virtual_stages} does not apply; use Interleaved1F1B, LoopedBFS, "
                             "InterleavedZeroBubble or --schedule auto")
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
    if name in SINGLE_STAGE:
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


class _Splits:
    """The DP's splits of one search, memoised per (microbatch size, PipeSpec): configurations that differ only in
    the schedule's name often pose the same DP (ZBV and DualPipeV; GPipe and 1F1B when memory does not bind)."""

    def __init__(self) -> None:
        self.found: dict[tuple[int, PipeSpec], Bounds | None] = {}
        self.memos: dict[int, DpMemo] = {}

    def bounds(self, a: UnitArrays, b: int, spec: PipeSpec) -> Bounds | None:
        key = (b, spec)
        if key not in self.found:
            self.found[key] = pipeline_bounds(a, spec, self.memos.setdefault(b, DpMemo()))
        return self.found[key]


def _bounds(a: UnitArrays, req: PlanRequest, c: Config, recompute: bool, splits: _Splits) -> Bounds | None:
    """The DP's split. A reachability check first rules out configurations whose memory no split fits (cheap);
    when the memory-free split already fits with every stage holding all m microbatches, memory does not bind and
    the schedule's order need not be walked."""
    spec = _spec(req, c, recompute)
    if not feasible(a, spec):
        return None
    if c.schedule not in SINGLE_STAGE:
        loose = _spec(req, c, recompute, walk=False)
        free = splits.bounds(a, c.b, replace(loose, memory=(), inflight=()))
        if free is not None and fits(a, loose, free):
            return free
    return splits.bounds(a, c.b, spec)


#: Plan note when a GPU profile is planned with a link that holds messages while their sender computes.
GPU_PROGRESS_NOTE = ("the links hold each message up to progress_s while its sender computes, as gloo does on a CPU "
                     "host (the default link); NCCL between GPUs does not: plan with --progress-delay 0 (with "
                     "--cluster: progress_s 0 on every link) or a links file measured on the GPUs")


def _links_hold_messages(cluster: Cluster) -> bool:
    """Whether any pipeline link holds messages while their sender computes (`Link.progress_s`; `link` also joins
    ranks whose devices are not adjacent in a cluster file). The closed-form estimate leaves these delays out, and
    they slow schedules with many cross-rank messages most, so the short-list is then twice as long."""
    return any(link.progress_s > 0 for link in (cluster.link, *cluster.links))


def _estimate(a: UnitArrays, req: PlanRequest, c: Config, bounds: Bounds, recompute: bool) -> float:
    owner = stage_to_rank(c.schedule, c.pp, c.v)
    speeds = [req.cluster.device(r).speed for r in owner]
    costs = stage_costs(a, bounds, speeds, message_overheads(req.cluster, owner))
    redo = [x.forward_s if recompute else 0.0 for x in costs]
    split = c.schedule in SPLIT_BACKWARD  # else each backward is one full B: pass it as I, with W = 0
    backward = [(x.backward_input_s, x.backward_weight_s) if split or x.backward_s is None else (x.backward_s, 0.0)
                for x in costs]
    est = estimate_named(c.schedule.value, [x.forward_s + x.overhead_s for x in costs],
                         [i + x.overhead_s + r for (i, _), x, r in zip(backward, costs, redo)],
                         [w for _, w in backward],
                         owner, comm_times(a, req.cluster, bounds, owner), c.m)
    grads = max(float(a.grads[i:j].sum()) for i, j in bounds) * c.v
    return est + allreduce_time(grads, c.dp, req.cluster) + optimizer_time(a, bounds, owner, speeds)


@dataclass(frozen=True)
class _Option:
    estimate: float
    index: int
    config: Config
    candidate: Candidate
    """The DP's split, with the recompute flags that fit."""


def _options(arrays: Callable[[int], UnitArrays], req: PlanRequest, cfgs: list[Config],
             refuse: Callable[[Config, Bounds], str | None] = lambda c, b: None) -> list[_Option]:
    """The short-list: the `shortlist` configurations of least estimate among those whose split fits in memory
    (checked by walking the schedule's order, exact peaks, recomputation switched on per stage under "auto"), best
    first. Configurations are visited lazily in order of a lower bound of their estimate (bounds.py) until the bound
    reaches the short-list's worst estimate: nothing left could enter it. With --recompute auto a configuration whose
    plain split does not fit the DP re-enters the queue under its all-recompute bound. A configuration whose split
    the runner would refuse (`refuse` says why) is left out."""
    modes = {RecomputeMode.NONE: (False,), RecomputeMode.ALL: (True,), RecomputeMode.AUTO: (False, True)}[req.recompute]
    keep, splits = req.shortlist * (2 if _links_hold_messages(req.cluster) else 1), _Splits()
    queue = [(lower_bound(arrays(c.b), req, c, modes[0]), idx, 0) for idx, c in enumerate(cfgs)]
    heapq.heapify(queue)
    short: list[tuple[float, int, _Option]] = []  # (-estimate, -index, option): the worst on top
    while queue:
        bound, idx, mode = heapq.heappop(queue)
        if len(short) >= keep and bound >= -short[0][0]:
            break
        c, rc = cfgs[idx], modes[mode]
        a = arrays(c.b)
        bounds = _bounds(a, req, c, rc, splits)
        if bounds is None:
            if mode + 1 < len(modes):  # AUTO: recompute only when the plain split does not fit
                heapq.heappush(queue, (max(bound, lower_bound(a, req, c, modes[mode + 1])), idx, mode + 1))
            continue
        why = refuse(c, bounds)
        if why is not None:
            log.info("%s pp=%d dp=%d v=%d m=%d: %s", c.schedule.value, c.pp, c.dp, c.v, c.m, why)
            continue
        est = _estimate(a, req, c, bounds, rc)
        if len(short) >= keep and (est, idx) >= (-short[0][0], -short[0][1]):
            continue  # cannot enter the short-list: its memory need not be walked
        cand = _fitted(a, req, _candidate(c, bounds, rc))
        if cand is None:
            log.info("%s pp=%d dp=%d v=%d m=%d: estimate %.6g s, does not fit", c.schedule.value, c.pp, c.dp, c.v,
                     c.m, est)
            continue
        heapq.heappush(short, (-est, -idx, _Option(est, idx, c, cand)))
        if len(short) > keep:
            heapq.heappop(short)
    return [o for _, _, o in sorted(short, key=lambda x: (-x[0], -x[1]))]


def _fitted(a: UnitArrays, req: PlanRequest, cand: Candidate) -> Candidate | None:
    """`cand` if every rank's peak (walked from the order: the simulator's peaks without timing) fits its device,
    else None. With --recompute auto, greedily: while a rank overflows, its stage saving the most bytes recomputes
    (a rank's flags change only its own peak, so ranks are fixed one by one)."""
    owner = cand.owner
    costs = stage_costs(a, cand.bounds, [1.0] * len(owner))
    order = named_order(cand.schedule, cand.pp, cand.microbatches, cand.v)
    flags = list(cand.recompute)
    for r in sorted(order):
        acts = [x for x in order[r] if x is not None and x.kind in COMPUTE_KINDS]
        static = sum(c.static_bytes for c, o in zip(costs, owner) if o == r)
        while rank_peak(acts, costs, flags, static) > req.cluster.device(r).memory_bytes:
            choices = [s for s, o in enumerate(owner) if o == r and not flags[s]]
            if req.recompute is not RecomputeMode.AUTO or not choices:
                return None
            flags[max(choices, key=lambda s: (costs[s].activation_bytes - costs[s].input_bytes, -s))] = True
    return replace(cand, recompute=tuple(flags))


def _candidate(c: Config, bounds: Bounds, recompute: bool) -> Candidate:
    return Candidate(schedule=c.schedule, pp=c.pp, dp=c.dp, v=c.v, microbatches=c.m, microbatch_size=c.b,
                     bounds=bounds, recompute=(recompute,) * len(bounds))


def search(profile: Profile, req: PlanRequest, table: ProfileTable | None = None,
           excluded: dict[str, str] | None = None) -> tuple[Verdict | None, int, int]:
    """The best fitting verdict (or None), the number of configurations and the number simulated. Schedules left
    out because the runner would refuse them for this model go into `excluded` (name -> why)."""
    cache: dict[int, UnitArrays] = {}
    table = table or ProfileTable(profile)

    def arrays(b: int) -> UnitArrays:
        if b not in cache:
            cache[b] = table.arrays(b)
        return cache[b]

    def refuse(c: Config, bounds: Bounds) -> str | None:
        why = schedule_refusal(profile.meta.live_values, c.schedule, bounds)
        if why is not None and excluded is not None:
            excluded.setdefault(c.schedule.value, why)
        return why

    cfgs = configs(req, profile.num_units)
    opts = _options(arrays, req, cfgs, refuse)
    fitting: list[Verdict] = []
    for opt in opts:
        verdict = judge(arrays(opt.config.b), req.cluster, opt.candidate)
        c = opt.config
        log.info("%s pp=%d dp=%d v=%d m=%d: estimate %.6g s, simulated %.6g s%s", c.schedule.value, c.pp, c.dp, c.v,
                 c.m, opt.estimate, verdict.step_s, "" if verdict.fits else " (too big)")
        if verdict.fits:
            fitting.append(verdict)
    best = min(fitting, key=lambda v: v.key) if fitting else None
    return best, len(cfgs), len(opts)


def _placement_config(req: PlanRequest, n: int, best: Verdict | None) -> Config | None:
    """The one-stage-per-rank configuration CP-SAT orders the devices for: the winner's, else the one with the
    most microbatches (the least memory per stage)."""
    if best is not None:
        c = best.candidate
        return Config(c.schedule, c.pp, c.dp, c.v, c.microbatches, c.microbatch_size) if c.v == 1 else None
    return max((c for c in configs(req, n) if c.v == 1), key=lambda c: c.m, default=None)


def _place(profile: Profile, req: PlanRequest, table: ProfileTable,
           best: Verdict | None) -> tuple[PlanRequest, Verdict | None, str | None]:
    """For a heterogeneous cluster, let CP-SAT choose which device runs which pipeline position (placement.py),
    re-run the search on that order (the DP is exact for a fixed order) and keep the order the simulator prefers."""
    from .placement import place_devices
    c = _placement_config(req, profile.num_units, best)
    if c is None:
        return req, best, None
    rc = best is not None and any(best.candidate.recompute) or best is None and req.recompute is RecomputeMode.ALL
    try:
        placed = place_devices(table.arrays(c.b), req.cluster, c.m, inflight(c.schedule, c.pp, c.m, 1), rc,
                               req.placement_time_limit_s)
    except InfeasibleError as exc:
        log.info("device placement: %s", exc)
        return req, best, None
    how = f"CP-SAT {placed.status}, gap {placed.gap:.1%}, limit {req.placement_time_limit_s:g} s"
    if list(placed.order) == list(range(req.cluster.num_devices)):
        return req, best, f"device order: the cluster file's order is CP-SAT's choice ({how})"
    trial = replace(req, cluster=req.cluster.reordered(placed.order))
    found = search(profile, trial, table)[0]
    if found is None or best is not None and found.key >= best.key:
        return req, best, f"device order: the cluster file's order kept; CP-SAT's {list(placed.order)} ({how}) " \
                          f"did not simulate faster"
    order = ", ".join(f"rank {r} -> device {d}" for r, d in enumerate(placed.order))
    return trial, found, f"device order chosen by CP-SAT ({how}): pipeline rank r runs on device order[r] of the " \
                         f"cluster file: {order}"


def make_plan(profile: Profile, request: PlanRequest) -> Plan:
    """The fastest simulated plan for `request` (ties: least peak memory), with baselines beside it. On a
    heterogeneous cluster CP-SAT also chooses the device order (the plan's notes say which and how sure)."""
    from .build import build_plan
    from .custom import synthesized
    from .explain import explain_infeasible
    table = ProfileTable(profile)
    excluded: dict[str, str] = {}
    best, n_cfg, n_sim = search(profile, request, table, excluded)
    note = None
    if not request.cluster.homogeneous and not request.cluster.order:
        request, best, note = _place(profile, request, table, best)
    if best is None and request.schedule is not None and request.schedule.value in excluded:
        raise InfeasibleError(excluded[request.schedule.value])
    if best is None:
        raise explain_infeasible(profile, request, n_cfg)
    a = table.arrays(best.candidate.microbatch_size)
    unsynthesizable = split_backward_refusal(profile.meta.live_values, best.candidate.bounds, "a synthesized order")
    custom = synthesized(a, request.cluster, best, request.synth_time_limit_s) \
        if request.synthesize and unsynthesizable is None else None
    notes = [note] if note else []
    chosen = best.candidate.schedule.value  # only some of its splits were left out: not worth a note
    notes += [why for name, why in excluded.items() if name != chosen]
    notes += [unsynthesizable] if request.synthesize and unsynthesizable else []
    if profile.meta.device.startswith("cuda") and _links_hold_messages(request.cluster):
        notes.append(GPU_PROGRESS_NOTE)
    return build_plan(profile, request, best, a, custom, extra=tuple(notes))
