"""CP-SAT for heterogeneous clusters: which device runs which pipeline position, and the split, chosen together.

The DP (dp.py) is exact for devices in a fixed order; when devices differ, the order matters (a slow or small device
wants a short stage, a slow link wants a light cut), so this model also chooses a permutation of the devices along a
one-stage-per-rank pipeline. Objective as dp.py: sum_s (T_s + 2 c_s) + (m - 1) max_s T_s, in integer units of
`resolution` seconds; c_s uses the link joining the two devices chosen for positions s and s + 1 (`links[i]` joins
file devices i and i + 1, any other pair uses `link`). Layout: Data -> Model -> Variables -> Constraints ->
Objective -> Solve -> Report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from ...data.cluster import Cluster, Link
from ...costmodel import UnitArrays, transfer_time, unit_memory
from ...schedule import Activation
from ...errors import InfeasibleError
from .report import solve_progress
from .split import contiguous_split, output_load, stage_transient_var, start_load
from ..partition.dp import Bounds

__all__ = ["Placement", "place_devices"]


@dataclass(frozen=True)
class Placement:
    """The device order and split CP-SAT found, and how sure it is."""

    order: tuple[int, ...]
    """File index of the device at each pipeline position."""
    bounds: Bounds
    objective_s: float
    gap: float
    """(objective - best bound) / objective; 0 when proved optimal."""
    status: str


def place_devices(a: UnitArrays, cluster: Cluster, microbatches: int, inflight: tuple[int, ...],
                  activation: Activation, time_limit_s: float = 10.0, resolution: float = 1e-6) -> Placement:
    """Order the cluster's devices along the pipeline (one stage per device) and split the units, minimising the
    pipeline objective under every device's memory. Raises InfeasibleError when CP-SAT proves that no order and split
    fit, or finds none within the time limit (saying which)."""
    # Data: integer work per unit, bytes per (position, unit), link kinds between devices.
    n, p = a.n, cluster.num_devices
    devices = [cluster.devices[d] if cluster.devices else cluster.device(0) for d in range(p)]
    work = np.round(a.work(activation) / resolution).astype(np.int64)
    mem = [np.round(unit_memory(a, inflight[k], activation)).astype(np.int64) for k in range(p)]
    kinds: list[Link] = sorted({cluster.device_link(d, e) for d in range(p) for e in range(p) if d != e},
                               key=lambda lk: (lk.latency_s, -lk.bandwidth_bytes_per_s))
    comm = [[int(round(transfer_time(lk, float(a.cut[j])) / resolution)) for j in range(n + 1)] for lk in kinds]
    # Model.
    model = cp_model.CpModel()
    # Variables: x[u,s] unit u on stage s; end[j,s] stage s ends at boundary j; y[s,d] device d at position s;
    # kind[s,l] the link after position s is of kind l.
    x, end = contiguous_split(model, n, p)
    y = {(k, d): model.new_bool_var(f"y[s={k},d={d}]") for k in range(p) for d in range(p)}
    kind = {(k, l): model.new_bool_var(f"kind[s={k},l={l}]") for k in range(p - 1) for l in range(len(kinds))}
    horizon = int(work.sum() / min(d.speed for d in devices)) + 1
    stage_t = [model.new_int_var(0, horizon, f"T[s={k}]") for k in range(p)]
    t_max = model.new_int_var(0, horizon, "Tmax")
    cmax = max((max(row) for row in comm), default=0)
    send = [model.new_int_var(0, cmax, f"c[s={k}]") for k in range(p - 1)]
    # Placement: a permutation (each position one device, each device one position).
    for k in range(p):
        model.add_exactly_one(y[k, d] for d in range(p))
        model.add_exactly_one(y[j, k] for j in range(p))
    # Stage time and memory on the chosen device (time rounded up so the integer model never flatters a stage).
    for k in range(p):
        load = sum(int(work[u]) * 1000 * x[u, k] for u in range(n)) + 1000 * start_load(a, end, k, resolution)
        need = sum(int(mem[k][u]) * x[u, k] for u in range(n)) + stage_transient_var(model, x, a, k) \
            + output_load(a, end, k, inflight[k], p)
        for d, dev in enumerate(devices):
            model.add(stage_t[k] * int(round(dev.speed * 1000)) >= load).only_enforce_if(y[k, d])
            model.add(need <= dev.memory_bytes).only_enforce_if(y[k, d])
        model.add(t_max >= stage_t[k])
    # Links: the devices at positions k and k + 1 fix the link kind; the send after stage k pays it on its cut.
    for k in range(p - 1):
        for d in range(p):
            for e in range(p):
                if d != e:
                    l = kinds.index(cluster.device_link(d, e))
                    model.add_bool_or([kind[k, l]]).only_enforce_if([y[k, d], y[k + 1, e]])
        for j in range(1, n):
            for l in range(len(kinds)):
                model.add(send[k] >= comm[l][j]).only_enforce_if([end[j, k], kind[k, l]])
    # Objective: sum_s T_s + 2 sum_s c_s + (m - 1) Tmax.
    model.minimize(sum(stage_t) + 2 * sum(send) + (microbatches - 1) * t_max)
    # Solve (one worker, seed 0: deterministic).
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.solve(model, solve_progress("CP-SAT placing the devices", time_limit_s))
    # Report: every non-optimal outcome is said.
    name = solver.status_name(status)
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(f"CP-SAT proved that no order of the {p} devices and no split of {n} units into {p} "
                              f"stages fits every device's memory")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasibleError(f"CP-SAT found no device order and split within {time_limit_s} s (status {name}); "
                              f"raise the time limit")
    order = tuple(next(d for d in range(p) if solver.value(y[k, d])) for k in range(p))
    stage_of = [next(k for k in range(p) if solver.value(x[u, k])) for u in range(n)]
    bounds = tuple((stage_of.index(k), n - stage_of[::-1].index(k)) for k in range(p))
    obj, bound = solver.objective_value, solver.best_objective_bound
    gap = 0.0 if status == cp_model.OPTIMAL else (obj - bound) / obj if obj > 0 else 0.0
    return Placement(order, bounds, obj * resolution, gap, name)
