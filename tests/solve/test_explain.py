"""Infeasible requests: the error says which rule failed, with the numbers, and what would work (issue 13.14)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.data.cluster import Cluster
from autopp.data.layout import LayoutPins
from autopp.errors import InfeasibleError
from autopp.schedule import ScheduleName
from autopp.solve import PlanRequest, make_plan
from autopp.data.synthetic_profile import synthetic_profile


def _request(devices: int, schedule: ScheduleName | None, global_batch: int = 8, **extra: object) -> PlanRequest:
    return PlanRequest(cluster=Cluster(num_devices=devices, memory_bytes=2**40), global_batch=global_batch,
                       schedule=schedule, pins=LayoutPins(dp=1), **extra)  # type: ignore[arg-type]


def test_interleaved_on_too_few_units_says_stages_per_rank_and_what_works() -> None:
    # was: "no valid configuration for Interleaved1F1B on 4 devices" (HF Mixtral, 6 units)
    with pytest.raises(InfeasibleError, match=r"cannot split 6 units into 8 stages \(Interleaved1F1B runs 2 stages "
                                              r"per rank\): use at most 3 devices; .*or a schedule with one stage per "
                                              r"rank \(`schedule` GPipe or 1F1B or Chimera\); or finer units: SPLIT_POINTS .* "
                                              r"inside a block \(e\.g\. `h\.0\.<child>`"):
        make_plan(synthetic_profile(6), _request(4, ScheduleName.INTERLEAVED_1F1B))
    assert make_plan(synthetic_profile(6), _request(3, ScheduleName.INTERLEAVED_1F1B)).layout.v == 2


def test_too_many_devices_suggests_finer_units() -> None:
    with pytest.raises(InfeasibleError, match=r"cannot split 6 units into 8 stages: use at most 6 devices; .*or finer "
                                              r"units: SPLIT_POINTS in the model file may also name modules inside"):
        make_plan(synthetic_profile(6), _request(8, ScheduleName.ONE_F_ONE_B))


def test_microbatch_rule_gives_the_count_that_works() -> None:
    # DualPipeV needs microbatches >= 2 x ranks: 4 on 2 ranks, not "at least 2"
    with pytest.raises(InfeasibleError, match=r"DualPipeV needs microbatches >= stages \(2 < 4\): use a global batch "
                                              r"of at least 4 \(it is 2\)"):
        make_plan(synthetic_profile(6), _request(2, ScheduleName.DUAL_PIPE_V, global_batch=2))
    with pytest.raises(InfeasibleError, match=r"1F1B needs microbatches >= stages \(2 < 4\): use `num_microbatches` 4 "
                                              r"or more"):
        make_plan(synthetic_profile(6), _request(4, ScheduleName.ONE_F_ONE_B, num_microbatches=2))
    # A tester pinned 9 where the rule wants a multiple of 2 (9 // 4 rounds) and was told "1 or more"
    with pytest.raises(InfeasibleError, match=r"\(9 % 2 = 1\): use `num_microbatches` 8 or 10, fewer devices"):
        make_plan(synthetic_profile(8), _request(4, ScheduleName.INTERLEAVED_1F1B, num_microbatches=9, global_batch=9))


@pytest.mark.parametrize(("devices", "batch", "uneven", "message"), [
    (3, 6, False, "Chimera needs an even number of pipeline ranks (3 % 2 = 1): use an even `pp` or number of "
                  "`devices`, or another `schedule`"),
    (4, 3, False, "Chimera needs an even number of microbatches, half per direction (global batch 3 gives [1, 3]): "
                  "use an even `global_batch` or `num_microbatches`"),
    (2, 2, True, "Chimera needs rank r and rank pp - 1 - r to have the same device and links (its two replicas of a "
                 "stage run alike), which these 2 devices do not: use another `schedule`"),
])
def test_chimera_says_which_of_its_rules_failed(devices: int, batch: int, uneven: bool, message: str) -> None:
    from autopp.data.cluster import Device
    kinds = (Device(memory_bytes=2**40, speed=1.0), Device(memory_bytes=2**40, speed=2.0)) if uneven else ()
    req = PlanRequest(cluster=Cluster(num_devices=devices, memory_bytes=2**40, devices=kinds), global_batch=batch,
                      schedule=ScheduleName.CHIMERA, pins=LayoutPins(dp=1))
    with pytest.raises(InfeasibleError) as err:
        make_plan(synthetic_profile(12), req)
    assert str(err.value) == message


def _short_of_memory(schedule: ScheduleName, memory: int = 2**30) -> PlanRequest:
    from autopp.solve import RecomputeMode
    return PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=memory), global_batch=8, schedule=schedule,
                       pins=LayoutPins(dp=1), recompute=RecomputeMode.AUTO)


def test_memory_hint_of_a_split_backward_is_the_orders_peak_and_works() -> None:
    # was (DeepSeek-V3 pinned, DualPipeV, docs/published.md): "no split of 63 units fits in 71.5 GiB ...; the smallest
    # that works is 44.7 GiB (120 microbatches, 0 B more per device)": the split's count (the DP's floor) is below
    # what the order holds once the backward is split, so that memory did not work
    from autopp.sizes import parse_size
    profile = synthetic_profile(10, hidden=1024, seq=32768)  # activations dominate
    with pytest.raises(InfeasibleError, match=r"its split that needs least \(2\.59 GiB per device in the split's "
                                              r"count, recompute-units\) peaks at 5\.05 GiB in ZBVZeroBubble's order "
                                              r"\(v 2; a split backward holds recomputed activations from I to W\), "
                                              r"which works \(with 8 microbatches: .*\); use `memory_bytes` (\S+) or more"
                       ) as info:
        make_plan(profile, _short_of_memory(ScheduleName.ZBV_ZERO_BUBBLE))
    suggested = parse_size(info.value.args[0].split("`memory_bytes` ")[1].split()[0])
    plan = make_plan(profile, _short_of_memory(ScheduleName.ZBV_ZERO_BUBBLE, suggested))
    assert max(plan.predicted.peak_memory_bytes) <= suggested
    with pytest.raises(InfeasibleError):  # the split's count alone
        make_plan(profile, _short_of_memory(ScheduleName.ZBV_ZERO_BUBBLE, parse_size("2.6GiB")))


def test_memory_hint_names_a_memory_that_works_above_the_orders_peak() -> None:
    from autopp.sizes import parse_size
    profile = synthetic_profile(10, hidden=1024, seq=16384)
    with pytest.raises(InfeasibleError, match=r"peaks at 2\.33 GiB in DualPipeV's order \(v 2; a split backward "
                                              r"holds recomputed activations from I to W\), and no plan fits in "
                                              r"2\.33 GiB: use `memory_bytes` 2\.6GiB or more \(a plan fits there\)$"):
        make_plan(profile, _short_of_memory(ScheduleName.DUAL_PIPE_V))
    with pytest.raises(InfeasibleError):
        make_plan(profile, _short_of_memory(ScheduleName.DUAL_PIPE_V, parse_size("2.33GiB")))
    # a tester: the message named no memory that works; the one it names does
    assert make_plan(profile, _short_of_memory(ScheduleName.DUAL_PIPE_V, parse_size("2.6GiB"))).stages


@pytest.mark.parametrize("devices, dp, fix", [(4, 4, "a smaller `dp`"), (1, 1, "more `devices`")])
def test_several_stages_on_one_pipeline_rank_are_refused_with_what_works(devices: int, dp: int, fix: str) -> None:
    """A schedule of two stages per rank pinned where the layout leaves one pipeline rank (the search offers it
    nowhere there: a looped single rank that no trainer runs)."""
    for schedule in (ScheduleName.INTERLEAVED_1F1B, ScheduleName.ZBV_ZERO_BUBBLE):
        with pytest.raises(InfeasibleError, match=rf"^{schedule.value} runs 2 stages per rank, which needs 2 pipeline "
                                                  rf"ranks or more, and `dp` {dp} on {devices} devices leaves 1: use "
                                                  rf"{fix}, or a `schedule` of 1 stage per rank$"):
            make_plan(synthetic_profile(12), PlanRequest(cluster=Cluster(num_devices=devices, memory_bytes=2**40),
                                                         global_batch=8, schedule=schedule, pins=LayoutPins(dp=dp)))


def test_the_global_batch_hint_keeps_the_pinned_microbatches() -> None:
    """The hint said "a global batch of 16 has one" with 6 microbatches pinned (16 is not divisible by 6: following
    it gave "global batch 16 is not divisible by 6 microbatches"); the batch it gives now plans as it is."""
    profile = synthetic_profile(4)

    def request(batch: int) -> PlanRequest:
        return PlanRequest(cluster=Cluster(num_devices=8, memory_bytes=2**40), global_batch=batch, num_microbatches=6,
                           schedule=ScheduleName.INTERLEAVED_1F1B, pins=LayoutPins(dp=None))
    with pytest.raises(InfeasibleError, match=r"no valid configuration for Interleaved1F1B .*: a global batch of 24 "
                                              r"has one$"):
        make_plan(profile, request(12))
    assert make_plan(profile, request(24)).num_microbatches == 6


def test_a_pinned_stage_no_configuration_has_is_refused_with_the_stage_count() -> None:
    # tester: `--pp 2 --schedule 1F1B --recompute-stages 5` wrote a 2-stage plan in which every stage kept
    with pytest.raises(InfeasibleError, match=r"^`recompute_stages` 5: the configurations searched have 2 stages, "
                                              r"none a stage 5; pin stages below 2$"):
        make_plan(synthetic_profile(8), _request(2, ScheduleName.ONE_F_ONE_B, recompute_stages=(5,)))


def test_a_pinned_stage_keeps_the_configurations_that_have_it() -> None:
    """With the schedule searched, only configurations with a stage 5 (here 2 ranks x 4 stages) are planned."""
    plan = make_plan(synthetic_profile(8), _request(2, None, recompute_stages=(5,)))
    assert len(plan.stages) > 5 and [s.index for s in plan.stages if s.activation.value == "recompute"] == [5]


def test_a_pinned_v_is_never_ignored() -> None:
    """A tester's pinned `v` was dropped by the schedules that run a fixed count (ZBVZeroBubble ran 2 for 3; a
    trainer's 1F1B ran 1 for 2): searched, only the schedules that run it are tried."""
    from autopp.schedule import describe
    plan = make_plan(synthetic_profile(8), PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**40),
                                                       global_batch=8, schedule=None, pins=LayoutPins(dp=1, v=3)))
    assert plan.layout.v == 3 and describe(plan.schedule).fixed_v is None
    assert describe(ScheduleName.ZBV_ZERO_BUBBLE).v_choices(3) == [] == describe(ScheduleName.GPIPE).v_choices(2)
    assert describe(ScheduleName.ZBV_ZERO_BUBBLE).v_choices(None) == [2]
    assert describe(ScheduleName.ZBV_ZERO_BUBBLE).v_choices(2) == [2]


