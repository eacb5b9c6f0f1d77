"""Schedule synthesis with CP-SAT: the fastest per-rank F/I/W order for the real stage costs under memory limits."""

from __future__ import annotations

import csv
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ortools.sat.python import cp_model

from autopp.errors import AutoppError, InfeasibleError, ScheduleError
from autopp.schedule.actions import Action, Kind, Order, to_csv_rows
from autopp.schedule.effects import StageCost, rank_static_bytes, transient_peak
from autopp.schedule.simulate import SimResult, simulate
from autopp.solve.cpsat.report import solve_progress
from autopp.solve.cpsat.warmstart import (
    GREEDY_PRIORITIES,
    SPLIT_KINDS,
    Hint,
    best_hint,
    fits,
    greedy_order,
    kind_time,
    min_memory_bytes,
    named_orders,
    sequential_order,
    split_backward,
)

__all__ = [
    "SynthStatus",
    "SynthResult",
    "synthesize",
    "min_memory_bytes",
    "split_backward",
    "sequential_order",
    "greedy_order",
    "write_schedule_csv",
]

log = logging.getLogger(__name__)

_MAX_TICKS = 1_000_000
"""Default resolution: the warm start's step time spans at most this many ticks."""
_MIN_TICKS_PER_ACTION = 100
"""Default resolution: the shortest non-zero action spans at least this many ticks (unless that breaks the cap)."""


class SynthStatus(Enum):
    """How the returned order was found."""

    OPTIMAL = "optimal"
    """CP-SAT proved the order optimal in the tick model (within the in-order restriction)."""
    FEASIBLE = "feasible"
    """CP-SAT stopped at the time limit; ``gap`` says how far the objective may be from optimal."""
    HINT = "hint"
    """The solver's order did not simulate faster than the warm start (or none was found); the warm start is
    returned."""


@dataclass(frozen=True, kw_only=True)
class SynthResult:
    """A synthesized schedule, as judged by the simulator, with the solver's figures."""

    order: dict[int, list[Action]]
    """Per-rank compute actions (F, I, W), sorted by start time; feed to ``simulate`` or ``to_csv_rows``."""
    sim: SimResult
    """The simulator's verdict on ``order`` in float seconds: this is what is reported."""
    status: SynthStatus
    """OPTIMAL, FEASIBLE, or HINT (the warm start was returned)."""
    objective_s: float
    """CP-SAT's best makespan, ticks x ``tick_s`` (durations rounded up, so >= the simulated step time)."""
    bound_s: float
    """CP-SAT's lower bound on the makespan of the tick model, in seconds."""
    gap: float
    """(objective - bound) / objective; 0 when proven optimal."""
    solve_time_s: float
    """Wall time of CP-SAT's solve."""
    hint_name: str
    """The warm start: a ScheduleName value, "sequential", or "user"."""
    hint_step_s: float
    """Simulated step time of the warm start."""
    tick_s: float
    """Seconds per CP-SAT time unit."""


@dataclass(frozen=True)
class _Data:
    """The instance in integer ticks; index = stage unless named otherwise."""

    ranks: int
    microbatches: int
    owner: tuple[int, ...]
    duration: dict[tuple[int, Kind], int]
    hop: tuple[int, ...]
    """Ticks to move a tensor between stage s and s + 1 (0 on one rank); index = boundary s."""
    activation: tuple[int, ...]
    capacity: tuple[int, ...]
    """Per rank: memory limit minus static bytes, i.e. room for activations."""
    horizon: int
    """The warm start's makespan in ticks: the solver only looks for schedules at least as fast."""
    tick_s: float
    """Seconds per tick."""


# ---------------------------------------------------------------- data: seconds -> ticks


def _auto_tick(costs: Sequence[StageCost], hint_step_s: float) -> float:
    """Resolution: 1/100 of the shortest non-zero action, coarsened so the warm start spans <= 10^6 ticks."""
    positive = [kind_time(c, k) for c in costs for k in SPLIT_KINDS if kind_time(c, k) > 0]
    fine = min(positive) / _MIN_TICKS_PER_ACTION if positive else 1.0
    return max(fine, hint_step_s / _MAX_TICKS) if hint_step_s > 0 else fine


def _ticks(seconds: float, tick_s: float) -> int:
    """Round up (with a tolerance for float noise), so a tick schedule is also valid in real time."""
    return max(0, math.ceil(seconds / tick_s - 1e-9))


