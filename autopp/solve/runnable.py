"""Rules the runner enforces that depend on the model, checked when planning, so that every plan offered runs.

The schedule sizes (microbatches vs stages, rounds) and the stage placement are the schedule descriptors' own
(`autopp.schedule.validate`, `stage_to_rank`), which both the planner and the runner use. What depends on the model
is the split I/W backward of the zero-bubble schedules (and of synthesized orders): torch's input pass drops the
gradient of a stage output made from the stage's parameters alone, so the runner refuses a stage after the first
that sends one on (`autopp.run.pipeline.check_split_backward`; measured on T5: 88 % off, or a failure). From the
profile's live values (`needs_grad`, `reads`) the planner finds those outputs for a split without running torch.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..schedule import SPLIT_BACKWARD, ScheduleName
from .dp import Bounds

__all__ = ["weight_only_sends", "weight_only_reason", "split_backward_refusal", "schedule_refusal"]


def weight_only_sends(live_values: Sequence[Mapping[str, Any]], bounds: Bounds) -> list[tuple[int, str]]:
    """(stage, value name) for each value that a stage after the first (and before the last) passes on and that it
    makes from its parameters only: the value needs a gradient, and every value it is made from that needs one is
    made inside the same stage, from its parameters only too. Profiles without `needs_grad` find none."""
    by_name = {str(v["name"]): v for v in live_values}
    found = []
    for s, (first, end) in enumerate(bounds):
        if s == 0 or s == len(bounds) - 1:
            continue
        memo: dict[str, bool] = {}
        for v in live_values:
            sent = first <= int(v["src"]) < end and max(int(d) for d in v["dsts"]) >= end
            if sent and v.get("action") != "recompute" and _weight_only(v, first, by_name, memo):
                found.append((s, str(v["name"])))
    return found


def _weight_only(v: Mapping[str, Any], first: int, by_name: Mapping[str, Mapping[str, Any]],
                 memo: dict[str, bool]) -> bool:
    name = str(v["name"])
    if name not in memo:
        memo[name] = False  # a cycle cannot occur in a graph; this only guards the recursion
        reads = [by_name[r] for r in v.get("reads", ()) if r in by_name and by_name[r].get("needs_grad", True)]
        memo[name] = bool(v.get("needs_grad", False)) and all(
            int(r["src"]) >= first and _weight_only(r, first, by_name, memo) for r in reads)
    return memo[name]


def weight_only_reason(stage: int, name: str) -> str:
    """Why the runner refuses split I/W backward for a stage that sends on `name`, made from its parameters only (the
    one wording of the planner's exclusions and of a pinned configuration's notes)."""
    return (f"stage {stage} sends on {name!r}, made from its parameters only, whose gradient torch's split I/W "
            "backward drops (the runner refuses it)")


def split_backward_refusal(live_values: Sequence[Mapping[str, Any]], bounds: Bounds, what: str) -> str | None:
    """Why the runner would refuse `what` (a schedule or order with split I/W backward) on this split, or None."""
    sends = weight_only_sends(live_values, bounds)
    if not sends:
        return None
    return (f"{what} excluded: with its split, {weight_only_reason(*sends[0])}; schedules with full backwards "
            "(1F1B, GPipe, Interleaved1F1B, LoopedBFS) run it")


def schedule_refusal(live_values: Sequence[Mapping[str, Any]], schedule: ScheduleName, bounds: Bounds) -> str | None:
    """`split_backward_refusal` for a named schedule: None for schedules with full backwards, which run any split."""
    if schedule not in SPLIT_BACKWARD:
        return None
    return split_backward_refusal(live_values, bounds, schedule.value)
