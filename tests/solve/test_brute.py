"""The brute force over splits x per-stage recompute: counts, the single split of one unit per stage, never worse than
the DP's split judged the same way, per-stage recompute where only it fits cheaply, its refusal past the limit, and
the planner's mix of offload and recomputation against it."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from autopp.data.catalog import cluster_from_catalog, load_device
from autopp.data.cluster import Cluster, Link
from autopp.data.synthetic_profile import synthetic_profile
from autopp.costmodel import UnitArrays, unit_arrays
from autopp.data.layout import Layout, LayoutPins
from autopp.schedule import Activation, ScheduleName
from autopp.solve.partition.brute import brute_force, candidate_count, contiguous_splits
from autopp.solve.partition.dp import PipeSpec, pipeline_bounds
from autopp.errors import InfeasibleError
from autopp.solve import PlanRequest, RecomputeMode, make_plan
from autopp.solve.search.judge import Candidate, judge
from autopp.data.plan import Plan
from autopp.predict import simulate_plan

LINK = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e6)
ONE_F_ONE_B = ScheduleName.ONE_F_ONE_B
KEEP, RECOMPUTE, OFFLOAD = Activation.KEEP, Activation.RECOMPUTE, Activation.OFFLOAD
KEEP_ONLY, RECOMPUTE_ONLY = (KEEP,), (RECOMPUTE,)


def _arrays(f: list[float], activation: list[float], static: float = 100.0, cut: float = 10.0) -> UnitArrays:
    n = len(f)
    fw = np.array(f)
    return UnitArrays(fw, fw, fw, fw, np.full(n, static), np.array(activation), np.ones(n), np.ones(n),
                      np.array([0.0, *[cut] * (n - 1), 0.0]), True, 2 * fw)


def _random(seed: int, n: int) -> UnitArrays:
    rng = random.Random(seed)
    return _arrays([rng.uniform(0.1, 2.0) for _ in range(n)], [float(rng.randint(1, 100)) for _ in range(n)],
                   cut=float(rng.randint(0, 20)))


def _peaks(a: UnitArrays, cluster: Cluster, activations: tuple[Activation, ...], m: int) -> tuple[int, ...]:
    c = Candidate(schedule=ONE_F_ONE_B, layout=Layout(pp=2), microbatches=m, microbatch_size=1,
                  bounds=((0, 1), (1, 2)), activations=activations)
    return judge(a, cluster, c).peak_memory


def test_splits_are_every_contiguous_split_once() -> None:
    splits = list(contiguous_splits(6, 3))
    assert len(splits) == math.comb(5, 2) == len(set(splits))
    for bounds in splits:
        assert bounds[0][0] == 0 and bounds[-1][1] == 6
        assert all(i < j for i, j in bounds) and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))
    assert candidate_count(6, 3, (KEEP, RECOMPUTE)) == 10 * 8 and candidate_count(6, 3, KEEP_ONLY) == 10
    assert candidate_count(6, 3) == 10 * len(Activation) ** 3  # every policy


def test_one_unit_per_stage_has_exactly_one_split() -> None:
    a = _random(0, 4)
    cluster = Cluster(num_devices=4, memory_bytes=2**40, link=LINK)
    got = brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=4), m=4, activations=KEEP_ONLY)
    assert got.judged == 1 and got.best is not None
    assert got.best.candidate.bounds == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=4), m=4).judged == 3**4  # keep, both recomputes


@pytest.mark.parametrize("seed", range(3))
def test_never_worse_than_the_dp_split_judged_the_same_way(seed: int) -> None:
    a = _random(seed, 7)
    cluster = Cluster(num_devices=3, memory_bytes=2**40, link=LINK)
    dp = pipeline_bounds(a, PipeSpec(num_stages=3, microbatches=4, links=(LINK, LINK)))
    assert dp is not None
    split = judge(a, cluster, Candidate(schedule=ONE_F_ONE_B, layout=Layout(pp=3), microbatches=4, microbatch_size=1,
                                        bounds=dp, activations=(KEEP,) * 3))
    got = brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=3), m=4, activations=KEEP_ONLY)
    assert got.judged == math.comb(6, 2) and got.best is not None
    assert got.best.step_s <= split.step_s
    assert judge(a, cluster, got.best.candidate).step_s == got.best.step_s


def test_recomputes_only_the_stage_that_needs_it() -> None:
    # unit 0 holds 1000 bytes per microbatch and 1F1B's first stage holds 2 in flight; unit 1 holds 1
    a = _arrays([1.0, 1.0], [1000.0, 1.0])
    ample = Cluster(num_devices=2, memory_bytes=2**40, link=LINK)
    first_only = _peaks(a, ample, (RECOMPUTE, KEEP), 4)
    assert max(_peaks(a, ample, (KEEP, KEEP), 4)) > max(first_only)
    cluster = Cluster(num_devices=2, memory_bytes=max(first_only), link=LINK)
    assert brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=2), m=4, activations=KEEP_ONLY).best is None
    auto = brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=2), m=4).best
    every = brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=2), m=4, activations=RECOMPUTE_ONLY).best
    assert auto is not None and every is not None
    assert auto.candidate.activations == (RECOMPUTE, KEEP)
    assert auto.step_s < every.step_s


def test_admissible_leaves_splits_out_unjudged() -> None:
    a = _random(1, 5)
    cluster = Cluster(num_devices=2, memory_bytes=2**40, link=LINK)
    got = brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=2), m=2, activations=KEEP_ONLY,
                      admissible=lambda b: b[0] == (0, 2))
    assert got.judged == 1 and got.best is not None and got.best.candidate.bounds == ((0, 2), (2, 5))


def test_refuses_past_the_limit_and_too_many_stages() -> None:
    a = _random(2, 12)
    cluster = Cluster(num_devices=4, memory_bytes=2**40, link=LINK)
    with pytest.raises(ValueError, match="13365 candidates > limit 100"):
        brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=4), m=4, limit=100)
    with pytest.raises(ValueError, match="12 units cannot fill 16 stages"):
        brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=4, v=4), m=4)


def test_the_plan_offloads_one_stage_and_recomputes_another_as_the_brute_force_does() -> None:
    """Issue 27: four H100s (PCIe Gen5 host link, 64 GB/s each way) with 2.35 GiB each, a long-sequence profile.
    Stage 0 (4 microbatches in flight under 1F1B) must save the most; offloading it would still hold two
    microbatches' activations in its backward (the one brought back and the next: PipeOffload's double buffer),
    which does not fit, so it recomputes; stage 1 offloads, its trip to host memory hidden under the later stages'
    compute; the last two keep. The brute force over every split and every per-stage choice of keep, offload and
    recompute finds the same plan, and without offload (keep or recompute only) the best step is slower."""
    profile = synthetic_profile(6, hidden=2048, seq=8192)
    cluster = cluster_from_catalog(load_device("h100-sxm"), 4, memory_bytes=int(2.35 * 2**30))
    assert cluster.host_bandwidth == 64e9
    request = PlanRequest(cluster=cluster, global_batch=8, num_microbatches=8, schedule=ONE_F_ONE_B,
                          pins=LayoutPins(pp=4, dp=1, tp=1), recompute=RecomputeMode.AUTO)
    plan = make_plan(profile, request)
    assert [s.activation for s in plan.stages] == [RECOMPUTE, OFFLOAD, KEEP, KEEP]
    assert dict(plan.stages[1].own)[OFFLOAD].redo_s == 0.0  # hidden: nothing added to its backward
    a = unit_arrays(profile, 1)
    best = brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=4), m=8, activations=(KEEP, OFFLOAD, RECOMPUTE)).best
    assert best is not None and best.fits
    assert best.candidate.bounds == tuple(s.units for s in plan.stages)
    assert best.candidate.activations == tuple(s.activation for s in plan.stages)
    assert best.step_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    without = brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=4), m=8, activations=(KEEP, RECOMPUTE)).best
    assert without is not None and without.step_s > best.step_s


def test_the_plan_recomputes_unit_by_unit_where_whole_stage_recomputation_does_not_fit() -> None:
    """Issue 24's per-unit policy: two CPU ranks of 4.5 GiB, a long-sequence profile of 8 units, 1F1B with 4
    microbatches. Recomputing a whole stage still holds all its units' activations during its backward, so no split
    fits with keep and whole-stage recomputation; recomputing stage 0 unit by unit (each unit's input kept, one unit's
    activations at a time) fits, at the same time as whole-stage recomputation would add. The brute force over every
    split and every per-stage choice of keep, recompute and recompute-units finds the same plan."""
    profile = synthetic_profile(8, hidden=2048, seq=8192)
    cluster = Cluster(num_devices=2, memory_bytes=int(4.5 * 2**30))
    policies = (KEEP, RECOMPUTE, Activation.BLOCKS)

    def request(activations: tuple[Activation, ...]) -> PlanRequest:
        return PlanRequest(cluster=cluster, global_batch=4, num_microbatches=4, schedule=ONE_F_ONE_B,
                           pins=LayoutPins(pp=2, dp=1, tp=1), activations=activations)
    with pytest.raises(InfeasibleError, match=r"^no split of 8 units fits in 4\.5 GiB per device on 2 devices"):
        make_plan(profile, request((KEEP, RECOMPUTE)))
    plan = make_plan(profile, request(policies))
    assert [s.activation for s in plan.stages] == [Activation.BLOCKS, KEEP] and plan.predicted.fits
    a = unit_arrays(profile, 1)
    i, j = plan.stages[0].units
    figures = dict(plan.stages[0].own)[Activation.BLOCKS]  # each unit's input, the largest unit's activations
    assert (figures.kept_bytes, figures.redone_bytes) == (int(a.cut[i:j].sum()), int(a.activation[i:j].max()))
    assert dict(plan.stages[1].own) == {}  # a stage carries its own policy's figures only
    best = brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=2), m=4, activations=policies).best
    assert best is not None and best.fits
    assert best.candidate.bounds == tuple(s.units for s in plan.stages)
    assert best.candidate.activations == tuple(s.activation for s in plan.stages)
    assert best.step_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)


@pytest.mark.parametrize("memory, want", [(5.5, (Activation.SELECTIVE_UNITS, KEEP)),
                                          (4.2, (Activation.BLOCKS, Activation.SELECTIVE_UNITS))])
def test_the_plan_recomputes_selectively_unit_by_unit_where_whole_stage_selective_does_not_fit(
        memory: float, want: tuple[Activation, ...]) -> None:
    """Issue 25 item 2 as the trainers run it: the profile of the test above with its selective columns, two CPU
    ranks, 1F1B with 4 microbatches. Stage-level selective recomputation re-materialises all of a stage's
    non-matmul activations at once in its backward, so no split fits with keep and selective; checkpointing each
    unit under the selective policy (each unit's input and saved ops' outputs kept, one unit re-materialised at a
    time) fits, at selective recomputation's time, faster than any full recomputation; tighter, a stage recomputes
    unit by unit and the other selectively unit by unit. The brute force over every split and every per-stage choice
    of every offered policy (keep, recompute, selective, recompute-units, selective-units) finds the same plan."""
    profile = synthetic_profile(8, hidden=2048, seq=8192, selective=True)
    cluster = Cluster(num_devices=2, memory_bytes=int(memory * 2**30))

    def request(**kw: object) -> PlanRequest:
        return PlanRequest(cluster=cluster, global_batch=4, num_microbatches=4, schedule=ONE_F_ONE_B,
                           pins=LayoutPins(pp=2, dp=1, tp=1), **kw)  # type: ignore[arg-type]
    with pytest.raises(InfeasibleError, match=rf"^no split of 8 units fits in {memory:g} GiB per device on 2 devices"):
        make_plan(profile, request(activations=(KEEP, Activation.SELECTIVE)))
    plan = make_plan(profile, request(recompute=RecomputeMode.AUTO))
    assert tuple(s.activation for s in plan.stages) == want and plan.predicted.fits
    a = unit_arrays(profile, 1)
    s = next(s for s in plan.stages if s.activation is Activation.SELECTIVE_UNITS)
    kept, redo = a.own[Activation.SELECTIVE]
    i, j = s.units
    figures = dict(s.own)[Activation.SELECTIVE_UNITS]  # inputs and saved outputs; the largest unit's rest
    assert figures.kept_bytes == int(kept[i:j].sum() + a.cut[i:j].sum())
    assert figures.redone_bytes == int((a.activation[i:j] - kept[i:j]).max())
    assert figures.redo_s == pytest.approx(float(redo[i:j].sum()), rel=1e-12)
    written = plan.to_json()["stages"][plan.stages.index(s)]  # the plan JSON's fields, read back as planned
    assert (written["selective-units_bytes"], written["selective-units_redone_bytes"]) == (figures.kept_bytes,
                                                                                         figures.redone_bytes)
    back = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert back == plan and simulate_plan(back).peak_memory_bytes == list(plan.predicted.peak_memory_bytes)
    best = brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=2), m=4)
    assert best.judged == 7 * 5**2 and best.best is not None and best.best.fits
    assert best.best.candidate.bounds == tuple(s.units for s in plan.stages)
    assert best.best.candidate.activations == want
    assert best.best.step_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    without = brute_force(a, cluster, ONE_F_ONE_B, layout=Layout(pp=2), m=4,
                          activations=tuple(p for p in Activation if p not in (Activation.SELECTIVE_UNITS,
                                                                               Activation.OFFLOAD))).best
    assert without is None or without.step_s > best.best.step_s
