"""A configuration fixed by the user (a trainer's settings, or a split given by hand) judged like the planner's own."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...data.cluster import Cluster
from ...costmodel import ProfileTable
from ...errors import InfeasibleError, PlanError, ScheduleError
from ...data.plan import Plan
from ...data.profile import Profile
from ...schedule import ScheduleName, describe, listed
from ..partition.dp import Bounds
from .from_verdict import plan_from_verdict, judge_recompute
from ..search.judge import Candidate, Verdict, judge
from .make import make_plan
from ..search.request import Config, PlanRequest, RecomputeMode, configs
from ..search.runnable import weight_only_reason, weight_only_sends

__all__ = ["Pinned", "check_pinned", "evaluate_pinned", "SPLIT_NOTE", "check_split", "plan_split"]

SPLIT_NOTE = "split pinned by --split: evaluated, not searched"


@dataclass(frozen=True, kw_only=True)
class Pinned:
    """Everything that fixes one training step: the schedule, the sizes, and each stage's units."""

    schedule: ScheduleName
    pp: int
    dp: int = 1
    virtual_stages: int = 1
    """Stages per pipeline rank (2 for V schedules, v for interleaved ones)."""
    microbatches: int
    """Microbatches per replica per step."""
    microbatch_size: int
    bounds: Bounds
    """Half-open unit range of each stage, in stage order (stage s on the schedule's rank for s)."""
    recompute: tuple[bool, ...] = ()
    """Per stage; empty: no stage recomputes."""
    source: str = "pinned configuration"
    """Where it came from, for messages and the plan's notes (e.g. the trainer's config file)."""


def _check(p: Pinned, num_units: int) -> None:
    where = p.source
    if describe(p.schedule).given_order:
        raise PlanError(f"{where}: {p.schedule.value} is a plan's own order; pin one of {listed(lambda d: True)}")
    try:
        v = describe(p.schedule).stages_per_rank(p.virtual_stages)
        describe(p.schedule).validate(p.pp, p.microbatches, p.virtual_stages)
    except ScheduleError as exc:
        raise PlanError(f"{where}: {exc}") from None
    if len(p.bounds) != p.pp * v:
        raise PlanError(f"{where}: {p.schedule.value} on {p.pp} ranks x {v} stages per rank needs {p.pp * v} "
                        f"stages, the split has {len(p.bounds)}")
    ends = [b for st in p.bounds for b in st]
    if ends[0] != 0 or ends[-1] != num_units or any(a != b for a, b in zip(ends[1::2], ends[2::2])):
        raise PlanError(f"{where}: stage unit ranges {list(p.bounds)} do not cover units 0..{num_units - 1} in order")
    if any(i >= j for i, j in p.bounds):
        raise PlanError(f"{where}: stage unit ranges {list(p.bounds)} leave a stage empty; autopp's stages hold at "
                        "least one unit")
    if p.recompute and len(p.recompute) != len(p.bounds):
        raise PlanError(f"{where}: {len(p.recompute)} recompute flags for {len(p.bounds)} stages")
    if p.microbatch_size < 1 or p.dp < 1:
        raise PlanError(f"{where}: microbatch size ({p.microbatch_size}) and dp ({p.dp}) must be >= 1")


def check_pinned(p: Pinned, num_units: int, num_devices: int) -> None:
    """A PlanError (one line, naming `p.source`) unless `p` is a split of `num_units` units that its schedule runs
    on pp x dp = `num_devices` devices: what `evaluate_pinned` checks, for callers that check before planning."""
    _check(p, num_units)
    if p.pp * p.dp != num_devices:
        raise PlanError(f"{p.source}: pp {p.pp} x dp {p.dp} = {p.pp * p.dp} ranks, but the cluster has {num_devices} "
                        f"devices; plan for {p.pp * p.dp} devices")


def evaluate_pinned(profile: Profile, cluster: Cluster, pinned: Pinned) -> Plan:
    """The Plan of exactly `pinned` on `cluster` (pp x dp of its devices), with the simulator's figures and the
    baselines beside it, as `make_plan` builds its own: nothing is searched or replaced. A configuration that does
    not fit the devices' memory is still returned; its notes say which rank overflows and by how much."""
    check_pinned(pinned, profile.num_units, cluster.num_devices)
    v = describe(pinned.schedule).stages_per_rank(pinned.virtual_stages)
    recompute = pinned.recompute or (False,) * len(pinned.bounds)
    cand = Candidate(schedule=pinned.schedule, pp=pinned.pp, dp=pinned.dp, v=v, microbatches=pinned.microbatches,
                     microbatch_size=pinned.microbatch_size, bounds=tuple(pinned.bounds), recompute=recompute)
    a = ProfileTable(profile).arrays(pinned.microbatch_size)
    verdict = judge(a, cluster, cand)
    request = PlanRequest(cluster=cluster, global_batch=pinned.microbatches * pinned.microbatch_size * pinned.dp,
                          num_microbatches=pinned.microbatches, schedule=pinned.schedule, pp=pinned.pp,
                          dp=pinned.dp,
                          virtual_stages=None, recompute=RecomputeMode.ALL if any(recompute) else RecomputeMode.NONE)
    notes = [f"configuration pinned from {pinned.source}: evaluated as given, not searched",
             *_warnings(profile, cluster, verdict)]
    return plan_from_verdict(profile, request, verdict, a, extra=tuple(notes), keep_split=True)


