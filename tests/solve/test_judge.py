"""The judge: a candidate's simulated figures include the cost model's per-message overheads (the terms themselves
are tested in tests/costmodel/)."""

from __future__ import annotations

import pytest

from autopp.data.cluster import Cluster, Link


def test_plan_records_the_overhead_and_the_prediction_includes_it() -> None:
    from autopp.predict import simulate_plan
    from autopp.schedule import ScheduleName
    from autopp.data.layout import LayoutPins
    from autopp.solve import PlanRequest, make_plan
    from autopp.data.synthetic_profile import synthetic_profile
    profile = synthetic_profile(8)
    request = dict(global_batch=8, num_microbatches=4, schedule=ScheduleName.ONE_F_ONE_B, pins=LayoutPins(pp=2, dp=1))
    plans = [make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**40, link=Link(
        latency_s=0.0, bandwidth_bytes_per_s=1e12, overhead_s=o)), **request)) for o in (0.0, 1e-3)]
    assert [s.overhead_s for s in plans[1].stages] == [1e-3, 1e-3]
    assert plans[1].predicted.step_time_s == pytest.approx(simulate_plan(plans[1]).step_time_s)
    # 1F1B, 2 ranks, 4 microbatches: the critical path crosses 2 x 4 + 2 actions that each pay it at least.
    assert plans[1].predicted.step_time_s - plans[0].predicted.step_time_s >= 8e-3



def test_dp_judge_simulator_and_plan_agree_on_peaks_with_a_transient() -> None:
    from autopp.costmodel import memory_prefix, stage_outputs, stage_transient, unit_arrays
    from autopp.predict import plan_stage_costs, simulate_plan
    from autopp.data.layout import LayoutPins
    from autopp.schedule import Activation, ScheduleName, build_schedule
    from autopp.schedule.effects import inflight_peaks, order_peaks
    from autopp.solve import PlanRequest, make_plan
    from autopp.solve.partition.dp import PipeSpec, fits
    from autopp.data.synthetic_profile import synthetic_profile
    profile = synthetic_profile(6)
    peaks: dict[str, dict[str, int]] = {}
    for r in profile.units.itertuples():  # the head's working memory: 1 GiB per sample beyond what it keeps
        held = int(r.activation_bytes + r.output_bytes * (r.unit != 5) + r.grad_bytes)  # the model's: not at its peak
        extra = 2**30 * r.microbatch_size if r.unit == 5 else 0
        peaks.setdefault(str(r.unit), {})[str(r.microbatch_size)] = held + extra
    profile.meta.extra["peak_bytes"] = peaks
    request = dict(global_batch=8, num_microbatches=4, schedule=ScheduleName.ONE_F_ONE_B, pins=LayoutPins(pp=2, dp=1))
    plan = make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**40), **request))
    a, bounds = unit_arrays(profile, plan.microbatch_size), tuple(s.units for s in plan.stages)
    assert [s.transient_bytes for s in plan.stages] == [stage_transient(a, i, j) for i, j in bounds]
    assert plan.stages[1].transient_bytes == 2**30 * plan.microbatch_size
    order = build_schedule(ScheduleName.ONE_F_ONE_B, 2, 4)
    inflight = {s: n for r in order for s, n in inflight_peaks(order[r]).items()}
    dp_bytes = [int(memory_prefix(a, inflight[k])[j] - memory_prefix(a, inflight[k])[i]) + stage_transient(a, i, j)
                + int(stage_outputs(a, inflight[k])[j]) for k, (i, j) in enumerate(bounds)]
    # both stages hold their outputs: stage 1 the model's (the synthetic head's, hidden-wide), once in flight
    assert stage_outputs(a, inflight[0])[bounds[0][1]] > 0 < stage_outputs(a, inflight[1])[bounds[1][1]] \
        == a.model_output
    simulated = simulate_plan(plan).peak_memory_bytes
    walked = order_peaks(order, plan_stage_costs(plan), [0, 1], [Activation.KEEP] * 2)
    assert list(plan.predicted.peak_memory_bytes) == simulated == walked == dp_bytes
    spec = PipeSpec(num_stages=2, microbatches=4, inflight=(inflight[0], inflight[1]),
                    memory=tuple(float(x) for x in simulated))
    tight = PipeSpec(**{**spec.__dict__, "memory": (float(simulated[0]), float(simulated[1] - 1))})
    assert fits(a, spec, bounds) and not fits(a, tight, bounds)
