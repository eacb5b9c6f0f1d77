"""The search over tensor-parallel degrees and ZeRO stages (autopp.solve.search.views, request.configs): pins, what the
plan records, and choices forced by memory."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel import ProfileTable
from autopp.data.catalog import cluster_from_catalog, load_device
from autopp.data.cluster import Cluster
from autopp.data.layout import Layout, LayoutPins
from autopp.data.zero import NO_ZERO, ZERO, ZeroStage, zero_stage
from autopp.errors import InfeasibleError, LayoutError, ProfileError
from autopp.solve import PlanRequest, RecomputeMode, make_plan
from autopp.solve.search.request import Group, configs, tp_choices
from autopp.data.synthetic_profile import synthetic_profile
from autopp.solve.search.views import Views

GiB = 2**30


@pytest.fixture(scope="module")
def profile():  # type: ignore[no-untyped-def]
    return synthetic_profile(18, hidden=1024, seq=512, tp_degrees=(2, 4))


def _nodes(count: int = 2, per: int = 4, memory: int = 80 * GiB) -> Cluster:
    return cluster_from_catalog(load_device("h100-sxm"), None, nodes=count, devices_per_node=per,
                                memory_bytes=memory)


def test_pinned_tp_and_zero_are_what_the_plan_records(profile) -> None:  # type: ignore[no-untyped-def]
    plan = make_plan(profile, PlanRequest(cluster=_nodes(), global_batch=16,
                                          pins=LayoutPins(pp=2, dp=2, tp=2, zero=ZERO[3])))
    assert plan.layout == Layout(pp=2, dp=2, tp=2, zero=ZERO[3]) and plan.num_ranks == 8
    assert plan.global_batch == 16
    assert any("tensor parallelism 2" in n for n in plan.notes) and any("ZeRO stage 3" in n for n in plan.notes)


def test_views_add_the_collectives_and_shard_the_bytes(profile) -> None:  # type: ignore[no-untyped-def]
    req = PlanRequest(cluster=_nodes(), global_batch=16, pins=LayoutPins(tp=None, dp=None, zero=None))
    views = Views(profile, req)
    whole, tp2 = views.arrays(1), views.arrays(1, Layout(tp=2))
    raw = ProfileTable(profile, 2).arrays(1)
    assert np.all(tp2.forward > raw.forward)  # every synthetic unit has a collective in F
    assert np.allclose(tp2.params, whole.params // 2, rtol=1e-6)
    z1 = views.arrays(1, Layout(tp=2, zero=ZERO[1], dp=4))
    assert np.all(z1.static < tp2.static) and z1.zero is ZERO[1]  # the optimizer state sharded
    z3 = views.arrays(1, Layout(pp=2, tp=2, zero=ZERO[3], dp=4))  # under torch's pipelining
    assert np.array_equal(z3.static, z1.static) and np.all(z3.forward > z1.forward)
    fsdp = views.arrays(1, Layout(pp=1, tp=2, zero=ZERO[3], dp=4))  # FSDP2 outside a pipeline: everything sharded
    assert fsdp.fsdp and np.all(fsdp.static < z3.static) and np.all(fsdp.transient_bytes() > z3.transient_bytes())
    # what the unit costs do not depend on: the pipeline degree, and replicas that shard nothing
    assert views.arrays(1, Layout(pp=2, dp=4, tp=2)) is tp2 and views.arrays(1, Layout(pp=4, v=2, dp=2)) is whole
    assert views.arrays(1, Layout(pp=1, tp=2, zero=ZERO[1], dp=4)) is z1
    assert views.degrees() == ((1, 1), (1, 2), (1, 4))  # (cp, tp): no attention shape, cp 1 alone


def test_views_are_the_cost_models_group_then_replica_terms(profile) -> None:  # type: ignore[no-untyped-def]
    """Issue 24: the views name no axis: a layout's arrays are `group_terms` of its group's table, then
    `replica_terms` over its synchronisation ranks on the groups' cluster (autopp.costmodel.parallel)."""
    from autopp.costmodel import group_terms, replica_terms
    req = PlanRequest(cluster=_nodes(), global_batch=16, pins=LayoutPins(tp=None, dp=None, zero=None))
    layout = Layout(pp=1, dp=4, tp=2, zero=ZERO[3])
    view = layout.unit_view()
    own = replace(ProfileTable(profile, 2).arrays(1), overlap=req.assumed_overlap)  # the request's overlap
    group = group_terms(own, view.local(), req.cluster)
    expected = replica_terms(group, view, req.view(layout.group).cluster)
    got = Views(profile, req).arrays(1, layout)
    for name in ("forward", "backward", "backward_input", "backward_weight", "static", "optimizer"):
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name


