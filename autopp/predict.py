"""Simulate a plan exactly as written: its stage costs, its schedule's (or custom) order, its placement. No torch."""

from __future__ import annotations

from .errors import PlanError
from .data.plan import Plan
from .schedule import Action, SimResult, StageCost, describe, simulate
from .schedule.seqpipe import chunked_order, simulate_units

__all__ = ["plan_order", "plan_stage_costs", "simulate_plan"]


def plan_stage_costs(plan: Plan) -> list[StageCost]:
    """The simulator's costs of each stage (`StagePlan.cost`)."""
    return [s.cost() for s in plan.stages]


def plan_order(plan: Plan) -> dict[int, list[Action]]:
    """Each pipeline rank's compute actions: the named schedule's, or the order the plan gives (custom)."""
    d = describe(plan.schedule)
    if plan.seq_chunks is not None:
        return chunked_order(plan.layout.pp, plan.num_microbatches, len(plan.seq_chunks.lengths))
    if not d.given_order:
        return d.build(plan.layout.pp, plan.num_microbatches, plan.layout.v)
    if len(plan.custom_order) != plan.layout.pp:
        raise PlanError(f"{plan.schedule.value} schedule has orders for {len(plan.custom_order)} ranks but pp is "
                        f"{plan.layout.pp}")
    return {r: list(row) for r, row in enumerate(plan.custom_order)}


def simulate_plan(plan: Plan) -> SimResult:
    """The timed, memory-aware simulation of one pipeline replica of `plan` (the all-reduce is not drawn); a
    sequence-chunked plan's as its units (`seqpipe.simulate_units`)."""
    if plan.seq_chunks is not None:
        return simulate_units(plan_stage_costs(plan), [s.send_s for s in plan.stages[:-1]], plan.num_microbatches,
                              plan.seq_chunks, [s.progress_s for s in plan.stages[:-1]])
    return simulate(plan_order(plan), plan_stage_costs(plan), [s.rank for s in plan.stages],
                    [s.send_s for s in plan.stages[:-1]], [s.activation for s in plan.stages],
                    [s.progress_s for s in plan.stages[:-1]], plan.pairing,
                    describe(plan.schedule).mirror(plan.num_microbatches))
