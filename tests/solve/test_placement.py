"""CP-SAT's device order for heterogeneous clusters: no fixed order beats it, and the planner uses it."""

from __future__ import annotations

import itertools
import random

import pytest

from autopp.data.cluster import Cluster, Device, Link
from autopp.errors import InfeasibleError
from autopp.data.layout import LayoutPins
from autopp.schedule import Activation, ScheduleName
from autopp.solve import PlanRequest, make_plan
from autopp.solve.partition.dp import PipeSpec, pipeline_bounds, pipeline_objective
from autopp.solve.cpsat.placement import place_devices
from autopp.data.synthetic_profile import synthetic_profile
from tests.solve.test_exact import _arrays

GiB = 2**30


def _cluster(rng: random.Random, p: int) -> Cluster:
    devices = tuple(Device(memory_bytes=rng.randint(400, 3000), speed=rng.choice([0.5, 1.0, 2.0])) for _ in range(p))
    links = tuple(Link(latency_s=0.0, bandwidth_bytes_per_s=rng.choice([1e6, 1e7])) for _ in range(p - 1))
    return Cluster(num_devices=p, memory_bytes=min(d.memory_bytes for d in devices), devices=devices, links=links,
                   link=Link(latency_s=0.0, bandwidth_bytes_per_s=2e5))


def _spec(cluster: Cluster, m: int, inflight: tuple[int, ...]) -> PipeSpec:
    p = cluster.num_devices
    return PipeSpec(num_stages=p, microbatches=m, speed=tuple(cluster.device(r).speed for r in range(p)),
                    memory=tuple(float(cluster.device(r).memory_bytes) for r in range(p)), inflight=inflight,
                    links=tuple(cluster.link_between(r, r + 1) for r in range(p - 1)))


@pytest.mark.parametrize("seed", range(8))
def test_cpsat_order_beats_every_fixed_order(seed: int) -> None:
    rng = random.Random(300 + seed)
    p, n, m = rng.randint(2, 3), rng.randint(4, 7), rng.randint(1, 6)
    a, cluster = _arrays(rng, n, integer=True), _cluster(rng, p)
    inflight = tuple(min(p - s, m) for s in range(p))
    best = None  # brute force: the DP (exact for a fixed order) on every permutation of the devices
    for order in itertools.permutations(range(p)):
        spec = _spec(cluster.reordered(order), m, inflight)
        found = pipeline_bounds(a, spec)
        if found is not None:
            value = pipeline_objective(a, spec, found)
            best = value if best is None else min(best, value)
    if best is None:
        with pytest.raises(InfeasibleError, match="proved that no order"):
            place_devices(a, cluster, m, inflight, Activation.KEEP)
        return
    got = place_devices(a, cluster, m, inflight, Activation.KEEP)
    assert got.status == "OPTIMAL" and got.gap == 0.0 and sorted(got.order) == list(range(p))
    spec = _spec(cluster.reordered(got.order), m, inflight)
    assert pipeline_objective(a, spec, got.bounds) == pytest.approx(best, rel=1e-9)
    assert got.objective_s == pytest.approx(best, abs=2 * p * 1e-6)  # transfers rounded to the 1 us resolution


def test_planner_reorders_devices_the_file_order_cannot_fit() -> None:
    # 1F1B holds 3 microbatches on stage 1: no block fits the small device there, but the embedding or the head
    # (half a block) fits it at either end. The DP on the file's order finds nothing; CP-SAT's order does.
    small, big = Device(memory_bytes=int(3.6e9)), Device(memory_bytes=80 * GiB)
    cluster = Cluster(num_devices=4, memory_bytes=small.memory_bytes, devices=(big, small, big, big),
                      link=Link(latency_s=1e-5, bandwidth_bytes_per_s=5e10))
    profile = synthetic_profile(12)
    request = PlanRequest(cluster=cluster, global_batch=16, num_microbatches=16)
    from autopp.solve.search.search import search
    assert search(profile, request)[0] is None
    plan = make_plan(profile, request)
    note = next(n for n in plan.notes if n.startswith("device order chosen by CP-SAT"))
    assert "OPTIMAL, gap 0.0%" in note and [s.rank for s in plan.stages] == [0, 1, 2, 3]
    order = tuple(int(x.split("device ")[1]) for x in note.split("cluster file: ")[1].split(", "))
    assert order.index(1) in (0, 3)  # the small device runs the embedding or the head
    placed = cluster.reordered(order)
    assert all(pk <= placed.device(r).memory_bytes for r, pk in enumerate(plan.predicted.peak_memory_bytes))


def test_a_plan_of_several_stages_per_rank_says_it_kept_the_files_order() -> None:
    """A tester: on a mixed cluster the search chose 2 stages per rank, CP-SAT's placement (one stage per rank) was
    skipped, and the plan said nothing of its device order, where docs/planner.md promises a note."""
    cluster = Cluster(num_devices=4, memory_bytes=80 * GiB,
                      devices=(Device(memory_bytes=80 * GiB), Device(memory_bytes=40 * GiB, speed=0.5),
                               Device(memory_bytes=80 * GiB), Device(memory_bytes=80 * GiB)),
                      link=Link(latency_s=1e-5, bandwidth_bytes_per_s=5e10))
    plan = make_plan(synthetic_profile(12), PlanRequest(cluster=cluster, global_batch=16, num_microbatches=8,
                                                        schedule=ScheduleName.INTERLEAVED_1F1B,
                                                        pins=LayoutPins(v=2)))
    assert plan.layout.v == 2
    assert "device order: the cluster file's, kept (CP-SAT places devices for one stage per rank, and the plan " \
        "runs 2 per rank)" in plan.notes
