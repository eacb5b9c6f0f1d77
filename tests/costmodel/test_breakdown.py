"""Where a step's time goes (autopp.costmodel.breakdown, issue 25 item 7): the terms add up to the predicted step,
and each collective is where the cost model put it, exposed or hidden."""

from __future__ import annotations

import pytest

from autopp.data.cluster import Cluster, Link
from autopp.data.layout import LayoutPins
from autopp.data.overlap import NO_OVERLAP, TRAINER_OVERLAP, Overlap
from autopp.data.plan import Plan
from autopp.data.synthetic_profile import synthetic_profile
from autopp.data.zero import ZERO
from autopp.solve import PlanRequest, RecomputeMode, make_plan

GiB = 2**30
#: No per-message overhead or progress delay: a rank's busy time is its stages' F, B and recomputation alone.
QUIET = Link(latency_s=1e-5, bandwidth_bytes_per_s=1e10)


def _plan(pins: LayoutPins, overlap: Overlap, devices: int = 4, recompute: RecomputeMode = RecomputeMode.NONE,
          tp: tuple[int, ...] = ()) -> Plan:
    cluster = Cluster(num_devices=devices, memory_bytes=80 * GiB, link=QUIET)
    return make_plan(synthetic_profile(10, tp_degrees=tp, sp=bool(tp)),
                     PlanRequest(cluster=cluster, global_batch=16, pins=pins, overlap=overlap, recompute=recompute))


def _adds_up(plan: Plan) -> None:
    """The ranks' busy time (the stages') averaged over the pp ranks, plus the bubble, the exposed synchronisation
    and the optimizer step is the predicted step."""
    b = plan.time_breakdown
    assert b is not None and len(b.stages) == len(plan.stages)
    busy = sum(s.busy_s for s in b.stages) / plan.layout.pp
    assert busy + b.bubble_s + b.sync_s + b.optimizer_s == pytest.approx(plan.predicted.step_time_s, rel=1e-6)
    # the rows the plan table prints add up to the step too
    assert sum(exposed for _, exposed, _ in b.rows(plan.layout.pp)) == pytest.approx(plan.predicted.step_time_s,
                                                                                    rel=1e-6)


@pytest.mark.parametrize("overlap", [NO_OVERLAP, TRAINER_OVERLAP])
def test_a_pipelined_zero_3_step_adds_up(overlap: Overlap) -> None:
    plan = _plan(LayoutPins(pp=2, dp=2, zero=ZERO[3]), overlap, recompute=RecomputeMode.ALL)
    _adds_up(plan)
    b = plan.time_breakdown
    assert b is not None and all(s.zero_s > 0 and s.zero_hidden_s == 0 for s in b.stages)  # gathers in F, exposed
    assert all(s.recompute_s > 0 for s in b.stages) and b.bubble_s > 0
    if overlap.grad_reduce:
        assert b.sync_hidden_s > 0
    else:
        assert b.sync_hidden_s == 0 and b.sync_s == pytest.approx(plan.predicted.allreduce_s)


def test_pure_fsdp_hides_its_collectives_under_prefetch_and_leaves_nothing_at_the_end() -> None:
    hidden = _plan(LayoutPins(pp=1, dp=4, zero=ZERO[3]), TRAINER_OVERLAP)
    exposed = _plan(LayoutPins(pp=1, dp=4, zero=ZERO[3]), NO_OVERLAP)
    for plan in (hidden, exposed):
        _adds_up(plan)
        assert plan.time_breakdown is not None and plan.time_breakdown.sync_s == 0 == plan.predicted.allreduce_s
    h, e = hidden.time_breakdown.stages[0], exposed.time_breakdown.stages[0]  # type: ignore[union-attr]
    assert h.zero_hidden_s > 0 and e.zero_hidden_s == 0
    assert h.zero_s + h.zero_hidden_s == pytest.approx(e.zero_s)  # the same collectives, split differently
    assert hidden.predicted.step_time_s < exposed.predicted.step_time_s


def test_tensor_parallel_collectives_are_shown_and_async_tp_hides_some() -> None:
    pins = LayoutPins(pp=2, dp=1, tp=2, sp=True)
    plain = _plan(pins, NO_OVERLAP, tp=(2,))
    fast = _plan(pins, Overlap(async_tp=True), tp=(2,))
    for plan in (plain, fast):
        _adds_up(plan)
    total = lambda p, f: sum(getattr(s, f) for s in p.time_breakdown.stages)  # noqa: E731
    assert total(plain, "tp_s") > 0 and total(plain, "tp_hidden_s") == 0
    assert total(fast, "tp_hidden_s") > 0 and total(fast, "tp_s") < total(plain, "tp_s")


def test_the_resume_cost_is_counted_where_the_simulator_charges_it() -> None:
    """A profile with a resume cost (stagefix): the simulator adds it to every action that starts after its rank
    waited, and the breakdown's rows still add up to the predicted step (it was in neither compute nor bubble)."""
    from dataclasses import replace
    base = synthetic_profile(10)
    profile = replace(base, meta=replace(base.meta, resume_s=0.05, runtime_forward_s=0.01, runtime_backward_s=0.02))
    cluster = Cluster(num_devices=4, memory_bytes=80 * GiB, link=QUIET)
    plan = make_plan(profile, PlanRequest(cluster=cluster, global_batch=16, pins=LayoutPins(pp=4, dp=1),
                                          overlap=NO_OVERLAP))
    assert all(s.resume_s == 0.05 for s in plan.stages)
    _adds_up(plan)
