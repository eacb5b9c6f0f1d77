"""Lower bounds, for every contiguous split, of a schedule's closed-form estimate and of its simulated pipeline: the
forms each descriptor holds (`Descriptor.estimate_bound`, `pipe_bound`), fed the floors that
autopp/solve/search/bounds.py derives (and proves) from a configuration's unit costs."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Floors", "PipeBound", "estimate_bound_single", "estimate_bound_megatron", "estimate_bound_zero_bubble",
           "estimate_bound_chimera", "bound_single", "bound_flush", "bound_megatron", "bound_zero_bubble",
           "bound_chimera"]


class Floors(NamedTuple):
    """Lower bounds, valid for every contiguous split, of the terms a closed-form estimate is made of
    (derivations in `autopp/solve/search/bounds.py`)."""

    rank: float
    """max_r R_r: the busiest rank's work per microbatch."""
    total: float
    """sum_s T_s: the replica's work per microbatch at the fastest speed."""
    stage: float
    """max_s T_s: the slowest stage's work per microbatch."""
    gap: float
    """max_s (F + I - W)_s^+: the zero-bubble schedules' warm-up excess."""
    comm: float
    """2 x the sum of the rank-crossing transfers of one microbatch (forward and back)."""
    path: float = 0.0
    """sum_s (F + the smaller of B and I)_s at the fastest speed: one microbatch's round trip, its weight gradients
    left out (zero-bubble schedules may run them last)."""


#: (floors, microbatches, pipeline ranks, stages per rank) -> a lower bound of the simulated pipeline time or of the
#: estimate (`Descriptor.pipe_bound`, `estimate_bound`; tests/solve/test_bounds.py checks each on random profiles).
PipeBound = Callable[[Floors, int, int, int], float]


def estimate_bound_single(f: Floors, m: int, p: int, v: int) -> float:
    """GPipe and 1F1B: sum T + (m - 1) max T + 2 sum c bounds their estimate (GPipe's (m - 1)(max F + max B) >=
    (m - 1) max T)."""
    return f.total + (m - 1) * f.stage + f.comm


def estimate_bound_megatron(f: Floors, m: int, p: int, v: int) -> float:
    """Interleaved 1F1B and looped BFS: (m + (p - 1) / v) max R + 2 sum c bounds their estimate."""
    return (m + (p - 1) / v) * f.rank + f.comm


def bound_single(f: Floors, m: int, p: int, v: int) -> float:
    """Seq1F1B (a microbatch's chunks enter the pipeline apart, so `bound_flush`'s whole-microbatch fill does not
    apply): the estimate's sum T + (m - 1) max T + 2 sum c does not bound the simulation when m is small (1F1B, p 2,
    m 2: 0.4706 s against 0.4691 s simulated), the larger of the bottleneck's m microbatches and one round trip
    does; the smaller of the two forms bounds both."""
    return min(estimate_bound_single(f, m, p, v), max(m * f.stage, f.total + f.comm))


def bound_flush(f: Floors, m: int, p: int, v: int) -> float:
    """GPipe and 1F1B, the simulated step: the busiest rank's m microbatches, one microbatch's round trip, and
    every rank k's m T_k after the first microbatch's forwards reach it and before its last backward's return
    through the stages before it, P_k = sum_(s<k) T_s: the step X >= P_k + m T_k for every k gives X - P_(k+1) >=
    (X - P_k)(1 - 1/m), so sum T = P_p <= X (1 - (1 - 1/m)^p), i.e. X >= sum T / (1 - (1 - 1/m)^p), about
    (m + (p - 1) / 2) sum T / p for m >> p: half of the estimate's bubble, for every split."""
    return max(m * f.stage, f.total + f.comm, f.total / (1 - (1 - 1 / m) ** p))


def bound_megatron(f: Floors, m: int, p: int, v: int) -> float:
    """Interleaved 1F1B, looped BFS, the simulated step: the busiest rank's m microbatches, m max R, and one
    microbatch's round trip, sum T + 2 sum c. The estimate's bubble, (p - 1) / v max R, is not a bound of the
    simulation: a light first stage shortens the fill (LoopedBFS, p 2, v 4, m 4, one jittered unit per stage: 0.394 s
    against 0.388 s simulated; tests/solve/test_prove.py)."""
    return max(m * f.rank, f.total + f.comm)


def bound_zero_bubble(f: Floors, m: int, p: int, v: int) -> float:
    """The zero-bubble schedules and DualPipeV, the simulated step: the busiest rank's m microbatches, m max R, and
    one microbatch's forwards and input gradients through every stage, `Floors.path` + 2 sum c (its weight gradients
    may wait)."""
    return max(m * f.rank, f.path + f.comm)


def estimate_bound_zero_bubble(f: Floors, m: int, p: int, v: int) -> float:
    """Zero bubble: m max R + (p - 1) / v max (F + I - W)^+ + 2 sum c / v bounds its estimate."""
    return m * f.rank + (p - 1) / v * max(0.0, f.gap) + f.comm / v


def estimate_bound_chimera(f: Floors, m: int, p: int, v: int) -> float:
    """Chimera: max_r (T_r + T_(p-1-r)) >= 2 sum T / p, so m sum T / p + (p - 2) / 2 max T + 2 sum c bounds its
    estimate."""
    return m * f.total / p + (p - 2) / 2 * f.stage + f.comm


def bound_chimera(f: Floors, m: int, p: int, v: int) -> float:
    """Chimera: the busiest rank does at least the average work, m sum T / p, and one microbatch's round trip takes
    sum T + 2 sum c; the larger bounds the simulation, and the smaller of that and the estimate's bound bounds
    both."""
    return min(estimate_bound_chimera(f, m, p, v), max(m * f.total / p, f.total + f.comm))