def _tick_costs(costs: Sequence[StageCost], tick_s: float) -> list[StageCost]:
    """Durations in ticks, the message overhead folded into F and I."""
    return [StageCost(forward_s=_ticks(kind_time(c, Kind.F), tick_s),
                      backward_input_s=_ticks(kind_time(c, Kind.I), tick_s),
                      backward_weight_s=_ticks(kind_time(c, Kind.W), tick_s), static_bytes=c.static_bytes,
                      activation_bytes=c.microbatch_bytes) for c in costs]


def _data(costs: Sequence[StageCost], owner: Sequence[int], m: int, comm_s: Sequence[float],
          limits: Sequence[float], tick_s: float, horizon: int) -> _Data:
    ranks = max(owner) + 1
    static = [rank_static_bytes(costs, owner, q) + transient_peak((s for s, o in enumerate(owner) if o == q), costs)
              for q in range(ranks)]
    ticked = _tick_costs(costs, tick_s)
    duration = {(s, k): int(kind_time(c, k)) for s, c in enumerate(ticked) for k in SPLIT_KINDS}
    hop = tuple(0 if owner[s] == owner[s + 1] else _ticks(comm_s[s], tick_s) for s in range(len(owner) - 1))
    capacity = tuple(int(limits[q]) - static[q] for q in range(ranks))
    return _Data(ranks, m, tuple(owner), duration, hop, tuple(c.activation_bytes for c in costs), capacity,
                 horizon, tick_s)


# ---------------------------------------------------------------- model


@dataclass
class _Model:
    model: cp_model.CpModel
    start: dict[Action, cp_model.IntVar]
    hold: dict[Action, cp_model.IntVar]
    """Per W action: how long its microbatch's activations are held (W end - F start), on memory-bound ranks."""
    makespan: cp_model.IntVar


def _build(d: _Data, in_order: bool) -> _Model:
    """Variables, constraints and objective of the synthesis model (see docs/synthesis.md)."""
    model = cp_model.CpModel()
    n, m = len(d.owner), d.microbatches
    # Variables: one start and one fixed-length interval per (stage, microbatch, F|I|W), named by its indices.
    start: dict[Action, cp_model.IntVar] = {}
    interval: dict[Action, cp_model.IntervalVar] = {}
    for s in range(n):
        for mb in range(m):
            for k in SPLIT_KINDS:
                a, dur, name = Action(s, k, mb), d.duration[(s, k)], f"{k.value}[s={s},mb={mb}]"
                start[a] = model.new_int_var(0, d.horizon - dur, name)
                interval[a] = model.new_fixed_size_interval_var(start[a], dur, "iv_" + name)
    makespan = model.new_int_var(min(_rank_floor(d), d.horizon), d.horizon, "makespan")

    def end(a: Action) -> cp_model.LinearExprT:
        return start[a] + d.duration[(a.stage, a.kind)]

    # A rank runs one action at a time.
    for r in range(d.ranks):
        model.add_no_overlap([iv for a, iv in interval.items() if d.owner[a.stage] == r])
    for mb in range(m):
        for s in range(n - 1):
            # A forward needs the previous stage's forward output, plus the transfer between ranks.
            model.add(start[Action(s + 1, Kind.F, mb)] >= end(Action(s, Kind.F, mb)) + d.hop[s])
            # An input backward needs the next stage's input gradient, plus the transfer back.
            model.add(start[Action(s, Kind.I, mb)] >= end(Action(s + 1, Kind.I, mb)) + d.hop[s])
        # The last stage computes the loss in its forward, so its input backward follows its own forward.
        model.add(start[Action(n - 1, Kind.I, mb)] >= end(Action(n - 1, Kind.F, mb)))
        # The weight backward follows the input backward of the same stage and microbatch.
        for s in range(n):
            model.add(start[Action(s, Kind.W, mb)] >= end(Action(s, Kind.I, mb)))
    # Memory: a microbatch's activations are held from the start of its F until the end of its W; on each rank
    # they must fit in the limit minus the static bytes.
    hold: dict[Action, cp_model.IntVar] = {}
    for r in range(d.ranks):
        hold.update(_add_memory(model, d, r, start, end))
    # Symmetry breaking (optional): on each stage, microbatches run each kind in increasing order.
    if in_order:
        for s in range(n):
            for k in SPLIT_KINDS:
                for mb in range(m - 1):
                    model.add(start[Action(s, k, mb + 1)] >= end(Action(s, k, mb)))
    # The step ends when the last weight backward ends.
    last = [m - 1] if in_order else range(m)
    for s in range(n):
        for mb in last:
            model.add(makespan >= end(Action(s, Kind.W, mb)))
    # Objective: the step time.
    model.minimize(makespan)
    return _Model(model, start, hold, makespan)


