"""The search's pruning is exact: bounds never exceed an estimate, order walks equal the simulator's peaks, and the
pruned short-list equals the one found by visiting every configuration."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from autopp.cluster import Cluster, Device, Link
from autopp.schedule import ScheduleName, build_schedule, simulate
from autopp.solve.arrays import unit_arrays
from autopp.solve.bounds import lower_bound
from autopp.solve.judge import comm_times, order_peaks, stage_costs
from autopp.solve.search import (PlanRequest, RecomputeMode, _bounds, _candidate, _estimate, _fitted, _options,
                                 _Splits, configs)
from autopp.solve.synthetic import synthetic_profile

GiB = 2**30


def _cluster(rng: random.Random, hetero: bool) -> Cluster:
    link = Link(latency_s=rng.choice([0.0, 1e-5]), bandwidth_bytes_per_s=rng.choice([1e9, 5e10]),
                overhead_s=rng.choice([0.0, 3e-4]))
    if not hetero:
        return Cluster(num_devices=4, memory_bytes=int(rng.uniform(6, 40) * GiB), link=link)
    devices = tuple(Device(memory_bytes=int(rng.uniform(6, 40) * GiB), speed=rng.choice([0.5, 1.0, 2.0]))
                    for _ in range(4))
    return Cluster(num_devices=4, memory_bytes=min(d.memory_bytes for d in devices), link=link, devices=devices,
                   links=tuple(Link(latency_s=1e-5, bandwidth_bytes_per_s=rng.choice([1e9, 5e10])) for _ in range(3)))


def _random_split(rng: random.Random, n: int, s: int) -> tuple[tuple[int, int], ...]:
    ends = [0, *sorted(rng.sample(range(1, n), s - 1)), n]
    return tuple(zip(ends, ends[1:]))


@pytest.mark.parametrize("seed", range(8))
def test_lower_bound_never_exceeds_an_estimate(seed: int) -> None:
    rng = random.Random(seed)
    profile = synthetic_profile(14, seed=seed, jitter=0.4)
    req = PlanRequest(cluster=_cluster(rng, hetero=seed % 2 == 1), global_batch=8, schedule=None,
                      dp=None if seed % 2 == 0 else 1)
    for c in configs(req, profile.num_units):
        a = unit_arrays(profile, c.b)
        if seed % 4 >= 2:  # split passes measured apart from B (I + W above or below B), an optimizer step
            scale = np.array([rng.uniform(0.5, 1.6) for _ in range(a.n)])
            a = replace(a, backward_input=a.backward_input * scale, backward_weight=a.backward_weight * scale[::-1],
                        optimizer=a.backward * 0.1)
        for rc in (False, True):
            bound = lower_bound(a, req, c, rc)
            for _ in range(3):  # any split, not only the DP's
                split = _random_split(rng, a.n, c.pp * c.v)
                assert bound <= _estimate(a, req, c, split, rc) * (1 + 1e-12), (c, rc, split)


@pytest.mark.parametrize("name", list(ScheduleName))
def test_order_walk_equals_simulated_peaks(name: ScheduleName) -> None:
    rng = random.Random(name.value)
    a = unit_arrays(synthetic_profile(16), 2)
    v = {ScheduleName.GPIPE: 1, ScheduleName.ONE_F_ONE_B: 1}.get(name, 2)
    order = build_schedule(name, 4, 8, v)
    from autopp.schedule import stage_to_rank
    owner = stage_to_rank(name, 4, v)
    bounds = _random_split(rng, a.n, len(owner))
    costs = stage_costs(a, bounds, [1.0] * len(owner))
    for _ in range(3):
        flags = [rng.random() < 0.5 for _ in owner]
        sim = simulate(order, costs, owner, comm_times(a, Cluster(num_devices=4, memory_bytes=GiB), bounds, owner),
                       flags)
        assert order_peaks(order, costs, owner, flags) == [int(x) for x in sim.peak_memory_bytes]


@pytest.mark.parametrize("seed", range(6))
def test_pruned_shortlist_equals_exhaustive(seed: int) -> None:
    rng = random.Random(50 + seed)
    profile = synthetic_profile(16, seed=seed, jitter=0.3)
    recompute = [RecomputeMode.NONE, RecomputeMode.AUTO, RecomputeMode.ALL][seed % 3]
    req = PlanRequest(cluster=_cluster(rng, hetero=seed % 2 == 1), global_batch=8, schedule=None,
                      dp=None if seed % 2 == 0 else 1, recompute=recompute, shortlist=3)
    cfgs = configs(req, profile.num_units)
    modes = {RecomputeMode.NONE: (False,), RecomputeMode.ALL: (True,), RecomputeMode.AUTO: (False, True)}[recompute]
    every = []
    for idx, c in enumerate(cfgs):
        a = unit_arrays(profile, c.b)
        for rc in modes:
            split = _bounds(a, req, c, rc, _Splits())
            if split is not None:
                if _fitted(a, req, _candidate(c, split, rc)) is not None:
                    every.append((_estimate(a, req, c, split, rc), idx))
                break
    got = [(o.estimate, o.index) for o in _options(lambda b: unit_arrays(profile, b), req, cfgs)]
    assert got == sorted(every)[:3]