def test_tp_choices_leave_room_for_a_pinned_cp() -> None:
    """A new user's `--pp 1 --cp 2` on 2 devices with tp searched: tp 2 made groups of 4 of the 2 devices and a
    ValueError traceback (`Cluster.tp_groups`); on 4 devices with `--pp 2`, "pp(2) does not divide the 1 devices"."""
    two, four = Cluster(num_devices=2, memory_bytes=2**30), Cluster(num_devices=4, memory_bytes=2**30)

    def pins(pp: int) -> LayoutPins:
        return LayoutPins(pp=pp, cp=2, dp=None, tp=None)
    assert tp_choices(PlanRequest(cluster=two, global_batch=8, pins=pins(1)), (2,)) == [1]
    assert tp_choices(PlanRequest(cluster=four, global_batch=8, pins=pins(2)), (2,)) == [1]
    assert tp_choices(PlanRequest(cluster=four, global_batch=8, pins=pins(1)), (2,)) == [1, 2]


def test_tp_choices_stay_inside_a_node_unless_allowed(profile) -> None:  # type: ignore[no-untyped-def]
    small = _nodes(count=4, per=2)
    assert tp_choices(PlanRequest(cluster=small, global_batch=8, pins=LayoutPins(tp=None)), (2, 4)) == [1, 2]
    across = PlanRequest(cluster=small, global_batch=8, pins=LayoutPins(tp=None), tp_across_nodes=True)
    assert tp_choices(across, (2, 4)) == [1, 2, 4]
    with pytest.raises(LayoutError, match="does not fit in a node of 2 devices"):
        PlanRequest(cluster=small, global_batch=8, pins=LayoutPins(tp=4))
    req = PlanRequest(cluster=_nodes(), global_batch=16, pins=LayoutPins(tp=None, dp=None, zero=None))
    cfgs = configs(req, profile.num_units, (Group(1, 1), Group(1, 2)))
    layouts = [c.layout for c in cfgs]
    assert {x.tp for x in layouts} == {1, 2} and {x.zero for x in layouts if x.dp > 1} == {ZERO[0], ZERO[1], ZERO[3]}
    assert all(x.world == 8 for x in layouts) and all(x.zero is NO_ZERO for x in layouts if x.dp == 1)


def test_request_checks_the_grid() -> None:
    cluster = _nodes()
    with pytest.raises(LayoutError, match=r"pp\(2\) \* dp\(2\) \* tp\(4\) = 16 != devices \(8\)"):
        PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(pp=2, dp=2, tp=4))
    with pytest.raises(LayoutError, match=r"ZeRO stage 5 does not exist; give one of \[0, 1, 2, 3\]"):
        zero_stage(5)  # a stage number is parsed at the JSON and flag boundary; requests hold descriptors
    with pytest.raises(LayoutError, match=r"tp\(3\) does not divide the 8 devices"):
        PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(tp=3))
    with pytest.raises(LayoutError, match="ZeRO 3 shards over data-parallel replicas, and dp is 1"):
        PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(zero=ZERO[3]))
    six = cluster_from_catalog(load_device("h100-sxm"), None, nodes=2, devices_per_node=6)
    with pytest.raises(LayoutError, match="tp=4 neither fits in a node of 6 devices nor spans whole nodes"):
        PlanRequest(cluster=six, global_batch=8, pins=LayoutPins(tp=4), tp_across_nodes=True)


def test_a_degree_the_profile_lacks_is_one_line(profile) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProfileError, match="no tensor-parallel rows of degree 8 .*it has: 2, 4.*`tp_degrees` 2,4,8"):
        make_plan(profile, PlanRequest(cluster=_nodes(count=1, per=8), global_batch=8,
                                       pins=LayoutPins(tp=8, pp=1, dp=1)))


