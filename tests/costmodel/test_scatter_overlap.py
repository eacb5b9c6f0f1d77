"""ZeRO 2's per-microbatch reduce-scatter overlapped with the stage's backward unit by unit, the stage's first unit's
on the rank's reduce-scatter stream (issues 25 and 27; autopp.costmodel.parallel.scatter_in_backward,
`UnitArrays.stage_start` and `stage_scatter`): hand-checked figures, the stage boundary, the split's DP and CP-SAT
against brute force, and a plan that is faster by what it hides."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel import UnitArrays, data_sharded, scatter_in_backward, stage_costs
from autopp.data.cluster import Cluster, Link
from autopp.data.layout import Layout, LayoutPins
from autopp.data.overlap import NO_OVERLAP, TRAINER_OVERLAP, Overlap
from autopp.data.synthetic_profile import synthetic_profile
from autopp.data.zero import ZERO
from autopp.solve import PlanRequest, make_plan
from autopp.solve.cpsat.split import solve_cpsat
from autopp.solve.partition.dp import PipeSpec, pipeline_bounds, pipeline_objective

from .arrays import arrays

GiB = 2**30
#: Per unit: F = 1, so B = 2 (I = W = 1); each unit's reduce-scatter.
SCATTER = np.array([1.0, 3.0, 0.5, 1.5])


def _overlapped(overlap: Overlap = TRAINER_OVERLAP) -> UnitArrays:
    return scatter_in_backward(replace(arrays([1.0] * 4), overlap=overlap), SCATTER)[0]


def test_each_units_scatter_hides_under_the_backward_of_the_unit_before_it() -> None:
    """Unit u's scatter under unit u - 1's backward (2 s): hidden min(RS_u, 2) = 0, 2, 0.5, 1.5; unit 0 has none
    before it: charged 1, 1, 0, 0, in W and B; a stage starting at unit i takes unit i's charge off and runs its
    whole scatter on the rank's stream."""
    a, shown = scatter_in_backward(replace(arrays([1.0] * 4), overlap=TRAINER_OVERLAP), SCATTER)
    assert np.allclose(shown, [1.0, 1.0, 0.0, 0.0])
    assert np.allclose(a.backward, [3.0, 3.0, 2.0, 2.0]) and np.allclose(a.backward_weight, [2.0, 2.0, 1.0, 1.0])
    assert np.array_equal(a.backward_input, np.ones(4)) and np.array_equal(a.forward, np.ones(4))
    assert a.stage_start is not None and np.allclose(a.stage_start, [-1.0, -1.0, 0.0, 0.0])
    assert a.stage_scatter is not None and np.array_equal(a.stage_scatter, SCATTER)


def test_a_stage_streams_its_first_units_whole_scatter_and_hides_nothing_under_another_stage() -> None:
    """Stages [0, 2) and [2, 4): stage 0 runs unit 0's 1 s on the stream and exposes unit 1's 3 - 2 s (B 4 + 1);
    stage 1 runs its first unit's 0.5 s on the stream, unit 3's 1.5 s hides under unit 2's 2 s (B 4, W 2, I 2); the
    per-unit sum alone would have hidden unit 2's scatter under unit 1's backward, on the other stage."""
    costs = stage_costs(_overlapped(), [(0, 2), (2, 4)], [1.0, 1.0])
    assert [c.backward_s for c in costs] == pytest.approx([5.0, 4.0])
    assert [c.backward_weight_s for c in costs] == pytest.approx([5.0, 2.0])  # stage 0: W is its full B
    assert costs[1].backward_input_s == pytest.approx(2.0)
    assert [c.scatter_s for c in costs] == pytest.approx([1.0, 0.5])
    # one stage of all four: unit 0's scatter on the stream, what unit 1's exceeds unit 0's backward exposed
    whole = stage_costs(_overlapped(), [(0, 4)], [1.0])[0]
    assert whole.backward_s == pytest.approx(8.0 + 1.0) and whole.scatter_s == pytest.approx(1.0)
    # at half speed every time doubles, the streamed scatter too (as the scatters charged to B are)
    slow = stage_costs(_overlapped(), [(0, 2), (2, 4)], [1.0, 0.5])[1]
    assert slow.backward_s == pytest.approx(8.0) and slow.scatter_s == pytest.approx(1.0)


def test_without_fsdp_prefetch_every_scatter_is_exposed_as_before() -> None:
    a, shown = scatter_in_backward(arrays([1.0] * 4), SCATTER)  # arrays() carry NO_OVERLAP
    assert a.stage_start is None and a.stage_scatter is None and np.array_equal(shown, SCATTER)
    assert np.allclose(a.backward, 2.0 + SCATTER) and np.allclose(a.backward_weight, 1.0 + SCATTER)
    costs = stage_costs(a, [(0, 2), (2, 4)], [1.0, 1.0])
    assert [c.backward_s for c in costs] == pytest.approx([8.0, 6.0]) and all(c.scatter_s == 0 for c in costs)


