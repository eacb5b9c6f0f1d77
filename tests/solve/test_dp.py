"""The pipeline DP equals brute force over every contiguous split, each split's objective and memory worked out here
from the unit arrays (not through the DP's tables); and the DP's small helpers."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest

from autopp.data.cluster import Link
from autopp.costmodel import UnitArrays
from autopp.schedule import Activation
from autopp.solve.partition.dp import PipeSpec, even_bounds, feasible, fits, min_memory, pipeline_bounds

from ..conftest import seeds

LINK = Link(latency_s=0.01, bandwidth_bytes_per_s=1000.0)


def _random_arrays(rng: random.Random, n: int) -> UnitArrays:
    f = np.array([rng.uniform(0.1, 2) for _ in range(n)])
    b = np.array([rng.uniform(0.1, 4) for _ in range(n)])
    i = np.array([rng.uniform(0.05, 2.5) for _ in range(n)])
    redo = np.array([rng.uniform(0.1, 2) for _ in range(n)])
    static = np.array([float(rng.randint(0, 500)) for _ in range(n)])
    act = np.array([float(rng.randint(0, 100)) for _ in range(n)])
    cut = np.array([0.0, *[float(rng.randint(0, 200)) for _ in range(n - 1)], 0.0])
    return UnitArrays(f, i, b - i / 2, redo, static, act, np.ones(n), np.ones(n), cut, False, b)


def _all_bounds(n: int, p: int):  # type: ignore[no-untyped-def]
    for cuts in itertools.combinations(range(1, n), p - 1):
        ends = (0, *cuts, n)
        yield tuple(zip(ends, ends[1:]))


def _objective(a: UnitArrays, spec: PipeSpec, bounds: tuple[tuple[int, int], ...]) -> float:
    """sum_s (T_s + 2 c_s) + (m - 1) max_s T_s; T_s = (F + min(B, I + W) (+ recompute)) / speed over the stage's
    units, c_s = latency + cut bytes / bandwidth after every stage but the last."""
    speed = spec.speed or (1.0,) * spec.num_stages
    redo = spec.activation is Activation.RECOMPUTE
    times = [sum(float(a.forward[u]) + min(float(a.backward[u]), float(a.backward_input[u] + a.backward_weight[u]))
                 + (float(a.recompute[u]) if redo else 0.0) for u in range(i, j)) / sp
             for (i, j), sp in zip(bounds, speed)]
    sends = [LINK.latency_s + float(a.cut[j]) / LINK.bandwidth_bytes_per_s if a.cut[j] > 0 else 0.0
             for _, j in bounds[:-1]]
    return sum(times) + 2 * sum(sends) + (spec.microbatches - 1) * max(times)


def _memory(a: UnitArrays, spec: PipeSpec, bounds: tuple[tuple[int, int], ...]) -> list[float]:
    """Per stage: static bytes + held microbatches x activation bytes (held = in-flight count, 1 if recomputing) +
    the largest transient of its units + in-flight count x its output (the bytes crossing its end)."""
    inflight = spec.inflight or (1,) * spec.num_stages
    redo = spec.activation is Activation.RECOMPUTE
    return [float(a.static[i:j].sum()) + (1 if redo else k) * float(a.activation[i:j].sum())
            + float(a.transient_bytes()[i:j].max(initial=0.0)) + k * float(a.cut[j])
            for (i, j), k in zip(bounds, inflight)]


def _with_transients(a: UnitArrays, seed: int) -> UnitArrays:
    """Random working memory, 0 for some units, on the scale of the static bytes."""
    rng = random.Random(seed)
    return replace(a, transient=np.array([float(rng.choice([0, rng.randint(1, 600)])) for _ in range(a.n)]))


def _spec(rng: random.Random, n: int, limit: float = float("inf")) -> PipeSpec:
    p = rng.randint(1, min(n, 4))
    return PipeSpec(num_stages=p, microbatches=rng.randint(1, 8),
                    activation=Activation.RECOMPUTE if rng.random() < 0.3 else Activation.KEEP,
                    speed=tuple(rng.choice([0.5, 1.0, 2.0]) for _ in range(p)),
                    memory=(limit,) * p if np.isfinite(limit) else (),
                    inflight=tuple(min(p - s, 8) for s in range(p)), links=(LINK,) * (p - 1))


@pytest.mark.parametrize("working", [False, True], ids=["held", "transient"])
@pytest.mark.parametrize("seed", seeds(40))
def test_dp_equals_brute_force(seed: int, working: bool) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    a, spec = _random_arrays(rng, n), _spec(rng, n, float(rng.randint(200, 2500)))
    a = _with_transients(a, seed) if working else a
    splits = list(_all_bounds(n, spec.num_stages))
    feasible = [b for b in splits if max(_memory(a, spec, b)) <= spec.memory[0]]
    got = pipeline_bounds(a, spec)
    if not feasible:
        assert got is None
        return
    assert got is not None and max(_memory(a, spec, got)) <= spec.memory[0]
    assert _objective(a, spec, got) == pytest.approx(min(_objective(a, spec, b) for b in feasible), rel=1e-12)


@pytest.mark.parametrize("seed", seeds(20))
def test_uncut_boundaries_equal_brute_force_without_them(seed: int) -> None:
    """`PipeSpec.uncut` (no stage ends there; 0 and n ignored): the DP's optimum is the brute force's over the
    splits that avoid them, or None when none does."""
    rng = random.Random(2000 + seed)
    n = rng.randint(2, 9)
    a, spec = _random_arrays(rng, n), _spec(rng, n)
    uncut = tuple(rng.sample(range(0, n + 1), rng.randint(1, n)))
    allowed = [b for b in _all_bounds(n, spec.num_stages) if not {j for _, j in b[:-1]} & set(uncut)]
    got = pipeline_bounds(a, replace(spec, uncut=uncut))
    if not allowed:
        assert got is None
        return
    assert got is not None and not {j for _, j in got[:-1]} & set(uncut)
    assert _objective(a, spec, got) == pytest.approx(min(_objective(a, spec, b) for b in allowed), rel=1e-12)


def test_uncut_keeps_a_free_end_unit_from_being_a_stage() -> None:
    """A free first unit (the embedding under vocabulary parallelism) is the best first stage of one microbatch
    on two stages; with its boundary uncut the first stage takes it and the next unit."""
    rng = random.Random(7)
    a = _random_arrays(rng, 5)
    a = replace(a, forward=np.array([0.0, *a.forward[1:]]), backward=np.array([0.0, *a.backward[1:]]),
                backward_input=np.array([0.0, *a.backward_input[1:]]), cut=np.zeros(6))
    spec = PipeSpec(num_stages=2, microbatches=1)
    assert pipeline_bounds(a, spec) == ((0, 1), (1, 5))
    assert pipeline_bounds(a, replace(spec, uncut=(1,))) == ((0, 2), (2, 5))


@pytest.mark.parametrize("working", [False, True], ids=["held", "transient"])
@pytest.mark.parametrize("seed", seeds(20))
def test_min_memory_equals_brute_force(seed: int, working: bool) -> None:
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 9)
    a, spec = _random_arrays(rng, n), _spec(rng, n)
    a = _with_transients(a, seed) if working else a
    assert min_memory(a, spec) == min(max(_memory(a, spec, b)) for b in _all_bounds(n, spec.num_stages))


def test_even_bounds() -> None:
    assert even_bounds(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert even_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_heavy_unit_gets_its_own_stage() -> None:
    f = np.array([1.0] * 5 + [5.0])
    a = UnitArrays(f, f, f, f, np.zeros(6), np.zeros(6), np.zeros(6), np.zeros(6), np.zeros(7), False, 2 * f)
    assert pipeline_bounds(a, PipeSpec(num_stages=2, microbatches=8, links=(LINK,))) == ((0, 5), (5, 6))


def test_a_units_transient_makes_a_split_that_fits_without_it_infeasible() -> None:
    f = np.ones(4)
    a = UnitArrays(f, f, f, f, np.full(4, 100.0), np.full(4, 10.0), np.zeros(4), np.zeros(4), np.zeros(5), False, 2 * f)
    spec = PipeSpec(num_stages=2, microbatches=4, inflight=(2, 1), memory=(240.0, 240.0))
    # 2 units a stage: 200 + 2 x 20 = 240 and 200 + 20 = 220 bytes
    assert pipeline_bounds(a, spec) == ((0, 2), (2, 4)) and min_memory(a, spec) == 240
    working = replace(a, transient=np.array([0.0, 1.0, 0.0, 0.0]))  # one byte of temporaries in unit 1
    assert not fits(working, spec, ((0, 2), (2, 4))) and not feasible(working, spec)
    assert pipeline_bounds(working, spec) is None and min_memory(working, spec) == 241
    assert fits(working, replace(spec, memory=(241.0, 241.0)), ((0, 2), (2, 4)))


def test_a_stage_whose_outputs_alone_exceed_its_budget_ends_nowhere() -> None:
    """The published script: with units' transients, a cut whose kept outputs (in-flight x its bytes) exceed the
    budget made the first-fit search index past the prefix sums. Such an end is infeasible, and the split avoids it."""
    f = np.ones(4)
    a = UnitArrays(f, f, f, f, np.full(4, 10.0), np.full(4, 10.0), np.zeros(4), np.zeros(4),
                   np.array([0.0, 500.0, 1.0, 1.0, 0.0]), False, 2 * f)
    a = replace(a, transient=np.array([1.0, 0.0, 0.0, 0.0]))
    spec = PipeSpec(num_stages=2, microbatches=4, inflight=(2, 1), memory=(100.0, 100.0))
    assert feasible(a, spec) and pipeline_bounds(a, spec) in (((0, 2), (2, 4)), ((0, 3), (3, 4)))
    assert not fits(a, spec, ((0, 1), (1, 4)))  # stage 0 ending at 1 keeps 2 x 500 bytes of outputs