@pytest.mark.integration  # about 3 s: every degree, stage and configuration searched twice
def test_memory_forces_sharding(profile) -> None:  # type: ignore[no-untyped-def]
    """With too little memory for whole units on pipeline x data parallelism, the search shards: the plan fits
    and uses tensor parallelism or ZeRO >= 1 (every configuration without either overflows)."""
    a = ProfileTable(profile).arrays(1)
    need = float(a.static.max() + a.activation.max())  # the largest unit alone, one microbatch
    cluster = _nodes(count=4, per=8, memory=int(need * 0.9))
    free = PlanRequest(cluster=cluster, global_batch=16, pins=LayoutPins(tp=None, dp=None, zero=None), schedule=None,
                       recompute=RecomputeMode.AUTO)
    plan = make_plan(profile, free)
    assert plan.predicted.fits and (plan.layout.tp > 1 or not plan.layout.zero.replicated)
    with pytest.raises(InfeasibleError, match="fits in"):
        make_plan(profile, replace(free, pins=replace(free.pins, tp=1, zero=NO_ZERO)))


def test_weights_tied_between_stages_rule_out_tp_and_zero(profile) -> None:  # type: ignore[no-untyped-def]
    """The runner sums tied weights only on whole tensors: tp or ZeRO with the tie cut between stages is refused."""
    from autopp.data.profile import TiedGroup
    tied = replace(profile, meta=replace(profile.meta, tied_parameters=(
        TiedGroup(names=("emb.weight", "head.weight"), units=(0, profile.num_units - 1), bytes=1024),)))
    with pytest.raises(InfeasibleError, match="'emb.weight', tied between units .* lands in two stages"):
        make_plan(tied, PlanRequest(cluster=_nodes(), global_batch=16,
                                    pins=LayoutPins(pp=2, dp=2, tp=2, zero=ZERO[1])))
    plan = make_plan(tied, PlanRequest(cluster=_nodes(), global_batch=16,
                                       pins=LayoutPins(pp=2, dp=None, tp=None, zero=None)))
    assert (plan.layout.tp, plan.layout.zero) == (1, NO_ZERO)
    assert any("tensor parallelism or ZeRO excluded" in n for n in plan.notes)
    # plan only, as Megatron runs it (each shard of the tied weight summed between the stages holding it)
    megatron = make_plan(tied, PlanRequest(cluster=_nodes(), global_batch=16, tied_across_stages=True,
                                           pins=LayoutPins(pp=2, dp=2, tp=2, zero=ZERO[1])))
    assert (megatron.layout.pp, megatron.layout.tp, megatron.layout.zero) == (2, 2, ZERO[1])
    # and says so: the runner refuses it (autopp.run.worker), and the shards' sum is not costed
    said = [n for n in megatron.notes if "`tied_across_stages`" in n]
    assert len(said) == 1 and "'emb.weight', tied between units" in said[0] and "two stages (0 and 1)" in said[0]
    assert "autopp run refuses" in said[0]
    untied = make_plan(tied, PlanRequest(cluster=_nodes(), global_batch=16, tied_across_stages=True,
                                         pins=LayoutPins(pp=2, dp=4, tp=1, zero=NO_ZERO)))
    assert not any("`tied_across_stages`" in n for n in untied.notes)  # no mesh: nothing left to the trainer


def test_collective_counts_do_not_grow_with_the_microbatch(profile) -> None:  # type: ignore[no-untyped-def]
    table = ProfileTable(profile, 2)
    small, large = table.arrays(1).tp_comm, table.arrays(8).tp_comm
    assert np.array_equal(small.forward_count, large.forward_count)
    assert np.allclose(large.forward_allreduce, 8 * small.forward_allreduce)