@pytest.mark.parametrize("overlap", [NO_OVERLAP, TRAINER_OVERLAP])
def test_zero_2_under_a_pipeline_reports_total_and_exposed_seconds(overlap: Overlap) -> None:
    """data_sharded at pp 2, dp 4, ZeRO 2: `zero_seconds` = (every scatter, the per-unit exposed part); without the
    switch both are the scatters and the arrays those of the plain sum (the figures before the overlap)."""
    base = replace(arrays([1.0] * 4, static=[32.0] * 4, grads=[4.0, 12.0, 2.0, 6.0]), overlap=overlap)
    out = data_sharded(base, Layout(pp=2, dp=4, zero=ZERO[2]).unit_view(), lambda s: s / 2)  # scatter = g / 4
    assert out.zero_seconds is not None
    total, exposed = out.zero_seconds
    assert np.allclose(total, SCATTER)
    if overlap.fsdp_prefetch:
        assert np.allclose(exposed, [1.0, 1.0, 0.0, 0.0]) and out.stage_scatter is not None
        assert out.stage_start is not None and np.allclose(out.stage_start, [-1.0, -1.0, 0.0, 0.0])
    else:
        assert np.array_equal(exposed, total) and out.stage_start is None
        assert np.array_equal(out.backward, base.backward + SCATTER)
    assert np.allclose(out.backward - base.backward, exposed)


def _random(seed: int, n: int = 8) -> UnitArrays:
    rng = np.random.default_rng(seed)
    a = replace(arrays(list(rng.uniform(0.5, 2.0, n))), overlap=TRAINER_OVERLAP)
    return scatter_in_backward(a, rng.uniform(0.0, 4.0, n))[0]


def _objective(a: UnitArrays, bounds: tuple[tuple[int, int], ...], m: int) -> float:
    times = [float(a.work()[i:j].sum()) + a.start_s(i) for i, j in bounds]
    return sum(times) + (m - 1) * max(times)


def _splits(n: int, s: int) -> list[tuple[tuple[int, int], ...]]:
    return [tuple(zip((0, *cuts), (*cuts, n))) for cuts in itertools.combinations(range(1, n), s - 1)]


@pytest.mark.parametrize("seed", range(4))
def test_the_splits_dp_and_cp_sat_charge_each_stage_its_first_units_scatter(seed: int) -> None:
    """The DP (and CP-SAT) see a stage [i, j) as its units' work + `stage_start[i]`, the simulator's figure: their
    optimum is the brute force's over every split."""
    a, spec = _random(seed), PipeSpec(num_stages=3, microbatches=4)
    assert np.all(np.diff(a.starts(a.work())) >= 0)  # the DP's feasible starts stay an interval
    best = min(_objective(a, b, 4) for b in _splits(a.n, 3))
    found = pipeline_bounds(a, spec)
    assert found is not None and _objective(a, found, 4) == pytest.approx(best)
    assert pipeline_objective(a, spec, found) == pytest.approx(best)
    cpsat = solve_cpsat(a, spec, resolution=1e-4)
    assert cpsat.optimal and _objective(a, cpsat.bounds, 4) == pytest.approx(best, abs=1e-2)


def test_the_first_units_scatter_moves_the_best_split() -> None:
    """Where each stage's first-unit scatter runs on the stream (ZeRO 2 + fsdp_prefetch), the best split by the
    brute force is not the one that charges every unit its scatter in the stage (the per-unit sums alone) for some
    of these profiles at pp 2 and 3, and the DP (and CP-SAT, on the first such profile) finds the brute force's."""
    moved = 0
    for seed, stages in itertools.product(range(6), (2, 3)):
        a = _random(seed)
        plain = replace(a, stage_start=None)
        best = min(_splits(a.n, stages), key=lambda b: _objective(a, b, 4))
        naive = min(_splits(a.n, stages), key=lambda b: _objective(plain, b, 4))
        matters = _objective(a, naive, 4) > _objective(a, best, 4) + 1e-9
        spec = PipeSpec(num_stages=stages, microbatches=4)
        found = pipeline_bounds(a, spec)
        assert found is not None and _objective(a, found, 4) == pytest.approx(_objective(a, best, 4))
        if matters and not moved:  # CP-SAT too, once, where it matters
            cpsat = solve_cpsat(a, spec, resolution=1e-4)
            assert cpsat.optimal and _objective(a, cpsat.bounds, 4) == pytest.approx(_objective(a, best, 4), abs=1e-2)
        moved += matters
    assert moved > 0


def _plan(overlap: Overlap) -> tuple[float, float, float, tuple[tuple[int, int], ...]]:
    """Step, mean busy seconds of a rank, mean hidden ZeRO seconds of a rank, and the split of a pinned pp 2 x dp 2
    ZeRO 2 plan (grad_reduce off: the step's end stays exposed either way)."""
    quiet = Link(latency_s=1e-5, bandwidth_bytes_per_s=1e10)
    plan = make_plan(synthetic_profile(10), PlanRequest(
        cluster=Cluster(num_devices=4, memory_bytes=80 * GiB, link=quiet), global_batch=16, num_microbatches=8,
        pins=LayoutPins(pp=2, dp=2, zero=ZERO[2]), overlap=overlap))
    b = plan.time_breakdown
    assert b is not None
    pp = plan.layout.pp
    return (plan.predicted.step_time_s, sum(s.busy_s for s in b.stages) / pp,
            sum(s.zero_hidden_s for s in b.stages) / pp, tuple(s.units for s in plan.stages))


def test_a_pipelined_zero_2_plan_is_faster_by_what_the_overlap_hides() -> None:
    on_step, on_busy, hidden, on_split = _plan(Overlap(fsdp_prefetch=True, grad_reduce=False))
    off_step, off_busy, none, off_split = _plan(Overlap(fsdp_prefetch=False, grad_reduce=False))
    assert none == 0 and hidden > 0 and on_split == off_split
    assert off_busy - on_busy == pytest.approx(hidden, rel=1e-9)  # each rank's busy time less what it hides
    assert off_step - on_step >= hidden * (1 - 1e-9)  # and the bubble does not grow
