"""Schedules as data: action IR, one descriptor per schedule, and a timed, memory-aware simulator (torch- and
OR-Tools-free)."""

from autopp.schedule.actions import (
    COMPUTE_KINDS,
    Action,
    Kind,
    Order,
    format_grid,
    from_csv_rows,
    parse_action,
    parse_grid,
    to_csv_rows,
)
from autopp.schedule.activation import (POLICIES, Activation, ActivationPolicy, by_saving, chosen, order_key,
                                       parse_activation, policy, tally)
from autopp.schedule.descriptors import (
    DESCRIPTORS,
    NAMED,
    Descriptor,
    Floors,
    StagePlacement,
    ScheduleName,
    build_schedule,
    describe,
    listed,
    stage_to_rank,
    stages_per_rank,
    validate,
)
from autopp.schedule.draw import chrome_trace, draw_timeline, write_chrome_trace
from autopp.schedule.effects import StageCost
from autopp.schedule.sim_state import Event
from autopp.schedule.simulate import SimResult, resumed_s, simulate, simulate_named, waited

__all__ = [
    "POLICIES",
    "Activation",
    "ActivationPolicy",
    "parse_activation",
    "policy",
    "order_key",
    "chosen",
    "by_saving",
    "tally",
    "COMPUTE_KINDS",
    "DESCRIPTORS",
    "NAMED",
    "Action",
    "Descriptor",
    "Event",
    "Floors",
    "Kind",
    "StagePlacement",
    "Order",
    "ScheduleName",
    "SimResult",
    "StageCost",
    "build_schedule",
    "chrome_trace",
    "describe",
    "listed",
    "draw_timeline",
    "format_grid",
    "from_csv_rows",
    "parse_action",
    "parse_grid",
    "simulate",
    "simulate_named",
    "resumed_s",
    "waited",
    "stage_to_rank",
    "stages_per_rank",
    "to_csv_rows",
    "validate",
    "write_chrome_trace",
]