def test_ep_is_searched_among_the_divisors_of_dp() -> None:
    """Expert parallelism (issue 30): ep groups are carved from a stage's dp ranks (torchtitan: ep divides dp_shard)
    with tp 1 and ZeRO 0 to 2 (3 at pp 1, as FSDP2), so the search tries 1 and every divisor of dp, a pinned ep with
    any dp it divides, searched ep only dividing the experts per layer where known, and the request refuses other
    pins in one line."""
    from autopp.solve.search.request import ep_choices

    def ep_choices_of(req: PlanRequest, dp: int, tp: int, zero: ZeroStage) -> tuple[int, ...]:
        pairs = ep_choices(req, dp, tp, zero)
        assert all(etp == 1 for _, etp in pairs)  # etp pinned 1 (its default)
        return tuple(ep for ep, _ in pairs)
    cluster = Cluster(num_devices=8, memory_bytes=2**34)
    auto = PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(dp=None, ep=None))
    assert ep_choices_of(auto, 4, 1, NO_ZERO) == (1, 2, 4) and ep_choices_of(auto, 1, 1, NO_ZERO) == (1,)
    assert ep_choices_of(auto, 6, 1, ZERO[1]) == (1, 2, 3, 6) and ep_choices(auto, 4, 1, ZERO[3], 2) == ((1, 1),)
    assert ep_choices_of(auto, 4, 2, NO_ZERO) == (1,) and ep_choices(auto, 4, 1, ZERO[3], 1) == (
        (1, 1), (2, 1), (4, 1))  # ZeRO 3 beside ep at pp 1 (FSDP2), without etp
    pinned = PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(dp=None, ep=2))
    assert ep_choices_of(pinned, 2, 1, NO_ZERO) == (2,) and ep_choices_of(pinned, 4, 1, NO_ZERO) == (2,)
    assert ep_choices_of(pinned, 3, 1, NO_ZERO) == ()
    layouts = {c.layout for c in configs(pinned, 8)}
    assert layouts and all(l.ep == 2 and l.dp % 2 == 0 and l.zero.replicated for l in layouts)
    assert {(c.layout.dp, c.layout.ep) for c in configs(auto, 8)} >= {(1, 1), (2, 1), (2, 2), (8, 2), (8, 4), (8, 8)}
    assert {c.layout.ep for c in configs(auto, 8, experts=4)} == {1, 2, 4}
    with pytest.raises(LayoutError, match=r"^`ep` 2 runs with `tp` 1 and a `dp` it divides .*got `dp` 2, `tp` 2$"):
        PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(dp=2, tp=2, ep=2))
    with pytest.raises(LayoutError, match=r"^ep\(4\) must divide dp\(6\)"):
        PlanRequest(cluster=cluster, global_batch=12, pins=LayoutPins(dp=6, ep=4))
    with pytest.raises(LayoutError, match=r"^`zero` 3 with `ep` 2 and `pp` above 1: autopp plans ZeRO 3 beside "
                                          r"expert parallelism only without a pipeline .*re-plan with `pp` 1 or "
                                          r"`zero` 1$"):
        PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(pp=2, dp=4, ep=2, zero=ZERO[3]))
    fsdp = PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(dp=None, ep=2, zero=ZERO[3]))
    layouts = {c.layout for c in configs(fsdp, 8)}  # pp searched: only pp 1 keeps ZeRO 3 beside ep
    assert layouts and all(l.pp == 1 and l.ep == 2 and l.fsdp for l in layouts)


