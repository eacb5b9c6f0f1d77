"""Pure cost functions: stage costs from unit costs, and closed-form 1F1B/GPipe step time, bubble and memory.

The step-time formula is the standard one for synchronous pipelines (GPipe, Huang et al. 2019; PipeDream-flush /
1F1B, Narayanan et al. 2021; as used by DAPPLE and Alpa): with stage times T_s = F_s + B_s and m microbatches,
step = sum_s T_s + 2 * sum_s c_s + (m - 1) * max_s T_s, where c_s is the send time from stage s to s + 1.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from .cluster import Link
from .profile import UnitCost

__all__ = ["Schedule", "StageCost", "stage_cost", "stage_costs", "step_time", "bubble_fraction",
           "inflight_microbatches", "stage_memory", "estimate_named"]


class Schedule(enum.Enum):
    """Named schedules the skeleton plans for (values are the names used in plan JSON)."""

    ONE_F_ONE_B = "1F1B"
    GPIPE = "GPipe"


@dataclass(frozen=True)
class StageCost:
    """Costs of one stage for one microbatch."""

    forward_s: float
    backward_s: float
    static_bytes: int
    activation_bytes: int
    send_s: float
    """Time to send this stage's output to the next stage (0 for the last stage)."""

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s


def stage_cost(units: Sequence[UnitCost], first: int, end: int, cut_bytes: Sequence[int], link: Link) -> StageCost:
    """Cost of a stage made of units [first, end); `cut_bytes[k-1]` is what crosses the cut before unit k."""
    part = units[first:end]
    send = link.transfer_s(cut_bytes[end - 1]) if end < len(units) else 0.0
    return StageCost(sum(u.forward_s for u in part), sum(u.backward_s for u in part),
                     sum(u.static_bytes for u in part), sum(u.activation_bytes for u in part), send)


def stage_costs(units: Sequence[UnitCost], bounds: Sequence[tuple[int, int]], cut_bytes: Sequence[int],
                link: Link) -> list[StageCost]:
    """Stage costs for a split given as [first, end) ranges."""
    return [stage_cost(units, a, b, cut_bytes, link) for a, b in bounds]


def step_time(stages: Sequence[StageCost], m: int, schedule: Schedule) -> float:
    """Predicted step time of `m` microbatches (formula in the module docstring; GPipe takes the forward and the
    backward bottleneck separately since all forwards run before any backward)."""
    fill = sum(s.time_s for s in stages) + 2 * sum(s.send_s for s in stages)
    if schedule is Schedule.GPIPE:
        return fill + (m - 1) * (max(s.forward_s for s in stages) + max(s.backward_s for s in stages))
    return fill + (m - 1) * max(s.time_s for s in stages)


def bubble_fraction(stages: Sequence[StageCost], m: int, step_s: float) -> float:
    """1 - busy time / (stages * step time)."""
    busy = m * sum(s.time_s for s in stages)
    return max(0.0, 1.0 - busy / (len(stages) * step_s)) if step_s > 0 else 0.0


def inflight_microbatches(stage: int, num_stages: int, m: int, schedule: Schedule) -> int:
    """Microbatches whose activations stage `stage` holds at its peak: all m for GPipe, p - s for 1F1B."""
    return m if schedule is Schedule.GPIPE else min(num_stages - stage, m)


def stage_memory(cost: StageCost, stage: int, num_stages: int, m: int, schedule: Schedule) -> int:
    """Peak bytes of a stage: weights, gradients and optimizer state plus in-flight activations."""
    return cost.static_bytes + inflight_microbatches(stage, num_stages, m, schedule) * cost.activation_bytes


def estimate_named(name: str, forward: Sequence[float], backward_input: Sequence[float],
                   backward_weight: Sequence[float], owner: Sequence[int], comm: Sequence[float], m: int) -> float:
    """Closed-form step-time estimate of a named schedule (ScheduleName value), used only to rank candidates
    before the simulator judges them. T_s = F + I + W per stage, R_r = sum of T_s on rank r, p ranks, v stages per
    rank: GPipe sum T + 2 sum c + (m - 1)(max F + max B); 1F1B the module formula; Interleaved1F1B and LoopedBFS
    (m + (p - 1) / v) max R + 2 sum c (Megatron: the bubble shrinks v times); the zero-bubble family
    m max R + (p - 1) / v max (F + I - W)^+ + 2 sum c / v (Qi et al. 2023: W fills the bubble)."""
    times = [f + i + w for f, i, w in zip(forward, backward_input, backward_weight)]
    p = max(owner) + 1
    v = len(times) / p
    per_rank = [0.0] * p
    for t, r in zip(times, owner):
        per_rank[r] += t
    fill, top = sum(times) + 2 * sum(comm), max(per_rank)
    if name == "GPipe":
        backward = [i + w for i, w in zip(backward_input, backward_weight)]
        return fill + (m - 1) * (max(forward) + max(backward))
    if name == "1F1B":
        return fill + (m - 1) * max(times)
    if name in ("Interleaved1F1B", "LoopedBFS"):
        return (m + (p - 1) / v) * top + 2 * sum(comm)
    gap = max(max(0.0, f + i - w) for f, i, w in zip(forward, backward_input, backward_weight))
    return m * top + (p - 1) / v * gap + 2 * sum(comm) / v
