"""Rules the runner enforces that depend on the model, checked when planning, so that every plan offered runs.

The schedule sizes (microbatches vs stages, rounds) and the stage placement are the schedule descriptors' own
(`autopp.schedule.validate`, `stage_to_rank`), which both the planner and the runner use. What depends on the model
is the split I/W backward of the zero-bubble schedules (and of synthesized orders): torch's input pass drops the
gradient of a stage output made from the stage's parameters alone, so the runner refuses a stage after the first
that sends one on (`autopp.run.pipeline.check_split_backward`; measured on T5: 88 % off, or a failure). From the
profile's live values (`needs_grad`, `reads`) the planner finds those outputs for a split without running torch.
Weights tied between stages are summed across ranks on whole tensors only, so the runner refuses them with tensor
parallelism or ZeRO (`autopp.run.worker`); `parallel_refusal` leaves those configurations out.
What the runner refuses of a plan's layout alone is `autopp.runner_rules`.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from ...data.layout import Layout, LayoutPins, uses_mesh
from ...data.zero import ZeroStage
from ...errors import LayoutError
from ...data.profile import LiveValue, TiedGroup, ValueAction
from ...schedule import ScheduleName, describe, listed
from ..partition.dp import Bounds

__all__ = ["weight_only_sends", "weight_only_reason", "split_backward_refusal", "schedule_refusal",
           "PARALLEL_KEY", "parallel_refusal", "tied_across_note", "mirror_refusal", "runs_beside", "check_pinned_zero",
           "check_pinned_mirror", "check_pinned_v", "check_zero_has_replicas"]

#: The key of `parallel_refusal`'s reasons among a search's exclusions (the others are schedule names).
PARALLEL_KEY = "tensor parallelism or ZeRO"


def weight_only_sends(live_values: Sequence[LiveValue], bounds: Bounds) -> list[tuple[int, str]]:
    """(stage, value name) for each value that a stage after the first (and before the last) passes on and that it
    makes from its parameters only: the value needs a gradient, and every value it is made from that needs one is
    made inside the same stage, from its parameters only too. Profiles without `needs_grad` find none."""
    by_name = {v.name: v for v in live_values}
    found = []
    for s, (first, end) in enumerate(bounds):
        if s == 0 or s == len(bounds) - 1:
            continue
        memo: dict[str, bool] = {}
        for v in live_values:
            sent = first <= v.src < end and max(v.dsts) >= end
            if sent and v.action is not ValueAction.RECOMPUTE and _weight_only(v, first, by_name, memo):
                found.append((s, v.name))
    return found


def _weight_only(v: LiveValue, first: int, by_name: Mapping[str, LiveValue], memo: dict[str, bool]) -> bool:
    if v.name not in memo:
        memo[v.name] = False  # a cycle cannot occur in a graph; this only guards the recursion
        # a value read whose profile predates `needs_grad` (None) is taken to need a gradient
        reads = [by_name[r] for r in v.reads or () if r in by_name and by_name[r].needs_grad is not False]
        memo[v.name] = bool(v.needs_grad) and all(
            r.src >= first and _weight_only(r, first, by_name, memo) for r in reads)
    return memo[v.name]


def weight_only_reason(stage: int, name: str) -> str:
    """Why the runner refuses split I/W backward for a stage that sends on `name`, made from its parameters only (the
    one wording of the planner's exclusions and of a pinned configuration's notes)."""
    return (f"stage {stage} sends on {name!r}, made from its parameters only, whose gradient torch's split I/W "
            "backward drops (the runner refuses it)")


def split_backward_refusal(live_values: Sequence[LiveValue], bounds: Bounds, what: str) -> str | None:
    """Why the runner would refuse `what` (a schedule or order with split I/W backward) on this split, or None."""
    sends = weight_only_sends(live_values, bounds)
    if not sends:
        return None
    return (f"{what} excluded: with its split, {weight_only_reason(*sends[0])}; schedules with full backwards "
            f"({listed(lambda d: not d.splits_backward)}) run it")


def schedule_refusal(live_values: Sequence[LiveValue], schedule: ScheduleName, bounds: Bounds) -> str | None:
    """`split_backward_refusal` for a named schedule: None for schedules with full backwards, which run any split."""
    if not describe(schedule).splits_backward:
        return None
    return split_backward_refusal(live_values, bounds, schedule.value)


def parallel_refusal(tied: Sequence[TiedGroup], layout: Layout, bounds: Bounds) -> str | None:
    """Why the runner would refuse `layout`'s tensor parallelism or ZeRO on this split (a weight tied between two of
    its stages), or None."""
    found = _mesh_tie(tied, layout, bounds)
    return None if found is None else (
        f"{PARALLEL_KEY} excluded where {found[0]} two stages ({found[1]}): the runner sums tied weights only on "
        "whole tensors; plan with `tp` 1 and `zero` 0, or untie the weight")


def tied_across_note(tied: Sequence[TiedGroup], layout: Layout, bounds: Bounds) -> str | None:
    """What a plan made with `PlanRequest.tied_across_stages` leaves to its trainer where `layout`'s tensor
    parallelism or ZeRO meets a weight tied between two of its stages (`parallel_refusal`'s case), or None."""
    found = _mesh_tie(tied, layout, bounds)
    return None if found is None else (
        f"{found[0]} two stages ({found[1]}) under {PARALLEL_KEY} (`tied_across_stages`): planned for a trainer "
        "that sums its shards between them, as Megatron does its embedding group (that sum is not costed); autopp "
        "run refuses the plan: it sums tied weights on whole tensors only")


def _mesh_tie(tied: Sequence[TiedGroup], layout: Layout, bounds: Bounds) -> tuple[str, str] | None:
    """With `layout`'s mesh (tp, cp or ZeRO), the first weight tied between two stages of `bounds` in words
    ("'w', tied between units [0, 5], lands in") and those stages ("0 and 1"); else None."""
    split = _split_tie(tied, bounds) if uses_mesh(layout) else None
    if split is None:
        return None
    group, stages = split
    return f"{group.names[0]!r}, tied between units {list(group.units)}, lands in", f"{stages[0]} and {stages[1]}"


def _split_tie(tied: Sequence[TiedGroup], bounds: Bounds) -> tuple[TiedGroup, list[int]] | None:
    """The first tied group whose units land in more than one stage of `bounds`, with those stages; else None."""
    for group in tied:
        stages = sorted({s for s, (i, j) in enumerate(bounds) for u in group.units if i <= u < j})
        if len(stages) > 1:
            return group, stages
    return None


def mirror_refusal(tied: Sequence[TiedGroup], schedule: ScheduleName, layout: Layout, bounds: Bounds) -> str | None:
    """Why the runner would refuse Chimera's two replicas per rank on this split (autopp.run.bidirectional: no weight
    tied between two stages), or None (also for every other schedule). Its pipeline-only rule (no dp, tp or ZeRO)
    is `request.configs`'s."""
    split = _split_tie(tied, bounds) if describe(schedule).mirrored else None
    if split is None:
        return None
    group, stages = split
    return (f"{schedule.value} excluded where {group.names[0]!r}, tied between units {list(group.units)}, "
            f"lands in two stages ({stages[0]} and {stages[1]}): the runner does not sum tied weights "
            f"across its two replicas")


def runs_beside(schedule: ScheduleName, layout: Layout) -> bool:
    """Whether the runner runs `schedule` on `layout` whatever the model: Chimera's two pipelines on pipeline ranks
    alone (autopp.run.bidirectional), a split I/W backward only beside a ZeRO stage without a
    `split_backward_refusal` (`request.configs` keeps these)."""
    d = describe(schedule)
    return (not d.mirrored or (layout.dp == 1 and not uses_mesh(layout))) and not (
        d.splits_backward and layout.zero.split_backward_refusal)


def check_pinned_v(schedule: ScheduleName | None, v: int | None) -> None:
    """A LayoutError for a pinned `v` that a pinned schedule does not run: one stage per rank, or a fixed count that
    is another (a tester's ZBVZeroBubble with `v` 3 ran 2, silently). A searched schedule keeps only the schedules
    that run it (`Descriptor.v_choices`)."""
    fixed = describe(schedule).fixed_v if schedule is not None else None
    if schedule is None or v is None or fixed in (None, v):
        return
    free = listed(lambda d: d.fixed_v is None and not d.given_order)
    if fixed == 1:
        raise LayoutError(f"{schedule.value} runs one stage per rank, so `v` {v} does not apply; use {free} or "
                          "search `schedule`")
    raise LayoutError(f"{schedule.value} runs exactly {fixed} stages per rank, so `v` {v} does not apply: give `v` "
                      f"{fixed}, drop `v`, or use {free}")


def check_zero_has_replicas(pins: LayoutPins, devices: int) -> None:
    """A LayoutError for a pinned sharding ZeRO stage whose other pinned degrees leave every device busy (dp and cp
    1): with dp searched the search would find nothing (a tester's `--pp 2 --zero 3` on 2 devices, which had come out
    as dp 1 without ZeRO); `dp` pinned 1 says the same in `Layout`'s check."""
    zero = pins.zero
    if zero is None or zero.replicated or pins.dp is not None:
        return
    taken = math.prod(d for d in (pins.pp, pins.tp, pins.cp) if d is not None)
    if devices // taken == 1 and (pins.cp or 1) == 1:
        raise LayoutError(f"{zero} shards over data-parallel replicas, and {devices} devices with `pp` {pins.pp or 1}"
                          f"{f' and `tp` {pins.tp}' if (pins.tp or 1) > 1 else ''} leave dp 1: give more devices, a "
                          "smaller `pp`, or `zero` 0")


def check_pinned_zero(schedule: ScheduleName | None, zero: ZeroStage | None) -> None:
    """A LayoutError for a pinned schedule with a split I/W backward beside a pinned ZeRO stage that refuses it."""
    if schedule is not None and describe(schedule).splits_backward and zero and zero.split_backward_refusal:
        full = listed(lambda d: not (d.splits_backward or d.given_order or d.mirrored))
        raise LayoutError(f"`zero` {zero.stage} with {schedule.value}: {zero.split_backward_refusal}; plan with "
                          f"`zero` 1, or one of {full}")


def check_pinned_mirror(schedule: ScheduleName | None, pins: LayoutPins) -> None:
    """A LayoutError for a pinned bidirectional schedule (Chimera) beside a pinned axis `runs_beside` leaves it out:
    its two pipelines run on pipeline ranks alone (autopp.run.bidirectional), with no data-parallel replicas, no
    group inside a rank and no ZeRO (a tester's `--pp 4 --dp 2 --schedule Chimera` was told its ranks' links
    differ)."""
    if schedule is None or not describe(schedule).mirrored:
        return
    pinned = [f"`{axis}` {value}" for axis, value in (("dp", pins.dp), ("cp", pins.cp), ("tp", pins.tp),
                                                      ("ep", pins.ep)) if value not in (None, 1)]
    pinned += [f"`zero` {pins.zero.stage}"] if pins.zero is not None and not pins.zero.replicated else []
    if pinned:
        raise LayoutError(f"{schedule.value} runs its two pipelines on pipeline ranks alone (dp 1, no cp, tp, ep "
                          f"or ZeRO: autopp's bidirectional runner), and {' and '.join(pinned)} "
                          f"{'is' if len(pinned) == 1 else 'are'} asked for: give `dp` 1 and leave the others at 1 "
                          "(every device a pipeline rank), or use another `schedule`")

