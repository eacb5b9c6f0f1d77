"""Exact dynamic program: contiguous stage boundaries minimising the 1F1B step time under a memory limit.

Objective (costmodel): sum_s T_s + 2 sum_s c_s + (m - 1) max_s T_s. The max term makes it not a plain sum, so,
as Alpa does (Zheng et al. 2022, "Alpa", section 5.2), we enumerate the bottleneck: for each candidate value t of
max_s T_s, a DP over (stages used, units covered) minimises the additive part with every stage time <= t, and the
answer is the best (additive part + (m - 1) t) over all t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..cluster import Link
from ..costmodel import Schedule, StageCost, bubble_fraction, stage_cost, stage_memory, step_time
from ..profile import UnitCost

__all__ = ["Split", "best_split", "even_bounds", "evaluate_split", "min_peak_memory"]

INF = float("inf")


@dataclass(frozen=True)
class Split:
    """A contiguous split and its predicted figures."""

    bounds: tuple[tuple[int, int], ...]
    stages: tuple[StageCost, ...]
    step_s: float
    peak_memory: tuple[int, ...]
    bubble: float


def evaluate_split(units: Sequence[UnitCost], cut_bytes: Sequence[int], link: Link, bounds: Sequence[tuple[int, int]],
                   m: int, schedule: Schedule = Schedule.ONE_F_ONE_B) -> Split:
    """Predicted step time, per-stage peak memory and bubble of the split `bounds`."""
    stages = tuple(stage_cost(units, a, b, cut_bytes, link) for a, b in bounds)
    step = step_time(stages, m, schedule)
    peaks = tuple(stage_memory(c, s, len(stages), m, schedule) for s, c in enumerate(stages))
    return Split(tuple(bounds), stages, step, peaks, bubble_fraction(stages, m, step))


def even_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """Split n units into p stages of as equal a unit count as possible (the earlier stages get the extras)."""
    q, r = divmod(n, p)
    ends = [0]
    for s in range(p):
        ends.append(ends[-1] + q + (s < r))
    return list(zip(ends, ends[1:]))


def _table(units: Sequence[UnitCost], cut_bytes: Sequence[int], link: Link) -> dict[tuple[int, int], StageCost]:
    n = len(units)
    return {(a, b): stage_cost(units, a, b, cut_bytes, link) for a in range(n) for b in range(a + 1, n + 1)}


def _dp(table: dict[tuple[int, int], StageCost], n: int, p: int, m: int, limit: int,
        bottleneck: float) -> tuple[float, int, tuple[tuple[int, int], ...]] | None:
    """Min (sum of T_s + 2 c_s, max peak) over splits into p stages with every T_s <= bottleneck and memory <= limit."""
    # best[k][j]: (additive cost, peak memory, bounds) of the best way to cover units [0, j) with k stages.
    best: list[dict[int, tuple[float, int, tuple[tuple[int, int], ...]]]] = [{0: (0.0, 0, ())}]
    for k in range(1, p + 1):
        layer: dict[int, tuple[float, int, tuple[tuple[int, int], ...]]] = {}
        # Stage k-1 covers [i, j); leave at least one unit for each of the p - k later stages.
        for j in range(k, n - (p - k) + 1):
            for i, (cost, peak, bounds) in best[k - 1].items():
                if i >= j:
                    continue
                c = table[(i, j)]
                mem = stage_memory(c, k - 1, p, m, Schedule.ONE_F_ONE_B)
                if c.time_s > bottleneck or mem > limit:
                    continue
                cand = (cost + c.time_s + 2 * c.send_s, max(peak, mem), bounds + ((i, j),))
                if j not in layer or cand[:2] < layer[j][:2]:
                    layer[j] = cand
        best.append(layer)
    return best[p].get(n)


def best_split(units: Sequence[UnitCost], cut_bytes: Sequence[int], link: Link, p: int, m: int,
               limit: int) -> Split | None:
    """The split of `units` into `p` stages with the least 1F1B step time (ties: least peak memory) whose every
    stage fits in `limit` bytes, or None when none fits. Exact: see the module docstring."""
    n = len(units)
    if not 1 <= p <= n:
        return None
    table = _table(units, cut_bytes, link)
    work = sum(u.forward_s + u.backward_s for u in units)
    best: tuple[float, int, tuple[tuple[int, int], ...]] | None = None
    # 1. Candidate bottlenecks: every possible stage time, ascending.
    for t in sorted({c.time_s for c in table.values()}):
        # 2. Lower bound: the additive part is at least the total work; stop when no candidate can win.
        if best is not None and work + (m - 1) * t > best[0]:
            break
        # 3. Best additive part with every stage time <= t; the objective uses t as the bottleneck, which is exact
        #    when t equals the split's true bottleneck, and an overestimate otherwise (so the minimum is exact).
        found = _dp(table, n, p, m, limit, t)
        if found is not None:
            cand = (found[0] + (m - 1) * t, found[1], found[2])
            if best is None or cand[:2] < best[:2]:
                best = cand
    return None if best is None else evaluate_split(units, cut_bytes, link, best[2], m)


def min_peak_memory(units: Sequence[UnitCost], cut_bytes: Sequence[int], link: Link, p: int, m: int) -> int:
    """The smallest per-device memory for which some split into `p` stages fits (min over splits of max stage peak)."""
    n = len(units)
    table = _table(units, cut_bytes, link)
    best: list[dict[int, float]] = [{0: 0}]
    for k in range(1, p + 1):
        layer: dict[int, float] = {}
        for j in range(k, n - (p - k) + 1):
            options = [max(peak, stage_memory(table[(i, j)], k - 1, p, m, Schedule.ONE_F_ONE_B))
                       for i, peak in best[k - 1].items() if i < j]
            if options:
                layer[j] = min(options)
        best.append(layer)
    return int(best[p][n])
