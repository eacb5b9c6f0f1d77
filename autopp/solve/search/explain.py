"""Why a request is infeasible, and what would make it feasible: memory, devices, recomputation, microbatches."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import NamedTuple

from ...costmodel import ProfileTable, stage_costs
from ...data.profile import Profile
from ...data.trainers import TRAINER_RULES, refusal
from ...errors import InfeasibleError, ProfileError, ScheduleError
from ...schedule import NAMED, Activation, ScheduleName, describe, listed, policy, stage_to_rank, tally
from ...schedule.effects import order_peaks
from ...sizes import format_size, size_argument
from ..partition.dp import min_memory, pipeline_bounds

from .judge import named_order
from .request import Config, PlanRequest, RecomputeMode, configs, microbatch_counts, replica_counts
from .search import pipe_spec, search
from .views import Views

__all__ = ["explain_infeasible", "smallest_memory"]


def _no_config(profile: Profile, req: PlanRequest, tp: int = 1) -> InfeasibleError:
    """Which rule left no configuration (units per stage, global batch over replicas and microbatches, the
    schedule's microbatch rule), with the numbers and what would work; `req` a tensor-parallel degree's view
    (`tp` devices per pipeline rank), whose counts are multiplied back into devices."""
    n = profile.num_units
    restricted = _trainer_refusal(req, n) or _missing_stage(req, n)
    if restricted is not None:
        return restricted
    names = [req.schedule] if req.schedule else [s for s in NAMED if req.trainer is None or
                                                  s in TRAINER_RULES[req.trainer].schedules]
    dps = replica_counts(req)
    pps = [req.cluster.num_devices // dp for dp in dps]
    v = min(describe(name).stages_per_rank(x) for name in names for x in describe(name).v_choices(req.pins.v))
    if min(pps) * v > n:
        return _too_few_units(profile, req, names, min(pps), v, tp)
    if max(pps) == 1 and v > 1:
        return _looped_single_rank(req, names[0], v, dps[0], tp)
    if all(describe(name).mirrored for name in names):
        return _no_mirror(req, names[0], pps, tp)
    ep = (req.pins.ep or 1) * (req.pins.etp or 1)
    if ep > 1 and dps and not any(dp % ep == 0 for dp in dps):  # a tester was told the global batch was the reason
        which = "`ep`" if ep == (req.pins.ep or 1) else "`ep` x `etp`"
        return InfeasibleError(f"{which} {ep} is carved from a stage's data-parallel ranks and divides none of the dp "
                               f"degrees {sorted(set(dps))} the {req.cluster.num_devices * tp} devices leave: give a "
                               f"`pp` that leaves a dp {ep} divides, or a smaller `ep`")
    counts = [m for dp in dps for m in microbatch_counts(req, dp)]
    if not counts:
        per = f"{req.num_microbatches} microbatches" if req.num_microbatches else "microbatches"
        return InfeasibleError(f"global batch {req.global_batch} cannot be split over dp={dps[0]} replicas into "
                               f"{per}: use a global batch divisible by dp x microbatches "
                               f"({dps[0] * (req.num_microbatches or 1)})")
    failed, valid = [], False  # a schedule's complaint is the reason only when every schedule asked for has one
    for name in names:
        for x in describe(name).v_choices(req.pins.v):
            try:
                describe(name).validate(min(pps), max(counts), x)
                valid = True
            except ScheduleError as exc:
                failed.append(str(exc))
    if failed and not valid:
        need = _fewest_microbatches(names, req, min(pps))
        more = (_nearest_microbatches(names, req, min(pps), req.num_microbatches) if req.num_microbatches is not None
                else f"a global batch of at least {need * dps[-1]} (it is {req.global_batch})")
        return InfeasibleError(f"{failed[0]}: use {more}, fewer devices, or another `schedule`")
    which = names[0].value if len(names) == 1 else "any schedule"
    g = req.global_batch  # the next few batches, then multiples: a bounded number of tries on any cluster
    tries = sorted({*range(g + 1, g + 64), *(g * k for k in range(2, 65))})  # the pinned microbatches divide it
    batch = next((b for b in tries if b % (req.num_microbatches or 1) == 0 and configs(replace(req, global_batch=b),
                                                                                         n)), None)
    hint = f": a global batch of {batch} has one" if batch else ""
    return InfeasibleError(f"no valid configuration for {which} on {req.cluster.num_devices * tp} devices "
                           f"({n} units, global batch {req.global_batch}, microbatch counts {sorted(set(counts))}: "
                           f"the global batch does not split into dp replicas x enough microbatches for the "
                           f"schedule's stages){hint}")


def _missing_stage(req: PlanRequest, n: int) -> InfeasibleError | None:
    """Why no configuration is left where `recompute_stages` names a stage past the last of every configuration it
    would have without the pin (`configs` offers only those with the pinned stages); None where the pin is not why."""
    if req.recompute_stages is None:
        return None
    counts = sorted({c.layout.stages for c in configs(replace(req, recompute_stages=None), n)})
    if not counts:
        return None
    said = " or ".join(map(str, counts))
    return InfeasibleError(f"`recompute_stages` {','.join(map(str, req.recompute_stages))}: the configurations "
                           f"searched have {said} stages, none a stage {max(req.recompute_stages)}; pin stages "
                           f"below {counts[-1]}")


def _trainer_refusal(req: PlanRequest, n: int) -> InfeasibleError | None:
    """Why no configuration is left where the request's `trainer` refuses every one it would have without it
    (autopp.data.trainers) among those of its schedules, with the reason most of them share; None where the trainer
    is not why (its schedules have no configuration either: `_no_config` says why, for them)."""
    if req.trainer is None:
        return None
    rules = TRAINER_RULES[req.trainer]
    free = [c for c in configs(replace(req, trainer=None), n) if c.schedule in rules.schedules]
    whys = [refusal(rules, c.schedule, c.layout, c.m) for c in free]
    if not free or None in whys:
        return None
    why, count = Counter(whys).most_common(1)[0]
    share = "" if count == len(free) else f"{count} of them: "
    return InfeasibleError(f"`trainer` {req.trainer} runs none of the {len(free)} configuration"
                           f"{'s' if len(free) > 1 else ''} the request leaves ({share}{why})")


def _no_mirror(req: PlanRequest, name: ScheduleName, pps: list[int], tp: int) -> InfeasibleError:
    """Why Chimera has no configuration: an odd pipeline, no even microbatch count, or rank r and rank pp - 1 - r
    that differ (`Cluster.mirror_symmetric`)."""
    if all(pp % 2 for pp in pps):
        return InfeasibleError(f"{name.value} needs an even number of pipeline ranks ({min(pps)} % 2 = 1): use an "
                               f"even `pp` or number of `devices`, or another `schedule`")
    counts = sorted({m for dp in replica_counts(req) for m in microbatch_counts(req, dp)})
    if not any(m % 2 == 0 for m in counts):
        return InfeasibleError(f"{name.value} needs an even number of microbatches, half per direction (global "
                               f"batch {req.global_batch} gives {counts}): use an even `global_batch` or "
                               f"`num_microbatches`")
    return InfeasibleError(f"{name.value} needs rank r and rank pp - 1 - r to have the same device and links (its "
                           f"two replicas of a stage run alike), which these {req.cluster.num_devices * tp} devices "
                           f"do not: use another `schedule`")


def _looped_single_rank(req: PlanRequest, name: ScheduleName, v: int, dp: int, tp: int) -> InfeasibleError:
    """A schedule of several stages per rank on one pipeline rank, which the search does not offer: no trainer runs
    it (Megatron-Core's parallel_state: "pipeline-model-parallel size should be greater than 1 with interleaved
    schedule"), and it beats one stage only through per-stage activation policies, which a single stage could apply
    per layer (issue 26: Llama-3-8B on 16 H100, dp 16: Interleaved1F1B v 4 at 4412 ms against 1F1B at 4765 ms,
    by offloading its first stage's activations alone)."""
    fix = "a smaller `dp`" if dp > 1 else "more `devices`"
    return InfeasibleError(f"{name.value} runs {v} stages per rank, which needs 2 pipeline ranks or more, and "
                           f"`dp` {dp} on {req.cluster.num_devices * tp} devices leaves 1: use {fix}, or a "
                           f"`schedule` of 1 stage per rank")


def _accepts(names: list[ScheduleName], req: PlanRequest, pp: int, m: int) -> bool:
    """Whether one of the schedules runs `m` microbatches per replica on `pp` ranks (with a v it allows)."""
    for name in names:
        for x in describe(name).v_choices(req.pins.v):
            try:
                describe(name).validate(pp, m, x)
                return True
            except ScheduleError:
                pass
    return False


def _fewest_microbatches(names: list[ScheduleName], req: PlanRequest, pp: int) -> int:
    """The fewest microbatches per replica that one of the schedules accepts on `pp` ranks."""
    return next((m for m in range(1, 8 * pp + 1) if _accepts(names, req, pp, m)), pp)


def _nearest_microbatches(names: list[ScheduleName], req: PlanRequest, pp: int, pinned: int) -> str:
    """The microbatch counts nearest the pinned one, below and above, that one of the schedules accepts on `pp`
    ranks (a tester was told "1 or more" of 9 where 8 or 10 work)."""
    below = next((m for m in range(pinned - 1, 0, -1) if _accepts(names, req, pp, m)), None)
    above = next((m for m in range(pinned + 1, 8 * (pinned + pp)) if _accepts(names, req, pp, m)), None)
    if above is not None and below is None and _accepts(names, req, pp, above + 1):
        return f"`num_microbatches` {above} or more"  # nothing fewer works: a floor
    found = [str(m) for m in (below, above) if m is not None]
    return f"`num_microbatches` {' or '.join(found)}" if found else "another `num_microbatches`"


def _too_few_units(profile: Profile, req: PlanRequest, names: list[ScheduleName], pp: int, v: int,
                   tp: int = 1) -> InfeasibleError:
    """Fewer units than the stages asked for: fewer devices, a schedule with fewer stages per rank, finer units."""
    n = profile.num_units
    which = f" ({names[0].value} runs {v} stages per rank)" if v > 1 and len(names) == 1 else ""
    hint = "" if req.pins.dp is None else "; or search `dp` to use the rest for data parallelism"
    single = (f"; or a schedule with one stage per rank (`schedule` {listed(lambda d: d.single_stage, ' or ')})"
              if v > 1 and pp <= n else "")
    example = next((p for p in profile.meta.split_points if p), "")
    finer = (f"; or finer units: SPLIT_POINTS in the model file may also name modules inside a block "
             f"(e.g. `{example}.<child>`, see model.named_modules())" if example else
             "; or finer units: add SPLIT_POINTS to the model file")
    if profile.meta.extra.get("hf_config"):  # no model file of the user's to add them to (a tester)
        finer = ("; or finer units: an HF config's units are its layers, so a model file that builds the model and "
                 "names SPLIT_POINTS inside them (README, the model file contract)")
    return InfeasibleError(f"cannot split {n} units into {pp * v} stages{which}: use at most {n // v * tp} devices"
                           f"{hint}{single}{finer}")


class _Lightest(NamedTuple):
    """The configuration whose split needs the least memory per device in the DP's count, and that memory."""

    need: int
    microbatches: int
    config: Config
    activation: Activation


def _lightest(profile: Profile, req: PlanRequest, activation: Activation, views: Views) -> _Lightest | None:
    best: _Lightest | None = None
    seen: set[tuple[object, ...]] = set()
    for c in configs(req, profile.num_units, views.degrees()):
        spec = pipe_spec(views.request(c.layout), c, activation)
        key = (c.b, c.layout.unit_view(), spec.num_stages, spec.inflight, c.layout.v)
        if key in seen:
            continue
        seen.add(key)
        need = min_memory(views.arrays(c.b, c.layout), replace(spec, memory=())) * _share(c)
        if best is None or (need, c.m) < best[:2]:
            best = _Lightest(need, c.m, c, activation)
    return best


def _share(c: Config) -> int:
    """Stages per device: v, twice as many for Chimera (two replicas per device)."""
    return c.layout.v * (2 if describe(c.schedule).mirrored else 1)


def smallest_memory(profile: Profile, req: PlanRequest, activation: Activation = Activation.KEEP
                    ) -> tuple[int, int] | None:
    """(bytes per device, microbatches) of the least memory any configuration of the request needs in the split's
    count (the DP's: `min_memory`), every stage under `activation`."""
    found = _lightest(profile, req, activation, Views(profile, req))
    return None if found is None else (found.need, found.microbatches)


def order_peak(views: Views, light: _Lightest) -> int:
    """The most bytes a device of `light`'s configuration holds when its schedule's order is walked (the simulator's
    peak without timing, `order_peaks`) on the DP's split at `light.need`. Above `light.need` where the DP's count
    is a relaxation: under recomputation the DP charges each stage one microbatch's activations and no kept input,
    while an order that splits the backward (ZBV, DualPipeV) holds a microbatch's recomputed activations from its
    I to its W, queued behind other microbatches' I's, and every microbatch in flight keeps its stage input."""
    c, rc = light.config, light.activation
    req, a = views.request(c.layout), views.arrays(c.b, c.layout)
    spec = pipe_spec(req, c, rc)
    bounds = pipeline_bounds(a, replace(spec, memory=(light.need / _share(c),) * spec.num_stages))
    if bounds is None:  # the floor is found on the DP's own tables: not expected
        return light.need
    owner = stage_to_rank(c.schedule, c.layout.pp, c.layout.v)
    costs = stage_costs(a, bounds, [1.0] * len(owner))
    order = named_order(c.schedule, c.layout.pp, c.m, c.layout.v)
    return max(order_peaks(order, costs, owner, (rc,) * len(bounds), describe(c.schedule).mirrored))


def _more_devices(profile: Profile, req: PlanRequest) -> int | None:
    """The fewest pipeline devices (more than now, dp unchanged) for which some split fits the memory."""
    dp = req.pins.dp or 1
    if req.pins.tp != 1 or req.pins.zero is None or not req.pins.zero.replicated:  # on pipeline x dp only
        return None
    for pp in range(req.cluster.num_devices // dp + 1, profile.num_units + 1):
        cluster = replace(req.cluster, num_devices=pp * dp, devices=(), links=(), nodes=None, grid=None)
        if not req.cluster.homogeneous:
            return None
        trial = replace(req, cluster=cluster, pins=replace(req.pins, pp=None, dp=dp), shortlist=1)
        need = smallest_memory(profile, trial)
        if need is not None and need[0] <= req.cluster.memory_bytes and search(profile, trial)[0] is not None:
            return pp * dp
    return None


def _policy_alternative(profile: Profile, req: PlanRequest) -> list[str]:
    """`recompute` auto where it fits: with a `trainer`, which applies one activation policy to every stage (a
    tester: `--for megatron` was told "stages: 4 keep, 4 offload", which Megatron-LM cannot run), the policy saving
    least that fits on every stage."""
    if req.trainer is None:
        found = search(profile, replace(req, recompute=RecomputeMode.AUTO, activations=None, shortlist=1))[0]
        return [] if found is None else [f"`recompute` auto fits (stages: {tally(found.candidate.activations)})"]
    rules = TRAINER_RULES[req.trainer]
    for a in (x for x in RecomputeMode.AUTO.policies() if policy(x).refusal(req.trainer) is None):
        try:
            uniform = search(profile, replace(req, recompute=RecomputeMode.NONE, activations=(a,), shortlist=1))[0]
        except ProfileError:  # no figures for the policy in this profile
            continue
        if uniform is not None:
            return [f"`recompute` auto fits (every stage {a.value}, as {rules.title} applies one policy to all)"]
    return []


def _alternatives(profile: Profile, req: PlanRequest) -> list[str]:
    out = []
    if (req.recompute is not RecomputeMode.AUTO or req.activations is not None) and req.recompute_stages is None:
        out += _policy_alternative(profile, req)
    if req.num_microbatches is not None:
        found = search(profile, replace(req, num_microbatches=None, shortlist=1))[0]
        if found is not None:
            out.append(f"`num_microbatches` {found.candidate.microbatches} (microbatches of "
                       f"{found.candidate.microbatch_size}) fits")
    devices = _more_devices(profile, req)
    if devices is not None:
        out.append(f"{devices} devices fit")
    if req.pins.ep == 1 and int(profile.units.moe_layers.sum()) and \
            int((profile.meta.extra.get("moe") or {}).get("num_experts") or 1) > 1:  # a tester: DeepSeek-V3 said memory
        found = search(profile, replace(req, pins=replace(req.pins, ep=None), shortlist=1))[0]
        if found is not None:
            out.append(f"`ep` auto fits (ep {found.candidate.layout.ep}: each rank holds 1/ep of the experts)")
    return out


def explain_infeasible(profile: Profile, req: PlanRequest, num_configs: int) -> InfeasibleError:
    """An InfeasibleError whose message says what would make the request feasible."""
    if num_configs == 0:  # with a tensor-parallel degree, on its groups of devices (one pipeline rank each)
        tp = req.pins.tp or 1
        return _no_config(profile, req.view(tp), tp)
    ladder = req.ladder(ProfileTable(profile).arrays(profile.meta.microbatch_sizes[0]))
    views = Views(profile, req)
    needs = [_lightest(profile, req, rc, views) for rc in ladder]
    need = min((x for x in needs if x is not None), default=None, key=lambda x: (x.need, x.microbatches))
    head = (f"no split of {profile.num_units} units fits in {format_size(req.cluster.memory_bytes)} per device "
            f"on {req.cluster.num_devices} devices")
    if need is None:
        return InfeasibleError(head)
    text = f"{head}; {_memory_hint(profile, req, views, need)}"
    alternatives = _alternatives(profile, req)
    return InfeasibleError(text + ("; or: " + "; ".join(alternatives) if alternatives else ""))


def _memory_hint(profile: Profile, req: PlanRequest, views: Views, light: _Lightest) -> str:
    """What memory works: the order's peak on the DP's floor split (`order_peak`) where a plan fits there below the
    floor (the DP's count is conservative where a rank runs several stages); the DP's floor where the walk agrees
    with it; else that peak, said to work only where a plan is found at that memory, and otherwise said as what
    does not fit."""
    def works(need: int) -> str:
        more, reserve = max(0, need - req.cluster.memory_bytes), req.cluster.memory_reserve_bytes
        kept = (f" ({size_argument(need + reserve)} or more beside `memory_reserve` {size_argument(reserve)}, or "
                "a smaller reserve)") if reserve else ""
        mb = f"{light.microbatches} microbatch{'es' if light.microbatches != 1 else ''}"
        return (f"(with {mb}: {format_size(more)} more per device than given); use `memory_bytes` "
                f"{size_argument(need)} or more{kept}")

    peak = order_peak(views, light) if not req.cluster.devices else light.need
    if peak < light.need and search(profile, replace(req, cluster=replace(req.cluster, memory_bytes=peak),
                                                     shortlist=1))[0] is not None:  # the split's count over-asks
        return (f"a plan fits in {format_size(peak)}, its order's peak, where the split's count asks "
                f"{format_size(light.need)} {works(peak)}")
    if peak <= light.need:
        return f"the smallest that works is {format_size(light.need)} {works(light.need)}"
    c = light.config
    held = ("a split backward holds recomputed activations from I to W" if describe(c.schedule).splits_backward
            else "the order holds more than the split's count")
    order = (f"its split that needs least ({format_size(light.need)} per device in the split's count, "
             f"{light.activation.value}) peaks at {format_size(peak)} in {c.schedule.value}'s order (v {c.layout.v}; "
             f"{held})")
    for grown in (peak, *(int(peak * f) for f in _MORE_MEMORY)):  # a tester: 14.7 MiB did not fit, 15 MiB did
        trial = replace(req, cluster=replace(req.cluster, memory_bytes=grown), shortlist=1)
        if search(profile, trial)[0] is not None:
            return f"{order}, which works {works(grown)}" if grown == peak else \
                f"{order}, and no plan fits in {format_size(peak)}: use `memory_bytes` {size_argument(grown)} or " \
                "more (a plan fits there)"
    return f"{order}, and no plan fits in {format_size(peak)} nor in {_MORE_MEMORY[-1]:g} times it"


#: Memories tried above the order's peak, as factors of it, for the smallest that a plan fits in (`_memory_hint`).
_MORE_MEMORY = (1.02, 1.05, 1.1, 1.25, 1.5, 2.0)
