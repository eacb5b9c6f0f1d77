"""The outer search: microbatch choice, baselines, and infeasible requests that say what would work."""

from __future__ import annotations

import pytest

from autopp.cluster import Cluster
from autopp.errors import InfeasibleError
from autopp.plan import Plan
from autopp.profile import Profile
from autopp.solve import PlanRequest, make_plan


def _plan(profile: Profile, devices: int = 2, memory: int = 2**30, **kw) -> Plan:  # type: ignore[no-untyped-def]
    return make_plan(profile, PlanRequest(cluster=Cluster(num_devices=devices, memory_bytes=memory), **kw))


def test_plan_is_valid_and_no_worse_than_even(gpt_profile: Profile) -> None:
    plan = _plan(gpt_profile, global_batch=4)
    assert plan.global_batch == 4 and plan.num_microbatches in (2, 4)
    assert plan.stages[0].units[0] == 0 and plan.stages[-1].units[1] == gpt_profile.num_units
    assert plan.predicted.step_time_s <= plan.baselines["even"].step_time_s
    assert Plan.from_json(plan.to_json()) == plan


def test_pinned_microbatches(gpt_profile: Profile) -> None:
    assert _plan(gpt_profile, global_batch=8, num_microbatches=8).microbatch_size == 1


def test_smallest_memory_is_exact(gpt_profile: Profile) -> None:
    with pytest.raises(InfeasibleError, match=r"the smallest that works is .*use --memory (\d+)") as info:
        _plan(gpt_profile, memory=2**20, global_batch=4)
    need = int(info.value.args[0].split("--memory ")[1].split()[0])
    assert max(_plan(gpt_profile, memory=need, global_batch=4).predicted.peak_memory_bytes) <= need
    with pytest.raises(InfeasibleError):
        _plan(gpt_profile, memory=need - 1, global_batch=4)


def test_too_many_devices(gpt_profile: Profile) -> None:
    with pytest.raises(InfeasibleError, match=r"cannot split 8 units into 9 stages: use at most 8 devices"):
        _plan(gpt_profile, devices=9, global_batch=16)


def test_too_few_microbatches(gpt_profile: Profile) -> None:
    with pytest.raises(InfeasibleError, match=r"microbatches >= stages \(2 < 4\)"):
        _plan(gpt_profile, devices=4, global_batch=2)


def test_determinism(gpt_profile: Profile) -> None:
    assert _plan(gpt_profile, global_batch=8).to_json() == _plan(gpt_profile, global_batch=8).to_json()
