"""OR-Tools CP-SAT model of the contiguous split on heterogeneous devices (speeds, memories, links differ).

Same objective as dp.py: sum_s (T_s + 2 c_s) + (m - 1) max_s T_s, T_s = work of stage s / speed of device s, in
integer time units of `resolution` seconds (what a stage adds at its first unit, `UnitArrays.stage_start`,
included); memory of stage s = static + inflight[s] x activations + the largest
transient of its units (`stage_transient`) <= its budget.
Layout: Data -> Model -> Variables -> Constraints -> Objective -> Solve -> Report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from ...costmodel import UnitArrays, stage_outputs, transfer_time, unit_memory
from ...errors import InfeasibleError
from ..partition.dp import Bounds, PipeSpec

__all__ = ["CpSatResult", "solve_cpsat", "contiguous_split", "stage_transient_var", "start_load", "output_load"]


@dataclass(frozen=True)
class CpSatResult:
    """The split CP-SAT found and how sure it is."""

    bounds: Bounds
    objective_s: float
    """Objective of `bounds` in seconds (from the integer model)."""
    optimal: bool
    gap: float
    """(objective - best bound) / objective; 0 when proved optimal."""
    status: str


def solve_cpsat(a: UnitArrays, spec: PipeSpec, time_limit_s: float = 10.0, resolution: float = 1e-6,
                workers: int = 1) -> CpSatResult:
    """Solve the split for `spec`; raises InfeasibleError when CP-SAT proves no split fits, and when it finds none
    within the time limit (saying so)."""
    # Data: integer stage work per (stage, unit) and bytes per unit.
    n, s_count = a.n, spec.num_stages
    speed = spec.speed or (1.0,) * s_count
    work = np.round(a.work(spec.activation) / resolution).astype(np.int64)
    inflight = spec.inflight or (1,) * s_count
    mem_unit = [np.round(unit_memory(a, inflight[k], spec.activation)).astype(np.int64)
                for k in range(s_count)]
    links = spec.links or (None,) * (s_count - 1)
    comm = [[0 if lk is None else int(round(transfer_time(lk, float(a.cut[j])) / resolution)) for j in range(n + 1)]
            for lk in links]
    # Model.
    model = cp_model.CpModel()
    # Variables: x[u,s] = unit u runs on stage s; e[j,s] = stage s ends at boundary j (j = 1..n-1).
    x, end = contiguous_split(model, n, s_count)
    horizon = int(work.sum() / min(speed)) + 1
    stage_t = [model.new_int_var(0, horizon, f"T[s={k}]") for k in range(s_count)]
    t_max = model.new_int_var(0, horizon, "Tmax")
    # Stage time: scaled by the device speed (rounded up so the integer model never flatters a stage).
    for k in range(s_count):
        load = sum(int(work[u]) * 1000 * x[u, k] for u in range(n)) + 1000 * start_load(a, end, k, resolution)
        model.add(stage_t[k] * int(round(speed[k] * 1000)) >= load)
        model.add(t_max >= stage_t[k])
    # Memory: each stage within its device's budget.
    if spec.memory:
        for k in range(s_count):
            model.add(sum(int(mem_unit[k][u]) * x[u, k] for u in range(n)) + stage_transient_var(model, x, a, k)
                      + output_load(a, end, k, inflight[k], s_count) <= int(spec.memory[k]))
    # Objective: sum_s T_s + 2 sum_s c_s + (m - 1) Tmax.
    comm_term = sum(2 * comm[k][j] * end[j, k] for j in range(1, n) for k in range(s_count - 1))
    model.minimize(sum(stage_t) + comm_term + (spec.microbatches - 1) * t_max)
    # Solve.
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = 0
    status = solver.solve(model)
    # Report: every non-optimal outcome is said.
    name = solver.status_name(status)
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(f"CP-SAT proved that no split of {n} units into {s_count} stages fits the devices' "
                              "memory")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasibleError(f"CP-SAT found no split within {time_limit_s} s (status {name}); raise the time limit")
    stage_of = [next(k for k in range(s_count) if solver.value(x[u, k])) for u in range(n)]
    bounds = tuple((stage_of.index(k), n - stage_of[::-1].index(k)) for k in range(s_count))
    obj, bound = solver.objective_value, solver.best_objective_bound
    gap = 0.0 if status == cp_model.OPTIMAL else (obj - bound) / obj if obj > 0 else 0.0
    return CpSatResult(bounds, obj * resolution, status == cp_model.OPTIMAL, gap, name)


Assign = dict[tuple[int, int], cp_model.IntVar]


def start_load(a: UnitArrays, end: Assign, k: int, resolution: float) -> cp_model.LinearExpr | int:
    """What stage k adds at its first unit (`UnitArrays.stage_start`, in units of `resolution`), from the boundary
    where stage k - 1 ends (stage 0's first unit is unit 0's); 0 without it."""
    if a.stage_start is None:
        return 0
    start = np.round(a.stage_start / resolution).astype(np.int64)
    if k == 0:
        return int(start[0])
    return sum(int(start[j]) * end[j, k - 1] for j in range(1, a.n) if start[j])


def output_load(a: UnitArrays, end: Assign, k: int, inflight: int, stages: int) -> cp_model.LinearExpr | int:
    """Stage k of `stages`'s outputs held per in-flight microbatch (`costmodel.stage_outputs`): the cut where it
    ends, times `inflight`; for the last stage, which ends at the model's end, the model's output (a reviewer: it
    was left out, so CP-SAT placed splits the DP found too big)."""
    out = np.round(stage_outputs(a, inflight)).astype(np.int64)
    if k == stages - 1:
        return int(out[a.n])
    return sum(int(out[j]) * end[j, k] for j in range(1, a.n) if (j, k) in end and out[j])


def stage_transient_var(model: cp_model.CpModel, x: Assign, a: UnitArrays, k: int) -> cp_model.IntVar | int:
    """Stage k's largest unit transient (`costmodel.stage_transient`) as a variable bounded below by every unit it
    holds (memory constraints push it down to the largest); 0 when the profile has none."""
    transient = np.round(a.transient_bytes()).astype(np.int64)
    if not transient.any():
        return 0
    top = model.new_int_var(0, int(transient.max()), f"transient[s={k}]")
    for u in np.flatnonzero(transient):
        model.add(top >= int(transient[u]) * x[int(u), k])
    return top


def contiguous_split(model: cp_model.CpModel, n: int, stages: int) -> tuple[Assign, Assign]:
    """Variables and constraints of a split of n units into `stages` contiguous, ordered stages.

    x[u,s] = unit u runs on stage s; end[j,s] = stage s ends at boundary j (j = 1..n-1, s < stages-1)."""
    x = {(u, k): model.new_bool_var(f"x[u={u},s={k}]") for u in range(n) for k in range(stages)}
    end = {(j, k): model.new_bool_var(f"end[j={j},s={k}]") for j in range(1, n) for k in range(stages - 1)}
    # Every unit on one stage; the first unit on the first stage, the last on the last.
    for u in range(n):
        model.add_exactly_one(x[u, k] for k in range(stages))
    model.add(x[0, 0] == 1)
    model.add(x[n - 1, stages - 1] == 1)
    # Contiguous and in order: unit u+1 is on u's stage or the next.
    for u in range(n - 1):
        for k in range(stages):
            model.add_bool_or([x[u + 1, k]] + ([x[u + 1, k + 1]] if k + 1 < stages else [])).only_enforce_if(x[u, k])
            if k + 1 < stages:  # stage k ends at u + 1 exactly when u is on k and u + 1 on k + 1
                model.add_bool_and([x[u, k], x[u + 1, k + 1]]).only_enforce_if(end[u + 1, k])
                model.add_bool_or([end[u + 1, k]]).only_enforce_if([x[u, k], x[u + 1, k + 1]])
    return x, end