def _rank_floor(d: _Data) -> int:
    """A lower bound on the step: no rank starts before its first forward input can arrive, then it is busy for
    all its work. Given as the makespan's lower bound, it lets CP-SAT prove optimality on bottlenecked ranks."""
    n, floor = len(d.owner), 0
    arrive = [0] * n
    for s in range(1, n):
        arrive[s] = arrive[s - 1] + d.duration[(s - 1, Kind.F)] + d.hop[s - 1]
    for r in range(d.ranks):
        stages = [s for s in range(n) if d.owner[s] == r]
        busy = d.microbatches * sum(d.duration[(s, k)] for s in stages for k in SPLIT_KINDS)
        floor = max(floor, min(arrive[s] for s in stages) + busy)
    return floor


def _add_memory(model: cp_model.CpModel, d: _Data, rank: int, start: dict[Action, cp_model.IntVar],
                end: object) -> dict[Action, cp_model.IntVar]:
    """Cumulative over [F start, W end) per (stage, microbatch) on ``rank``; returns the hold-length variables."""
    hold: dict[Action, cp_model.IntVar] = {}
    stages = [s for s in range(len(d.owner)) if d.owner[s] == rank and d.activation[s] > 0]
    if sum(d.activation[s] for s in stages) * d.microbatches <= d.capacity[rank]:
        return hold  # even all microbatches at once fit: the constraint can never bind
    held, demand = [], []
    for s in stages:
        for mb in range(d.microbatches):
            f, w = start[Action(s, Kind.F, mb)], Action(s, Kind.W, mb)
            size = model.new_int_var(0, d.horizon, f"held[s={s},mb={mb}]")
            held.append(model.new_interval_var(f, size, end(w), f"mem[s={s},mb={mb}]"))  # type: ignore[operator]
            demand.append(d.activation[s])
            hold[w] = size
    model.add_cumulative(held, demand, d.capacity[rank])
    return hold


def _add_hint(built: _Model, hint: SimResult) -> None:
    """Warm start: the start tick of every action of the warm start, timed in the tick model."""
    times = {e.action: (round(e.start_s), round(e.end_s)) for e in hint.events}
    for a, (begin, _) in times.items():
        built.model.add_hint(built.start[a], begin)
    for w, size in built.hold.items():
        built.model.add_hint(size, times[w][1] - times[Action(w.stage, Kind.F, w.microbatch)][0])
    built.model.add_hint(built.makespan, round(hint.step_time_s))


# ---------------------------------------------------------------- solve and report


def _solve(built: _Model, time_limit_s: float, num_workers: int
           ) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus, float]:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = 0
    began = time.perf_counter()
    status = solver.solve(built.model, solve_progress("CP-SAT synthesizing an order", time_limit_s))
    return solver, status, time.perf_counter() - began


def _order_from(solver: cp_model.CpSolver, built: _Model, d: _Data) -> dict[int, list[Action]]:
    """Per-rank actions sorted by start; ties (zero-length actions) broken in dependency order."""
    n = len(d.owner)

    def key(a: Action) -> tuple[int, int, int, int]:
        phase = a.stage if a.kind is Kind.F else n + 2 * (n - a.stage) + (a.kind is Kind.W)
        return solver.value(built.start[a]), d.duration[(a.stage, a.kind)] > 0, phase, a.microbatch

    order: dict[int, list[Action]] = {r: [] for r in range(d.ranks)}
    for a in sorted(built.start, key=key):
        order[d.owner[a.stage]].append(a)
    return order


def _check_limits(costs: Sequence[StageCost], owner: Sequence[int], limits: Sequence[float]) -> None:
    ranks = max(owner) + 1
    if len(limits) != ranks:
        raise ScheduleError(f"memory_limits needs one limit per rank ({len(limits)} != {ranks})")
    need = min_memory_bytes(costs, owner)
    short = [f"rank {r} needs at least {need[r]} bytes (static + one microbatch's activations) "
             f"but its limit is {int(limits[r])}" for r in range(ranks) if limits[r] < need[r]]
    if short:
        raise InfeasibleError("memory limits too small for any schedule: " + "; ".join(short))


