"""The dynamic program equals brute force over every contiguous split, on small random profiles."""

from __future__ import annotations

import itertools
import random

import pytest

from autopp.cluster import Link
from autopp.profile import UnitCost
from autopp.solve.dp import best_split, even_bounds, evaluate_split, min_peak_memory

LINK = Link(latency_s=0.01, bandwidth_bytes_per_s=1000.0)


def _random_units(rng: random.Random, n: int) -> tuple[list[UnitCost], list[int]]:
    units = [UnitCost(rng.uniform(0.1, 2), rng.uniform(0.1, 4), 0, rng.randint(0, 500), rng.randint(0, 100), 0)
             for _ in range(n)]
    cuts = [rng.randint(0, 200) for _ in range(n - 1)]
    return units, cuts


def _all_bounds(n: int, p: int):  # type: ignore[no-untyped-def]
    for cuts in itertools.combinations(range(1, n), p - 1):
        ends = (0, *cuts, n)
        yield list(zip(ends, ends[1:]))


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    p, m = rng.randint(1, min(n, 4)), rng.randint(1, 8)
    units, cuts = _random_units(rng, n)
    limit = rng.randint(200, 2500)
    splits = [evaluate_split(units, cuts, LINK, b, m) for b in _all_bounds(n, p)]
    feasible = [s for s in splits if max(s.peak_memory) <= limit]
    got = best_split(units, cuts, LINK, p, m, limit)
    if not feasible:
        assert got is None
        return
    assert got is not None
    best = min(feasible, key=lambda s: (s.step_s, max(s.peak_memory)))
    assert got.step_s == pytest.approx(best.step_s, rel=1e-12)
    assert max(got.peak_memory) <= limit
    assert min_peak_memory(units, cuts, LINK, p, m) == min(max(s.peak_memory) for s in splits)


def test_even_bounds() -> None:
    assert even_bounds(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert even_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_heavy_unit_gets_its_own_stage() -> None:
    units = [UnitCost(1.0, 2.0, 0, 0, 0, 0)] * 5 + [UnitCost(5.0, 10.0, 0, 0, 0, 0)]
    got = best_split(units, [0] * 5, LINK, 2, 8, 10**9)
    assert got is not None and got.bounds == ((0, 5), (5, 6))