def test_etp_is_searched_beside_each_ep_among_the_divisors_of_dp_over_ep() -> None:
    """Expert tensor parallelism (issue 24's proof axis): carved beside ep from dp, so searched etp is 1 and every
    divisor of dp / ep beside each ep > 1 (none beside ep 1, nor with tp > 1), a pinned etp only with an ep it fits
    beside; searched ep still divides the experts, and etp then shards further where ep cannot; the layout refuses
    ep x etp not dividing dp, and etp with ep 1, in one line each."""
    from autopp.solve.search.request import ep_choices
    cluster = Cluster(num_devices=8, memory_bytes=2**34)
    auto = PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(dp=None, ep=None, etp=None))
    assert ep_choices(auto, 4, 1, NO_ZERO) == ((1, 1), (2, 1), (2, 2), (4, 1))
    assert ep_choices(auto, 8, 1, NO_ZERO) == ((1, 1), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1))
    assert ep_choices(auto, 4, 2, NO_ZERO) == ((1, 1),) and ep_choices(auto, 1, 1, NO_ZERO) == ((1, 1),)
    pinned = PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(dp=None, ep=None, etp=2))
    assert ep_choices(pinned, 8, 1, NO_ZERO) == ((2, 2), (4, 2)) and ep_choices(pinned, 2, 1, NO_ZERO) == ()
    layouts = {c.layout for c in configs(pinned, 8)}
    assert layouts and all(l.etp == 2 and l.ep > 1 and l.dp % (2 * l.ep) == 0 for l in layouts)
    assert {(c.layout.ep, c.layout.etp) for c in configs(auto, 8, experts=2) if c.layout.dp == 8} == {
        (1, 1), (2, 1), (2, 2), (2, 4)}
    with pytest.raises(LayoutError, match=r"^ep\(2\) x etp\(2\) must divide dp\(2\) \* cp\(1\) \* tp\(1\) = 2$"):
        PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(dp=2, ep=2, etp=2))
    with pytest.raises(LayoutError, match=r"^`etp` 2 shards the experts of an ep group, and ep is 1: give `ep` > 1, "
                                          r"or `etp` 1$"):
        PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(dp=4, etp=2))
    # etp pinned beside ZeRO 3 is refused in one line with ep searched too (it left no configuration, and the
    # search blamed the global batch)
    for ep in (None, 2):
        with pytest.raises(LayoutError, match=r"^`zero` 3 with `etp` 2: autopp plans expert tensor parallelism"):
            PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(dp=None, ep=ep, etp=2, zero=ZERO[3]))