def synthesize(stage_costs: Sequence[StageCost], stage_to_rank: Sequence[int], num_microbatches: int,
               comm_s: Sequence[float], memory_limits: Sequence[float], time_limit_s: float = 10.0,
               num_workers: int = 1, hint: Order | None = None, *, tick_s: float | None = None,
               in_order: bool = True) -> SynthResult:
    """The fastest F/I/W order CP-SAT finds for these stage costs under per-rank memory limits (bytes).

    Warm-started from ``hint`` when given (B is split into I, W), else from the fastest named schedule for this
    layout that fits memory, else from the one-microbatch-at-a-time order. The solver's order is re-judged by
    ``simulate`` in float seconds, and the warm start is returned instead if it simulates faster. Raises
    InfeasibleError when some rank's limit is below static + one microbatch's activations.
    """
    owner, m = list(stage_to_rank), num_microbatches
    if m < 1 or not owner:
        raise ScheduleError(f"need >= 1 microbatch and >= 1 stage (got {m} and {len(owner)})")
    if sorted(set(owner)) != list(range(max(owner) + 1)):
        raise ScheduleError(f"stage_to_rank must use ranks 0..{max(owner)}, got {sorted(set(owner))}")
    _check_limits(stage_costs, owner, memory_limits)
    candidates = [("user", split_backward(hint))] if hint is not None else named_orders(owner, m)
    candidates.append(("sequential", sequential_order(owner, m)))
    for priority in GREEDY_PRIORITIES:
        greedy = greedy_order(stage_costs, owner, m, comm_s, memory_limits, priority)
        if greedy is not None:
            candidates.append(("greedy-" + "".join(k.value for k in priority), greedy))
    best = best_hint(candidates, stage_costs, owner, comm_s, memory_limits)
    tick = tick_s if tick_s is not None else _auto_tick(stage_costs, best.sim.step_time_s)
    ticked = simulate(best.order, _tick_costs(stage_costs, tick), owner, [_ticks(c, tick) for c in comm_s])
    d = _data(stage_costs, owner, m, comm_s, memory_limits, tick, round(ticked.step_time_s))
    built = _build(d, in_order)
    _add_hint(built, ticked)
    solver, status, took = _solve(built, time_limit_s, num_workers)
    return _report(solver, status, took, built, d, best, stage_costs, comm_s, memory_limits)


def _report(solver: cp_model.CpSolver, status: cp_model.CpSolverStatus, took: float, built: _Model, d: _Data,
            best: Hint, costs: Sequence[StageCost], comm_s: Sequence[float], limits: Sequence[float]) -> SynthResult:
    """Check the solver status, re-judge its order in the simulator, and fall back to the warm start if slower."""
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(f"CP-SAT proved the model infeasible although the warm start {best.name} fits "
                              f"(step {best.sim.step_time_s:.6g} s); the tick rounding is too coarse")
    if status == cp_model.MODEL_INVALID:
        raise AutoppError(f"CP-SAT rejected the synthesis model: {built.model.validate()}")
    common = dict(solve_time_s=took, hint_name=best.name, hint_step_s=best.sim.step_time_s, tick_s=d.tick_s)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        log.info("CP-SAT found no schedule in the time limit (%s); returning the warm start %s",
                 solver.status_name(status), best.name)
        return SynthResult(order=best.order, sim=best.sim, status=SynthStatus.HINT, objective_s=math.nan,
                           bound_s=math.nan, gap=math.nan, **common)  # type: ignore[arg-type]
    tick = d.tick_s
    objective, bound = solver.objective_value, solver.best_objective_bound
    gap = (objective - bound) / objective if objective > 0 else 0.0
    order = _order_from(solver, built, d)
    sim = simulate(order, costs, d.owner, comm_s)
    found = SynthStatus.OPTIMAL if status == cp_model.OPTIMAL else SynthStatus.FEASIBLE
    if sim.step_time_s > best.sim.step_time_s or not fits(sim, limits):
        log.info("synthesized order simulates to %.6g s, warm start %s to %.6g s: keeping the warm start",
                 sim.step_time_s, best.name, best.sim.step_time_s)
        order, sim, found = best.order, best.sim, SynthStatus.HINT
    log.info("synthesis %s: objective %.6g s, bound %.6g s, gap %.2f%%, %.2f s", solver.status_name(status),
             objective * tick, bound * tick, 100 * gap, took)
    return SynthResult(order=order, sim=sim, status=found, objective_s=objective * tick, bound_s=bound * tick,
                       gap=gap, **common)  # type: ignore[arg-type]


def write_schedule_csv(order: Order, path: str | Path) -> Path:
    """Write ``order`` as torch's ``compute_only`` CSV (row r = rank r), loadable by ``_PipelineScheduleRuntime``."""
    out = Path(path)
    with out.open("w", newline="") as f:
        csv.writer(f).writerows(to_csv_rows(order))
    return out
