"""Schedules as data: action IR, named schedules in torch's order, and a timed, memory-aware simulator."""

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
from autopp.schedule.draw import chrome_trace, draw_timeline, write_chrome_trace
from autopp.schedule.named import (
    Layout,
    ScheduleName,
    build_schedule,
    layout_of,
    stage_to_rank,
    stages_per_rank,
    validate,
)
from autopp.schedule.simulate import Event, SimResult, StageCost, simulate, simulate_named
from autopp.schedule.synth import (
    SynthResult,
    SynthStatus,
    greedy_order,
    min_memory_bytes,
    sequential_order,
    split_backward,
    synthesize,
    write_schedule_csv,
)

__all__ = [
    "COMPUTE_KINDS",
    "Action",
    "Event",
    "Kind",
    "Layout",
    "Order",
    "ScheduleName",
    "SimResult",
    "StageCost",
    "build_schedule",
    "chrome_trace",
    "draw_timeline",
    "format_grid",
    "from_csv_rows",
    "layout_of",
    "parse_action",
    "parse_grid",
    "simulate",
    "simulate_named",
    "stage_to_rank",
    "stages_per_rank",
    "to_csv_rows",
    "validate",
    "write_chrome_trace",
    "SynthResult",
    "SynthStatus",
    "greedy_order",
    "min_memory_bytes",
    "sequential_order",
    "split_backward",
    "synthesize",
    "write_schedule_csv",
]