def test_a_pinned_zero_stage_is_never_dropped_for_dp_1() -> None:
    """A tester's `--zero 3` with dp searched came out as dp 1 without ZeRO: a sharding stage keeps the search to
    dp > 1, and where the pinned degrees leave dp 1 it is refused in one line."""
    from autopp.data.zero import ZERO
    from autopp.errors import LayoutError
    cluster = Cluster(num_devices=4, memory_bytes=2**40)
    plan = make_plan(synthetic_profile(8), PlanRequest(cluster=cluster, global_batch=8, schedule=None,
                                                       pins=LayoutPins(dp=None, zero=ZERO[1])))
    assert plan.layout.dp > 1 and plan.layout.zero.stage == 1
    with pytest.raises(LayoutError, match=r"^ZeRO 3 shards over data-parallel replicas, and 4 devices with `pp` 4 "
                                          r"leave dp 1: give more devices, a smaller `pp`, or `zero` 0$"):
        make_plan(synthetic_profile(8), PlanRequest(cluster=cluster, global_batch=8,
                                                    pins=LayoutPins(pp=4, dp=None, zero=ZERO[3])))


def test_finer_units_of_an_hf_config_are_a_model_files() -> None:
    """A tester: an HF config's plan was told to add SPLIT_POINTS "in the model file", which it has none of."""
    profile = synthetic_profile(6)
    hf = replace(profile, meta=replace(profile.meta, extra={**profile.meta.extra, "hf_config": {"seq_len": 8}}))
    with pytest.raises(InfeasibleError, match=r"use at most 6 devices; .*or finer units: an HF config's units are its "
                                              r"layers, so a model file that builds the model and names SPLIT_POINTS"):
        make_plan(hf, _request(8, ScheduleName.ONE_F_ONE_B))


def test_a_mixture_of_experts_that_fits_only_with_expert_parallelism_is_told_so() -> None:
    """A tester: DeepSeek-V3 on 2,048 H800 was told only to give more memory, where `ep` auto fits; a pinned ep
    that divides no dp the devices leave is said as such, not as the global batch's fault."""
    from autopp.data.layout import LayoutPins
    from tests.costmodel.test_parallel import _moe_profile
    profile = _moe_profile()
    request = PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=2_000_000), global_batch=8,
                          pins=LayoutPins(ep=1, dp=4, pp=1))
    with pytest.raises(InfeasibleError, match=r"; `ep` auto fits \(ep 2: each rank holds 1/ep of the experts\)$"):
        make_plan(profile, request)
    assert make_plan(profile, replace(request, pins=LayoutPins(ep=None, dp=4, pp=1))).layout.ep == 2
    pinned = replace(request, cluster=Cluster(num_devices=8, memory_bytes=2**30), pins=LayoutPins(ep=4, pp=4, dp=None))
    with pytest.raises(InfeasibleError, match=r"^`ep` 4 is carved from a stage's data-parallel ranks and divides none "
                                              r"of the dp degrees \[2\] the 8 devices leave: give a `pp` that leaves"):
        make_plan(profile, pinned)
