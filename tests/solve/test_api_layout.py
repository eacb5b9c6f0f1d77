"""Every axis of a request survives the Python API's pinned paths (issue 24): `plan_split` and `evaluate_pinned` on
8 devices as pp 2 x dp 2 x tp 2 with ZeRO 1. Before the Layout, `plan_split` returned such a request's split with
ZeRO 0 and raised a raw `ValueError: pp(2) * dp(2) * tp(1) != devices (8)` for tp 2, and `Pinned` had no tp or ZeRO
at all (only cli/plan.py kept users from reaching them)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.data.catalog import cluster_from_catalog, load_device
from autopp.data.cluster import Cluster
from autopp.data.layout import Layout, LayoutPins, layout_fields
from autopp.data.plan import Plan
from autopp.data.profile import Profile
from autopp.data.synthetic_profile import synthetic_profile
from autopp.data.zero import NO_ZERO, ZERO
from autopp.errors import LayoutError, PlanError
from autopp.solve import Pinned, PlanRequest, evaluate_pinned
from autopp.solve.assemble.pinned import plan_split
from autopp.solve.search.judge import Candidate
from autopp.solve.search.views import Views

GiB = 2**30
PINS = LayoutPins(pp=2, dp=2, tp=2, zero=ZERO[1])
LAYOUT = Layout(pp=2, dp=2, tp=2, zero=ZERO[1])
STARTS = (4,)  # stages 0-3 | 4-7


@pytest.fixture(scope="module")
def profile() -> Profile:
    return synthetic_profile(8, hidden=1024, seq=512, tp_degrees=(2,))


def _nodes(count: int = 2) -> Cluster:
    """`count` nodes of 4 H100s (tensor-parallel pairs inside a node)."""
    return cluster_from_catalog(load_device("h100-sxm"), None, nodes=count, devices_per_node=4, memory_bytes=80 * GiB)


def _request(pins: LayoutPins = PINS) -> PlanRequest:
    return PlanRequest(cluster=_nodes(), global_batch=16, num_microbatches=4, pins=pins)


def _stage_static(profile: Profile, plan: Plan, layout: Layout) -> list[int]:
    """Each stage's static bytes under `layout`'s unit costs (tensor-parallel shard, ZeRO-sharded optimizer)."""
    a = Views(profile, _request()).arrays(plan.microbatch_size, layout)
    return [int(a.static[i:j].sum()) for i, j in (s.units for s in plan.stages)]


def test_plan_split_keeps_tp_zero_and_dp(profile: Profile) -> None:
    plan = plan_split(profile, _request(), STARTS)
    assert plan.layout == LAYOUT and plan.num_ranks == 8 and plan.global_batch == 16
    assert [s.units for s in plan.stages] == [(0, 4), (4, 8)]
    assert layout_fields(plan.layout) == {"num_ranks": 8, "pp": 2, "dp": 2, "virtual_stages": 1, "tp": 2, "zero": 1}
    assert Plan.from_json(plan.to_json()).layout == LAYOUT
    # costed with every axis, not only labelled: each stage's static bytes are the tp 2, ZeRO 1 shard's
    assert [s.static_bytes for s in plan.stages] == _stage_static(profile, plan, LAYOUT)
    plain = plan_split(profile, _request(replace(PINS, zero=NO_ZERO)), STARTS)
    assert plain.layout == replace(LAYOUT, zero=NO_ZERO)
    assert [s.static_bytes for s in plain.stages] == _stage_static(profile, plain, plain.layout)
    assert all(z.static_bytes < p.static_bytes for z, p in zip(plan.stages, plain.stages))  # optimizer state sharded
    assert max(plan.predicted.peak_memory_bytes) < max(plain.predicted.peak_memory_bytes)


def _pinned(plan: Plan, layout: Layout) -> Pinned:
    """`plan`'s schedule, sizes, split and policies pinned on `layout`."""
    return Pinned(candidate=Candidate(schedule=plan.schedule, layout=layout, microbatches=plan.num_microbatches,
                                      microbatch_size=plan.microbatch_size, bounds=tuple(s.units for s in plan.stages),
                                      activations=tuple(s.activation for s in plan.stages)), source="trainer.toml")


def test_evaluate_pinned_keeps_tp_zero_and_dp(profile: Profile) -> None:
    split = plan_split(profile, _request(), STARTS)
    plan = evaluate_pinned(profile, _nodes(), _pinned(split, LAYOUT))
    assert plan.layout == LAYOUT and [s.units for s in plan.stages] == [(0, 4), (4, 8)]
    assert plan.predicted.step_time_s == split.predicted.step_time_s  # judged as plan_split judged it
    assert plan.predicted.peak_memory_bytes == split.predicted.peak_memory_bytes
    assert [s.static_bytes for s in plan.stages] == _stage_static(profile, plan, LAYOUT)
    # ZeRO 3 gathers parameters before every forward: the same split and sizes take longer
    zero3 = evaluate_pinned(profile, _nodes(), _pinned(split, replace(LAYOUT, zero=ZERO[3])))
    assert zero3.layout.zero is ZERO[3] and zero3.predicted.step_time_s > plan.predicted.step_time_s


