"""What every trainer export needs from a plan: stage order, per-stage units, one recompute policy, the batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from ..errors import ScheduleError
from ..data.plan import Plan
from ..schedule import DESCRIPTORS, Layout, describe
from .layers import ExportError

__all__ = ["Exported", "uniform_recompute", "stage_layout", "refuse_schedule"]


@dataclass(frozen=True)
class Exported:
    """The text of the main file, extra files beside it (suffix -> text), and notes for the user (stderr)."""

    text: str
    extra: dict[str, str]
    notes: tuple[str, ...] = ()


def uniform_recompute(plan: Plan, trainer: str, where: str) -> bool:
    """Whether every stage recomputes; an ExportError when only some do (the trainers apply one policy to all)."""
    flags = [s.recompute for s in plan.stages]
    if any(flags) and not all(flags):
        on = [s.index for s in plan.stages if s.recompute]
        raise ExportError(f"{where}: only stages {on} of {len(flags)} recompute; {trainer} applies one "
                          "activation-checkpointing policy to every stage; re-plan with --recompute all or none")
    return all(flags)


def stage_layout(plan: Plan) -> Layout | None:
    """The placement of the plan's stages: the layout of the first schedule that places them so, LOOP (stage s on
    rank s % pp) or V (zig-zag), or None for another one."""
    ranks = [s.rank for s in plan.stages]
    for d in DESCRIPTORS.values():
        if d.layout is Layout.GIVEN:
            continue
        try:
            if d.stage_to_rank(plan.pp, plan.virtual_stages) == ranks:
                return d.layout
        except ScheduleError:  # another stage count per rank than the plan's
            continue
    return None


def refuse_schedule(plan: Plan, trainer: str, runs: str, where: str) -> NoReturn:
    """An ExportError saying that `trainer` runs only `runs`, and what to re-plan with."""
    value = plan.schedule.value
    name = f"a synthesized order ({value})" if describe(plan.schedule).given_order else value
    raise ExportError(f"{where}: the plan's schedule is {name}, but {trainer} runs only {runs}; re-plan with "
                      f"--schedule {runs.split()[0]} (and no --synthesize) to export it")
