"""A configuration fixed by the user (a trainer's settings, or a split given by hand) judged like the planner's own."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...data.cluster import Cluster
from ...data.layout import LayoutPins
from ...data.overlap import Overlap
from ...data.plan import Plan
from ...data.profile import Profile
from ...errors import InfeasibleError, LayoutError, PlanError, ScheduleError
from ...schedule import Activation, describe, listed, policy
from ...sizes import format_size
from ..search.judge import Candidate, Verdict, judge
from ..search.request import Config, Group, PlanRequest, configs
from ..search.runnable import weight_only_reason, weight_only_sends
from ..search.views import Views
from .from_verdict import judge_recompute, plan_from_verdict
from .make import make_plan

__all__ = ["Pinned", "check_pinned", "evaluate_pinned", "SPLIT_NOTE", "check_split", "plan_split"]

SPLIT_NOTE = "split pinned (`split`): evaluated, not searched"


@dataclass(frozen=True, kw_only=True)
class Pinned:
    """Everything that fixes one training step (a candidate: the schedule, the layout, the sizes, each stage's units
    and activation policy), and where it came from."""

    candidate: Candidate
    """`layout.v` is the stages per pipeline rank (2 for V schedules, v for interleaved ones); `bounds` each stage's
    half-open unit range, in stage order (stage s on the schedule's rank for s)."""
    source: str = "pinned configuration"
    """Where it came from, for messages and the plan's notes (e.g. the trainer's config file)."""
    ep_a2a: bool = False
    """It hides expert all-to-alls under other microbatches' compute (`Overlap.ep_a2a`: Megatron-LM's
    `--overlap-moe-expert-parallel-comm` in the file)."""


def _check(p: Pinned, num_units: int) -> None:
    where, c = p.source, p.candidate
    pp, v = c.layout.pp, c.layout.v
    if describe(c.schedule).given_order:
        raise PlanError(f"{where}: {c.schedule.value} is a plan's own order; pin one of {listed(lambda d: True)}")
    try:
        describe(c.schedule).stages_per_rank(v)
        describe(c.schedule).validate(pp, c.microbatches, v)
    except ScheduleError as exc:
        raise PlanError(f"{where}: {exc}") from None
    if len(c.bounds) != pp * v:
        raise PlanError(f"{where}: {c.schedule.value} on {pp} ranks x {v} stages per rank needs {pp * v} "
                        f"stages, the split has {len(c.bounds)}")
    ends = [b for st in c.bounds for b in st]
    if ends[0] != 0 or ends[-1] != num_units or any(a != b for a, b in zip(ends[1::2], ends[2::2])):
        raise PlanError(f"{where}: stage unit ranges {list(c.bounds)} do not cover units 0..{num_units - 1} in order")
    if any(i >= j for i, j in c.bounds):
        raise PlanError(f"{where}: stage unit ranges {list(c.bounds)} leave a stage empty; autopp's stages hold at "
                        "least one unit")
    if len(c.activations) != len(c.bounds):
        raise PlanError(f"{where}: {len(c.activations)} activation policies for {len(c.bounds)} stages")
    if c.microbatch_size < 1:
        raise PlanError(f"{where}: microbatch size ({c.microbatch_size}) must be >= 1")


def check_pinned(p: Pinned, num_units: int, num_devices: int) -> None:
    """A PlanError (one line, naming `p.source`) unless `p` is a split of `num_units` units that its schedule runs
    on its layout's `num_devices` devices: what `evaluate_pinned` checks, for callers that check before planning."""
    _check(p, num_units)
    layout = p.candidate.layout
    try:
        layout.check_devices(num_devices)
    except LayoutError as exc:
        raise PlanError(f"{p.source}: {exc}; plan for {layout.world} devices") from None


def evaluate_pinned(profile: Profile, cluster: Cluster, pinned: Pinned, frees_outputs: bool = False,
                    overlap: Overlap | None = None) -> Plan:
    """The Plan of exactly `pinned` on `cluster` (all of its devices), with the simulator's figures and the
    baselines beside it, as `make_plan` builds its own: nothing is searched or replaced. A configuration that does
    not fit the devices' memory is still returned; its notes say which rank overflows and by how much. A stage
    policy whose figures the profile lacks at the layout (selective recomputation without them, e.g. at a tp whose
    rows do not count it) is judged as keeping its activations, and a note says so. `frees_outputs`: its trainer
    frees each stage's outputs once sent (`PlanRequest.frees_outputs`: a Megatron-LM configuration); `overlap`: the
    collectives assumed hidden (None: the default for the devices), with the configuration's own `ep_a2a`."""
    check_pinned(pinned, profile.num_units, cluster.num_devices)
    c, lacking = pinned.candidate, list[str]()
    for _ in range(2):  # once more when a policy is not offered: the request names the policies the stages use
        request = PlanRequest(cluster=cluster, global_batch=c.microbatches * c.microbatch_size * c.layout.dp,
                              num_microbatches=c.microbatches, schedule=c.schedule,
                              pins=LayoutPins.of(c.layout), tp_across_nodes=True,
                              activations=(max(c.activations, key=lambda x: policy(x).saving),),
                              frees_outputs=frees_outputs)
        request = replace(request, overlap=replace(overlap or request.assumed_overlap, ep_a2a=pinned.ep_a2a))
        views = Views(profile, request)
        a, view = views.arrays(c.microbatch_size, c.layout), views.request(c.layout)
        host = view.cluster.host_bandwidth
        lacking = sorted({x.value for x in c.activations if not policy(x).offered(a, host)}) or lacking
        c = replace(c, activations=tuple(x if policy(x).offered(a, host) else Activation.KEEP for x in c.activations))
    verdict = judge(a, view.cluster, c)
    notes = [f"configuration pinned from {pinned.source}: evaluated as given, not searched",
             *[f"activation policy {x} evaluated as keep: the profile has no figures for it at "
               f"{c.layout.describe()}, so its stages are judged keeping every activation" for x in lacking],
             *_warnings(profile, view.cluster, verdict)]
    return plan_from_verdict(profile, view, verdict, a, extra=tuple(notes), keep_split=True,
                             whole=views.whole(c.microbatch_size))


def _warnings(profile: Profile, cluster: Cluster, verdict: Verdict) -> list[str]:
    """A note per rank whose peak overflows its device, and per stage the runner would refuse to run."""
    c = verdict.candidate
    notes = [f"does not fit: rank {r} peaks at {format_size(peak)} > {format_size(cluster.device(r).memory_bytes)} of "
             "its device"
             for r, peak in enumerate(verdict.peak_memory) if peak > cluster.device(r).memory_bytes]
    if describe(c.schedule).splits_backward:
        notes += [f"does not run ({c.schedule.value}): {weight_only_reason(s, name)}"
                  for s, name in weight_only_sends(profile.meta.live_values, c.bounds)]
    return notes


def _split_configs(request: PlanRequest, num_units: int, starts: tuple[int, ...],
                   degrees: tuple[Group, ...] = (Group(1, 1),)) -> list[Config]:
    """The request's configurations with one stage per piece of `starts`; a PlanError naming --split unless the
    starts are increasing unit indices in 1..num_units-1 and some configuration has that many stages."""
    text = ",".join(map(str, starts))
    _check_order(starts)
    if any(s < 1 or s > num_units - 1 for s in starts):
        raise PlanError(f"`split` {text}: stages begin at unit indices 1..{num_units - 1} (the model has "
                        f"{num_units} units)")
    stages = request.recompute_stages or ()
    if any(s > len(starts) for s in stages):
        raise PlanError(f"`recompute_stages` {','.join(map(str, stages))}: `split` {text} has stages "
                        f"0..{len(starts)}")
    every = configs(request, num_units, degrees)  # the pin checked first: configs keeps only its stage counts
    mine = [c for c in every if c.layout.stages == len(starts) + 1]
    if not mine:
        counts = sorted({c.layout.stages for c in every})
        allowed = " or ".join(str(n - 1) for n in counts)
        raise PlanError(f"`split` {text} gives {len(starts) + 1} stages, but this request's configurations have "
                        f"{' or '.join(map(str, counts)) or 'none'} (pp x stages per rank): give {allowed or 'no'} "
                        "start indices (one fewer than the stages)")
    return mine


def _check_order(starts: tuple[int, ...]) -> None:
    text = ",".join(map(str, starts))
    if not starts or any(x >= y for x, y in zip(starts, starts[1:])):
        raise PlanError(f"`split` {text}: unit indices must increase (each is where the next stage begins)")


def check_split(request: PlanRequest, profile: Profile | None, starts: tuple[int, ...]) -> None:
    """What `plan_split` checks, for the CLI to call before any work: with `profile` None (the model is not
    profiled yet) only that the starts increase."""
    if profile is None:
        _check_order(starts)
    else:
        _split_configs(request, profile.num_units, starts, Views(profile, request).degrees())


def _judged(views: Views, c: Config, bounds: tuple[tuple[int, int], ...]) -> Verdict:
    """The split on configuration `c`, with the pinned activation policies or those the request's mode chooses."""
    cand = c.candidate(bounds, (Activation.KEEP,) * len(bounds))
    view = views.request(c.layout)
    a = views.arrays(c.b, c.layout)
    return judge_recompute(a, view.cluster, cand, view.ladder(a), view.pinned_activations(len(bounds)))


def plan_split(profile: Profile, request: PlanRequest, starts: tuple[int, ...]) -> Plan:
    """The Plan of the split whose stages 1.. begin at units `starts` (--split), judged by the simulator on every
    configuration of `request` with that many stages: the fastest that fits (else the fastest, with a note per
    overflowing rank), with autopp's own plan for the request beside the baselines as "autopp"."""
    views = Views(profile, request)
    configs_ = _split_configs(request, profile.num_units, starts, views.degrees())
    ends = (0, *starts, profile.num_units)
    bounds = tuple(zip(ends, ends[1:]))
    verdicts = [_judged(views, c, bounds) for c in configs_]
    best = min(verdicts, key=lambda v: (not v.fits, v.key))
    c = best.candidate
    view = views.request(c.layout)
    notes = (SPLIT_NOTE, *_warnings(profile, view.cluster, best))
    plan = plan_from_verdict(profile, view, best, views.arrays(c.microbatch_size, c.layout), extra=notes,
                             keep_split=True, whole=views.whole(c.microbatch_size))
    try:
        own = make_plan(profile, replace(request, recompute_stages=None))
    except InfeasibleError as exc:
        return replace(plan, notes=(*plan.notes, f"autopp finds no plan for this request: {exc}"))
    stages = " | ".join(f"{i}-{j - 1}" for i, j in (st.units for st in own.stages))
    said = (f"the row 'autopp' is autopp's own plan for this request: {own.schedule.value}, "
            f"{own.layout.describe(' x ')}, {own.num_microbatches} microbatches of {own.microbatch_size}, stages "
            f"{stages}, activations {', '.join(sorted({st.activation.value for st in own.stages}))}")
    return replace(plan, baselines={**plan.baselines, "autopp": own.predicted}, notes=(*plan.notes, said))
