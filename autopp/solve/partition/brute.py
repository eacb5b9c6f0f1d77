"""The simulator's optimum by brute force on small cases: every contiguous split x every per-stage recompute choice.

The reference the planner is measured against (scripts/bench_optimality.py) and checked by (tests/solve/): for one
schedule, pp, v, m and dp, it judges (`judge.judge`: the simulator, the gradient all-reduce and the optimizer step)
every split of the n units into S = pp x v contiguous stages (C(n - 1, S - 1) of them) and every choice of each
stage's activation policy among those allowed (L^S per split for L policies; with keep and recompute, 2^S), as
AdaPipe does jointly with the split (Sun et al., "AdaPipe: Optimizing Pipeline Parallelism with Adaptive
Recomputation and Partitioning", ASPLOS'24). It keeps the fastest candidate that fits (ties: less peak memory, then
the lexicographically smaller split, then the lexicographically smaller policies in `Activation` order).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterator

from ...data.cluster import Cluster
from ...costmodel import UnitArrays
from ...data.layout import Layout
from ...schedule import Activation, ScheduleName, order_key, policy
from .dp import Bounds
from ..search.judge import Candidate, Verdict, judge

__all__ = ["BruteForce", "DEFAULT_LIMIT", "candidate_count", "contiguous_splits", "brute_force"]

DEFAULT_LIMIT = 200_000
"""Most candidates `brute_force` judges before it refuses (about 5 minutes at ~1.5 ms per judgement)."""


@dataclass(frozen=True)
class BruteForce:
    """The brute force's answer."""

    best: Verdict | None
    """The fastest fitting verdict, or None when no candidate fits."""
    judged: int
    """Candidates simulated (admissible splits x recompute choices)."""


def contiguous_splits(n: int, num_stages: int) -> Iterator[Bounds]:
    """Every split of units 0..n-1 into `num_stages` non-empty contiguous stages, in lexicographic order."""
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        ends = (0, *cuts, n)
        yield tuple(zip(ends, ends[1:]))


def _policy_choices(num_stages: int, activations: tuple[Activation, ...]) -> list[tuple[Activation, ...]]:
    """Per-stage policies to try: every assignment of `activations` to the stages, in `order_key` order."""
    return list(itertools.product(sorted(set(activations), key=list(Activation).index), repeat=num_stages))


def candidate_count(n: int, num_stages: int, activations: tuple[Activation, ...] = tuple(Activation)) -> int:
    """How many candidates `brute_force` would judge (before `admissible` removes any split)."""
    return math.comb(n - 1, num_stages - 1) * len(_policy_choices(num_stages, activations)) \
        if 1 <= num_stages <= n else 0


def _preferred(v: Verdict) -> tuple[float, int, Bounds, tuple[int, ...]]:
    return (v.step_s, max(v.peak_memory), v.candidate.bounds, order_key(v.candidate.activations))


def brute_force(a: UnitArrays, cluster: Cluster, schedule: ScheduleName, *, layout: Layout, m: int,
                microbatch_size: int = 1, activations: tuple[Activation, ...] | None = None,
                limit: int = DEFAULT_LIMIT, admissible: Callable[[Bounds], bool] | None = None) -> BruteForce:
    """The simulator's optimum for `schedule` on `layout` (its `v` stages per rank as `Candidate.layout`'s), `m`
    microbatches of `microbatch_size`, over every contiguous split of `a`'s units (those `admissible` accepts: e.g.
    the runner's refusals) and every per-stage choice among `activations` (None: every policy `a` has figures for).
    Raises ValueError when the candidates number more than `limit`, or when there are fewer units than stages."""
    stages = layout.stages
    if stages > a.n:
        raise ValueError(f"{a.n} units cannot fill {stages} stages (pp {layout.pp} x v {layout.v})")
    allowed = activations if activations is not None else \
        tuple(p for p in Activation if policy(p).offered(a, cluster.host_bandwidth))
    count = candidate_count(a.n, stages, allowed)
    if count > limit:
        raise ValueError(f"brute force over {a.n} units into {stages} stages ({len(allowed)} activation policies) "
                         f"would judge {count} candidates > limit {limit}; use fewer units or stages, or raise the "
                         "limit")
    choices = _policy_choices(stages, allowed)
    best: Verdict | None = None
    judged = 0
    for bounds in contiguous_splits(a.n, stages):
        if admissible is not None and not admissible(bounds):
            continue
        for policies in choices:
            verdict = judge(a, cluster, Candidate(schedule=schedule, layout=layout, microbatches=m,
                                                  microbatch_size=microbatch_size, bounds=bounds,
                                                  activations=policies))
            judged += 1
            if verdict.fits and (best is None or _preferred(verdict) < _preferred(best)):
                best = verdict
    return BruteForce(best, judged)
