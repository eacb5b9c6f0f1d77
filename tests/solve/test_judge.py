"""The judge: a candidate's simulated figures include the cost model's per-message overheads (the terms themselves
are tested in tests/costmodel/)."""

from __future__ import annotations

import pytest

from autopp.data.cluster import Cluster, Link


def test_plan_records_the_overhead_and_the_prediction_includes_it() -> None:
    from autopp.predict import simulate_plan
    from autopp.schedule import ScheduleName
    from autopp.solve import PlanRequest, make_plan
    from autopp.solve.synthetic import synthetic_profile
    profile = synthetic_profile(8)
    request = dict(global_batch=8, num_microbatches=4, schedule=ScheduleName.ONE_F_ONE_B, pp=2, dp=1)
    plans = [make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**40, link=Link(
        latency_s=0.0, bandwidth_bytes_per_s=1e12, overhead_s=o)), **request)) for o in (0.0, 1e-3)]
    assert [s.overhead_s for s in plans[1].stages] == [1e-3, 1e-3]
    assert plans[1].predicted.step_time_s == pytest.approx(simulate_plan(plans[1]).step_time_s)
    # 1F1B, 2 ranks, 4 microbatches: the critical path crosses 2 x 4 + 2 actions that each pay it at least.
    assert plans[1].predicted.step_time_s - plans[0].predicted.step_time_s >= 8e-3