def test_a_pinned_layout_must_use_every_device(profile: Profile) -> None:
    split = plan_split(profile, _request(), STARTS)
    with pytest.raises(PlanError, match=r"trainer\.toml: pp\(2\) \* dp\(2\) \* tp\(2\) = 8 != devices \(4\); "
                                        r"plan for 8 devices"):
        evaluate_pinned(profile, _nodes(count=1), _pinned(split, LAYOUT))
    with pytest.raises(LayoutError, match=r"pp\(2\) \* dp\(2\) \* tp\(4\) = 16 != devices \(8\)"):  # not a ValueError
        _request(replace(PINS, tp=4))
    assert not issubclass(LayoutError, ValueError)


def test_sequence_parallelism_is_searched_where_the_profile_counts_it() -> None:
    """`sp` searched (None) is on for tp > 1 when the profile's tp rows count the norms' inputs, off with an older
    profile; pinned on with an older profile is refused in one line; the plan records it (JSON `sp`: true only)."""
    from autopp.display import format_grid
    from autopp.data.profile_tp import SP_TIME_COLUMNS
    from autopp.solve import make_plan
    new = synthetic_profile(8, hidden=1024, seq=512, tp_degrees=(2,), sp=True)
    old = synthetic_profile(8, hidden=1024, seq=512, tp_degrees=(2,))
    auto = make_plan(new, _request(replace(PINS, sp=None)))
    assert auto.layout == replace(LAYOUT, sp=True) and format_grid(auto.layout) == "pp 2 x dp 2 x tp 2 + SP, ZeRO 1"
    assert auto.to_json()["sp"] is True and Plan.from_json(auto.to_json()).layout.sp
    off = make_plan(new, _request(replace(PINS, sp=False)))
    assert off.layout == LAYOUT and "sp" not in off.to_json()
    assert max(auto.predicted.peak_memory_bytes) < max(off.predicted.peak_memory_bytes)  # the norms' inputs / 2
    assert any(n.startswith("sequence parallelism (tp 2 + SP): the norms on 1/2 of the sequence") for n in auto.notes)
    # the synthetic profile's tp rows have no SP times (sp_forward_s ...): the plan says its SP compute is the plain
    # rows' (an upper bound); with them (analytic profiles since 2026-12-05) it does not
    assert any(n.startswith("SP's compute timed as the plain tp rows'") for n in auto.notes)
    assert new.tp_units is not None
    timed = replace(new, tp_units=new.tp_units.assign(**{c: new.tp_units[c.removeprefix("sp_")]
                                                         for c in SP_TIME_COLUMNS}))
    assert not any(n.startswith("SP's compute") for n in make_plan(timed, _request(replace(PINS, sp=True))).notes)
    before = make_plan(old, _request(replace(PINS, sp=None)))
    assert before.layout == LAYOUT and "no sequence parallelism: the profile's tp rows predate sp_sequence_bytes; " \
        "profile again to let the planner use it" in before.notes
    with pytest.raises(LayoutError, match=r"^`sp` on: the profile's tensor-parallel rows do not count what sequence "
                                          r"parallelism shards .*: profile again, or `sp` off$"):
        make_plan(old, _request(replace(PINS, sp=True)))


def test_a_profile_with_sp_figures_plans_with_tp_left_at_1() -> None:
    """Regression (issue 26): with the analytic Llama-3-8B profile, whose TP rows count sequence parallelism, `autopp
    plan --device h100-sxm --nodes 2` failed with "`sp` (sequence parallelism) shards the sequence over the
    tensor-parallel ranks, and tp is 1": SP searched (`--sp auto`, the CLI's default) was switched on beside tp pinned
    to 1."""
    from pathlib import Path
    from autopp.costmodel import sp_offered
    from autopp.data.profile import load_profile
    from autopp.solve import make_plan
    profile = load_profile(Path(__file__).resolve().parents[2] / "profiles" / "llama-3-8b-h100-sxm-s8192")
    assert sp_offered(profile)
    cluster = cluster_from_catalog(load_device("h100-sxm"), 16, devices_per_node=8)
    plan = make_plan(profile, PlanRequest(cluster=cluster, global_batch=16, pins=LayoutPins(tp=1, sp=None)))
    assert (plan.layout.tp, plan.layout.sp) == (1, False)
    tp = make_plan(profile, PlanRequest(cluster=cluster, global_batch=16, pins=LayoutPins(pp=2, tp=8, sp=None)))
    assert (tp.layout.tp, tp.layout.sp) == (8, True)  # searched SP is still on wherever tp > 1
