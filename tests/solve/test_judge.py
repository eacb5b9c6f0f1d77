"""The judge's per-stage message overheads: paid once per neighbour stage on another rank, on that link."""

from __future__ import annotations

import pytest

from autopp.cluster import Cluster, Link
from autopp.solve.judge import message_overheads


def _cluster(n: int, overheads: tuple[float, ...]) -> Cluster:
    return Cluster(num_devices=n, memory_bytes=1,
                   links=tuple(Link(latency_s=0.0, bandwidth_bytes_per_s=1.0, overhead_s=o) for o in overheads))


def test_one_stage_per_rank_ends_pay_once_middles_twice() -> None:
    assert message_overheads(_cluster(3, (1.0, 1.0)), [0, 1, 2]) == [1.0, 2.0, 1.0]
    # Each boundary's own link: rank 0 - 1 costs 1, rank 1 - 2 costs 10.
    assert message_overheads(_cluster(3, (1.0, 10.0)), [0, 1, 2]) == [1.0, 11.0, 10.0]


def test_neighbours_on_the_same_rank_send_nothing() -> None:
    # V shape on 2 ranks: stages 1 and 2 share rank 1, so each stage has one neighbour elsewhere.
    assert message_overheads(_cluster(2, (0.5,)), [0, 1, 1, 0]) == [0.5, 0.5, 0.5, 0.5]
    assert message_overheads(_cluster(1, ()), [0, 0]) == [0.0, 0.0]


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


def test_stage_costs_keep_the_measured_split_and_the_full_backward_and_stage_0_has_no_i() -> None:
    import numpy as np

    from autopp.profile import UnitCost
    from autopp.solve.arrays import arrays_from_units
    from autopp.solve.judge import stage_costs
    units = [UnitCost(forward_s=1.0, backward_s=2.0, static_bytes=0, activation_bytes=0, param_bytes=0, output_bytes=0,
                      backward_input_s=1.5, backward_weight_s=1.0) for _ in range(2)]
    a = arrays_from_units(units, [0])
    assert np.allclose(a.backward_input, 1.5) and np.allclose(a.backward_weight, 1.0) and np.allclose(a.backward, 2.0)
    assert np.allclose(a.work(), 3.0)  # F + the cheaper backward
    first, second = stage_costs(a, [(0, 1), (1, 2)], [1.0, 1.0])
    assert (second.backward_input_s, second.backward_weight_s, second.backward_s) == (1.5, 1.0, 2.0)
    # torch's first stage skips the input-gradient pass and runs one full backward as its W
    assert (first.backward_input_s, first.backward_weight_s, first.backward_s) == (0.0, 2.0, 2.0)


def test_optimizer_step_is_the_slowest_ranks_share() -> None:
    import dataclasses

    import numpy as np

    from autopp.solve.arrays import unit_arrays
    from autopp.solve.judge import optimizer_time
    from autopp.solve.synthetic import synthetic_profile
    a = dataclasses.replace(unit_arrays(synthetic_profile(4), 1), optimizer=np.array([1.0, 2.0, 3.0, 4.0]))
    assert optimizer_time(a, [(0, 2), (2, 4)], [0, 1]) == 7.0
    assert optimizer_time(a, [(0, 1), (1, 2), (2, 3), (3, 4)], [0, 1, 1, 0]) == 5.0  # V shape: ranks hold 1+4, 2+3