def _warnings(profile: Profile, cluster: Cluster, verdict: Verdict) -> list[str]:
    """A note per rank whose peak overflows its device, and per stage the runner would refuse to run."""
    c = verdict.candidate
    notes = [f"does not fit: rank {r} peaks at {peak} bytes > {cluster.device(r).memory_bytes} bytes of its device"
             for r, peak in enumerate(verdict.peak_memory) if peak > cluster.device(r).memory_bytes]
    if describe(c.schedule).splits_backward:
        notes += [f"does not run ({c.schedule.value}): {weight_only_reason(s, name)}"
                  for s, name in weight_only_sends(profile.meta.live_values, c.bounds)]
    return notes


def _split_configs(request: PlanRequest, num_units: int, starts: tuple[int, ...]) -> list[Config]:
    """The request's configurations with one stage per piece of `starts`; a PlanError naming --split unless the
    starts are increasing unit indices in 1..num_units-1 and some configuration has that many stages."""
    text = ",".join(map(str, starts))
    _check_order(starts)
    if any(s < 1 or s > num_units - 1 for s in starts):
        raise PlanError(f"--split {text}: stages begin at unit indices 1..{num_units - 1} (the model has "
                        f"{num_units} units)")
    every = configs(request, num_units)
    mine = [c for c in every if c.pp * c.v == len(starts) + 1]
    if not mine:
        counts = sorted({c.pp * c.v for c in every})
        allowed = " or ".join(str(n - 1) for n in counts)
        raise PlanError(f"--split {text} gives {len(starts) + 1} stages, but this request's configurations have "
                        f"{' or '.join(map(str, counts)) or 'none'} (pp x stages per rank): give {allowed or 'no'} "
                        "start indices (one fewer than the stages)")
    stages = request.recompute_stages or ()
    if any(s > len(starts) for s in stages):
        raise PlanError(f"--recompute-stages {','.join(map(str, stages))}: --split {text} has stages "
                        f"0..{len(starts)}")
    return mine


def _check_order(starts: tuple[int, ...]) -> None:
    text = ",".join(map(str, starts))
    if not starts or any(x >= y for x, y in zip(starts, starts[1:])):
        raise PlanError(f"--split {text}: unit indices must increase (each is where the next stage begins)")


def check_split(request: PlanRequest, num_units: int | None, starts: tuple[int, ...]) -> None:
    """What `plan_split` checks, for the CLI to call before any work: with `num_units` None (the model is not
    profiled yet) only that the starts increase."""
    if num_units is None:
        _check_order(starts)
    else:
        _split_configs(request, num_units, starts)


def _judged(table: ProfileTable, request: PlanRequest, c: Config, bounds: tuple[tuple[int, int], ...]) -> Verdict:
    """The split on configuration `c`, with the pinned recompute flags or those the request's mode chooses."""
    a = table.arrays(c.b)
    cand = Candidate(schedule=c.schedule, pp=c.pp, dp=c.dp, v=c.v, microbatches=c.m, microbatch_size=c.b,
                     bounds=bounds, recompute=(False,) * len(bounds))
    return judge_recompute(a, request.cluster, cand, request.recompute, request.pinned_flags(len(bounds)))


def plan_split(profile: Profile, request: PlanRequest, starts: tuple[int, ...]) -> Plan:
    """The Plan of the split whose stages 1.. begin at units `starts` (--split), judged by the simulator on every
    configuration of `request` with that many stages: the fastest that fits (else the fastest, with a note per
    overflowing rank), with autopp's own plan for the request beside the baselines as "autopp"."""
    configs_ = _split_configs(request, profile.num_units, starts)
    ends = (0, *starts, profile.num_units)
    bounds = tuple(zip(ends, ends[1:]))
    table = ProfileTable(profile)
    verdicts = [_judged(table, request, c, bounds) for c in configs_]
    best = min(verdicts, key=lambda v: (not v.fits, v.key))
    notes = (SPLIT_NOTE, *_warnings(profile, request.cluster, best))
    plan = plan_from_verdict(profile, request, best, table.arrays(best.candidate.microbatch_size), extra=notes,
                      keep_split=True)
    try:
        own = make_plan(profile, replace(request, recompute_stages=None))
    except InfeasibleError as exc:
        return replace(plan, notes=(*plan.notes, f"autopp finds no plan for this request: {exc}"))
    return replace(plan, baselines={**plan.baselines, "autopp": own.predicted})
