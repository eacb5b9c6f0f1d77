"""plan_split (--split, --recompute-stages): a hand-written split judged by the simulator beside autopp's choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.data.cluster import Cluster
from autopp.data.profile import load_profile
from autopp.errors import LayoutError, PlanError
from autopp.schedule import Activation, ScheduleName
from autopp.solve import PlanRequest, RecomputeMode, make_plan
from autopp.solve.assemble.pinned import SPLIT_NOTE, check_split, plan_split

GPT = Path(__file__).resolve().parents[2] / "profiles" / "gpt"  # 8 units
MiB = 1 << 20
KEEP, RECOMPUTE = Activation.KEEP, Activation.RECOMPUTE


def _request(**kw: object) -> PlanRequest:
    return PlanRequest(**{"cluster": Cluster(num_devices=2, memory_bytes=1 << 30), "global_batch": 8, **kw})


def test_the_split_is_kept_and_autopps_choice_is_a_baseline() -> None:
    profile = load_profile(GPT)
    plan = plan_split(profile, _request(), (2,))
    assert [s.units for s in plan.stages] == [(0, 2), (2, 8)]
    assert SPLIT_NOTE in plan.notes and plan.predicted.fits
    own = make_plan(profile, _request())
    assert plan.baselines["autopp"] == own.predicted
    stages = " | ".join(f"{i}-{j - 1}" for i, j in (s.units for s in own.stages))
    assert (f"the row 'autopp' is autopp's own plan for this request: {own.schedule.value}, "
            f"{own.layout.describe(' x ')}, {own.num_microbatches} microbatches of {own.microbatch_size}, "
            f"stages {stages}, activations keep") in plan.notes  # a tester: the row said nothing of what it was
    assert {"even", "params", "time"} <= set(plan.baselines)
    assert plan.predicted.step_time_s > own.predicted.step_time_s  # 2 units against 6 is not autopp's choice


def test_the_fastest_fitting_configuration_of_the_split_is_chosen() -> None:
    profile = load_profile(GPT)
    plans = {m: plan_split(profile, _request(num_microbatches=m), (4,)) for m in (2, 4, 8)}
    free = plan_split(profile, _request(), (4,))
    assert free.predicted.step_time_s == min(p.predicted.step_time_s for p in plans.values())


def test_pinned_recompute_stages_are_the_plans() -> None:
    plan = plan_split(load_profile(GPT), _request(recompute_stages=(1,)), (4,))
    assert [s.activation for s in plan.stages] == [KEEP, RECOMPUTE]
    auto = plan_split(load_profile(GPT), _request(recompute=RecomputeMode.ALL), (4,))
    assert [s.activation for s in auto.stages] == [RECOMPUTE, RECOMPUTE]


def test_a_split_that_does_not_fit_is_returned_marked_and_noted() -> None:
    request = _request(cluster=Cluster(num_devices=2, memory_bytes=20 * MiB))
    plan = plan_split(load_profile(GPT), request, (2,))  # rank 1 holds 6 of the 8 units: about 34 MiB
    assert [s.units for s in plan.stages] == [(0, 2), (2, 8)] and not plan.predicted.fits
    assert any(n.startswith("does not fit: rank 1 peaks at") for n in plan.notes)
    assert plan.baselines["autopp"].fits


@pytest.mark.parametrize("starts, kw, match", [
    ((3, 2), {}, r"`split` 3,2: unit indices must increase"),
    ((0,), {}, r"`split` 0: stages begin at unit indices 1\.\.7 \(the model has 8 units\)"),
    ((8,), {}, r"`split` 8: stages begin at unit indices 1\.\.7"),
    ((2, 4), {}, r"`split` 2,4 gives 3 stages, but this request's configurations have 2 .*give 1 start indices"),
    ((2, 4, 6), {"schedule": ScheduleName.GPIPE}, r"have 2 \(pp x stages per rank\)"),
    ((2,), {"recompute_stages": (2,)}, r"`recompute_stages` 2: `split` 2 has stages 0\.\.1"),
])
def test_a_bad_pin_is_refused_before_any_work(starts: tuple[int, ...], kw: dict[str, object], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        check_split(_request(**kw), load_profile(GPT), starts)
    with pytest.raises(PlanError, match=match):
        plan_split(load_profile(GPT), _request(**kw), starts)


def test_before_profiling_only_the_order_of_the_starts_is_checked() -> None:
    with pytest.raises(PlanError, match=r"`split` 3,2: unit indices must increase"):
        check_split(_request(), None, (3, 2))
    check_split(_request(), None, (2, 4))  # 3 stages on 2 devices: refused only once the profile says so
    with pytest.raises(PlanError, match=r"`split` 2,4 gives 3 stages"):
        check_split(_request(), load_profile(GPT), (2, 4))


def test_four_stages_on_two_ranks_with_an_interleaved_schedule() -> None:
    plan = plan_split(load_profile(GPT), _request(schedule=ScheduleName.INTERLEAVED_1F1B), (2, 4, 6))
    assert plan.layout.v == 2 and [s.units for s in plan.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("kw, match", [
    ({"recompute_stages": (0, 0)}, r"`recompute_stages` 0,0: give distinct stage indices >= 0"),
    ({"recompute_stages": (-1,)}, r"give distinct stage indices >= 0"),
    ({"recompute_stages": (1,), "recompute": RecomputeMode.AUTO}, r"drop `recompute` auto"),
])
def test_request_checks_recompute_stages(kw: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        _request(**kw)