def _moe(profile, experts: int = 8):  # type: ignore[no-untyped-def]
    """`profile` with units 1 to 16 holding one MoE layer each of `experts` experts (top-2), half their bytes."""
    from autopp.data.profile import Profile
    blocks = profile.units.unit.between(1, 16)
    return Profile(replace(profile.meta, extra={"moe": {"num_experts": experts, "top_k": 2}}),
                   profile.units.assign(expert_param_bytes=np.where(blocks, profile.units.param_bytes // 2, 0),
                                        moe_layers=np.where(blocks, 1, 0)), profile.edges, profile.tp_units)


def test_a_plan_with_ep_says_what_it_shards_and_when_it_changes_nothing(profile) -> None:  # type: ignore[no-untyped-def]
    """The plan of a pinned ep 2 records it, its notes say the experts and routing sharded; a profile that has no
    stacked experts is refused a pinned ep (it would shard nothing)."""
    moe = _moe(profile)
    req = PlanRequest(cluster=_nodes(), global_batch=16, pins=LayoutPins(pp=4, dp=2, ep=2))
    plan = make_plan(moe, req)
    assert plan.layout == Layout(pp=4, dp=2, ep=2)
    assert any(n.startswith("expert parallelism 2: each stage's 2 replicas hold 1/2 of its experts (8 per layer, "
                            "top-2)") for n in plan.notes)
    half = make_plan(moe, replace(req, pins=LayoutPins(pp=2, dp=4, ep=2)))
    assert half.layout == Layout(pp=2, dp=4, ep=2)
    assert any(n.startswith("expert parallelism 2: each stage's 4 replicas form 2 groups of 2 that each hold 1/2 of "
                            "its experts") and "all-reduced over the 2 ranks holding the same; expert GEMMs" in n
               for n in half.notes)
    with pytest.raises(ProfileError, match=r"^`ep` 2: the profile records no stacked experts"):  # nothing to shard
        make_plan(profile, req)
    # a pinned ep must divide the experts (no trainer, nor the runner, gives a rank 6 / 4 of them): refused in
    # one line where it was planned
    six = _moe(profile, experts=6)
    with pytest.raises(LayoutError, match=r"^`ep` 4 does not divide the model's 6 routed experts per layer \(each "
                                          r"ep rank holds experts / ep of them\): give a divisor of 6$"):
        make_plan(six, replace(req, pins=LayoutPins(pp=2, dp=4, ep=4)))
    assert make_plan(six, replace(req, pins=LayoutPins(pp=2, dp=4, ep=2))).layout.ep == 2


def test_fsdp_beside_ep_at_pp_1_plans_and_notes_the_experts(profile) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: ZeRO 3 beside ep at pp 1 (FSDP2, as NeMo AutoModel's EP8 x FSDP8) plans; its notes say the experts
    are sharded over the ranks holding the same (dp 8, ep 2: 4) or, with ep = dp, over their one rank; it holds
    fewer static bytes than ZeRO 1 beside the same ep."""
    moe = _moe(profile)
    notes = {}
    for ep in (2, 8):
        req = PlanRequest(cluster=_nodes(), global_batch=16, pins=LayoutPins(pp=1, dp=8, ep=ep, zero=ZERO[3]))
        plan = make_plan(moe, req)
        assert plan.layout == Layout(pp=1, dp=8, ep=ep, zero=ZERO[3]) and plan.layout.fsdp
        notes[ep] = next(n for n in plan.notes if n.startswith("ZeRO stage 3 over 8 replicas as FSDP2"))
        one = make_plan(moe, replace(req, pins=LayoutPins(pp=1, dp=8, ep=ep, zero=ZERO[1])))
        assert sum(s.static_bytes for s in plan.stages) < sum(s.static_bytes for s in one.stages)
    assert notes[2].endswith("; the experts sharded, gathered and reduce-scattered over the 4 ranks holding the same")
    assert notes[8].endswith("; the experts (ep = dp) FSDP2 over their one rank: gathered for each use without a "
                             "collective")


def test_the_search_takes_fsdp_beside_ep_where_only_it_fits(profile) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: with zero and ep searched at pp 1 x dp 8, a memory that only ZeRO 3 beside ep fits (with ep 2 its
    working memory gathers half the experts that ZeRO 3 without ep gathers; ZeRO 1 keeps the weights whole) makes
    the search take it; with more memory it takes what is faster."""
    moe = _moe(profile)
    peaks = {}
    for zero, ep in ((1, 2), (3, 1), (3, 2)):
        pins = LayoutPins(pp=1, dp=8, ep=ep, zero=ZERO[zero])
        peaks[zero, ep] = max(make_plan(moe, PlanRequest(cluster=_nodes(), global_batch=16,
                                                         pins=pins)).predicted.peak_memory_bytes)
    assert peaks[3, 2] < peaks[3, 1] < peaks[1, 2]
    searched = LayoutPins(pp=1, dp=8, ep=None, zero=None)
    memory = (peaks[3, 2] + peaks[3, 1]) // 2
    tight = make_plan(moe, PlanRequest(cluster=_nodes(memory=memory), global_batch=16, pins=searched))
    assert tight.layout.zero == ZERO[3] and tight.layout.ep > 1 and tight.layout.fsdp
    roomy = make_plan(moe, PlanRequest(cluster=_nodes(), global_batch=16, pins=searched))
    assert roomy.predicted.step_time_s < tight.predicted.step_time_s


def test_a_plan_with_ep_says_how_it_times_the_expert_gemms(profile) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: with the profile's expert columns the expert GEMMs are re-timed for 1/ep of the weights (a
    memory-bound share of each block's time, so the step is shorter than with the ep-1 times); without them (a
    measured profile) the note says they keep the ep-1 times, an upper bound."""
    from autopp.data.profile import EXPERT_PARTS, EXPERT_PASSES, Profile, expert_column
    blocks = profile.units.unit.between(1, 16).to_numpy()
    untimed = Profile(replace(profile.meta, extra={"moe": {"num_experts": 8, "top_k": 2}}),
                      profile.units.assign(expert_param_bytes=np.where(blocks, profile.units.param_bytes // 2, 0),
                                           moe_layers=np.where(blocks, 1, 0)), profile.edges, profile.tp_units)
    # per pass, a tenth of the forward's time is expert weights read, a hundredth FLOPs and a hundredth other bytes
    share = {"flop": 0.01, "weights": 0.1, "other": 0.01}
    timed = Profile(untimed.meta, untimed.units.assign(**{
        expert_column(phase, part): np.where(blocks, untimed.units.forward_s * share[part], 0.0)
        for phase in EXPERT_PASSES for part in EXPERT_PARTS}), untimed.edges, untimed.tp_units)
    req = PlanRequest(cluster=_nodes(), global_batch=16, pins=LayoutPins(pp=4, dp=2, ep=2))
    before, after = make_plan(untimed, req), make_plan(timed, req)
    assert any(n.endswith("expert GEMMs timed as at ep 1, every expert's weights read on each rank (its times were "
                          "measured on one device running every expert): an upper bound; an analytic profile "
                          "(`autopp profile --analytic DEVICE`) re-times them") for n in before.notes)
    assert any(n.endswith("expert GEMMs re-timed for a rank reading 1/2 of the expert weights at the same FLOPs (per "
                          "pass max(FLOP time, weight time / ep + other bytes' time))") for n in after.notes)
    assert after.predicted.step_time_s < before.predicted.step_time_s


def _attention_profile(seq: int = 512):  # type: ignore[no-untyped-def]
    """The module's synthetic profile made as if from an HF config: its attention's shape recorded (issue 27)."""
    p = synthetic_profile(18, hidden=1024, seq=seq, tp_degrees=(2, 4))
    hf = {"seq_len": seq, "task": "causal-lm", "model_type": "llama",
          "attention": {"heads": 8, "kv_heads": 8, "head_dim": 128, "causal": True}}
    return replace(p, meta=replace(p.meta, extra={"hf_config": hf}))


def test_cp_choices_fit_the_nodes_and_shard_the_sequence() -> None:
    """Context parallelism (issue 27): searched, 1 and each degree whose cp x tp group divides the devices, fits in a
    node or spans whole nodes, and cuts the sequence into 2 x cp x tp equal chunks; pinned, a degree the sequence
    refuses is one line; a profile without the attention's shape searches cp 1 alone."""
    from autopp.solve.search.request import cp_choices
    auto = PlanRequest(cluster=_nodes(count=2, per=4), global_batch=8, pins=LayoutPins(cp=None, dp=None))
    assert cp_choices(auto, 1, 512) == [1, 2, 4, 8] and cp_choices(auto, 2, 512) == [1, 2, 4]
    assert cp_choices(auto, 1, 24) == [1, 2, 4] and cp_choices(auto, 1, None) == [1]
    six = PlanRequest(cluster=cluster_from_catalog(load_device("h100-sxm"), None, nodes=2, devices_per_node=6),
                      global_batch=8, pins=LayoutPins(cp=None, dp=None))
    assert cp_choices(six, 1, 600) == [1, 2, 3, 6, 12] and cp_choices(six, 2, 600) == [1, 3, 6]  # 4 x 1: 4 of 6
    pinned = PlanRequest(cluster=_nodes(), global_batch=8, pins=LayoutPins(cp=4, tp=2))
    with pytest.raises(LayoutError, match=r"^`cp` 4 with `tp` 2: context parallelism needs seq % \(2 x cp x tp\) == 0 "
                                          r"for causal load balancing, and 24 % 16 = 8$"):
        cp_choices(pinned, 2, 24)
    assert Views(_attention_profile(), auto).degrees()[:4] == ((1, 1), (2, 1), (4, 1), (8, 1))
    with pytest.raises(LayoutError, match=r"cp\(3\) x tp\(1\) = 3 devices neither fit in a node of 4 nor span whole"):
        PlanRequest(cluster=_nodes(count=3, per=4), global_batch=8, pins=LayoutPins(cp=3))


def test_the_search_chooses_cp_as_the_best_of_each_cp_pinned() -> None:
    """cp searched jointly with pp x dp (x ZeRO over dp x cp): the plan is the best of the plans with each degree
    pinned (the brute force over cp); under this memory limit a context-parallel layout beats every cp-1 one."""
    profile = _attention_profile(seq=4096)
    cluster = _nodes(count=1, per=8, memory=4 * GiB)

    def plan(cp: int | None):  # type: ignore[no-untyped-def]
        req = PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(cp=cp, dp=None),
                          recompute=RecomputeMode.AUTO)
        return make_plan(profile, req)

    pinned = {cp: plan(cp).predicted.step_time_s for cp in (1, 2, 4, 8)}
    searched = plan(None)
    best = min(pinned, key=pinned.__getitem__)
    assert searched.layout.cp == best > 1 and searched.predicted.step_time_s == pytest.approx(pinned[best])
    assert pinned[best] < pinned[1]
