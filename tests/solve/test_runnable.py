"""Plans the runner would refuse are not offered: values made from a stage's parameters alone under split I/W
backward (issue 13, point 3), found from the profile's live values without torch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.data.cluster import Cluster
from autopp.data.layout import Layout, LayoutPins
from autopp.errors import InfeasibleError, LayoutError
from autopp.data.profile import LiveValue, Profile
from autopp.schedule import Activation, ScheduleName, describe
from autopp.solve import PlanRequest, make_plan
from autopp.solve.search.search import search
from autopp.solve.search.runnable import split_backward_refusal, weight_only_sends
from autopp.data.synthetic_profile import SIZES, synthetic_profile


def _value(name: str, src: int, dsts: list[int], reads: list[str], needs_grad: bool = True,
           action: str = "send") -> LiveValue:
    return LiveValue.from_json({"name": name, "src": src, "dsts": dsts, "action": action,
                                "relayed_over": list(range(src + 1, dsts[-1])), "needs_grad": needs_grad,
                                "reads": reads, "bytes": {str(b): 64 * b for b in SIZES}}, "test")


def _old(values: list[LiveValue]) -> list[LiveValue]:
    """As in profiles written before `needs_grad` and `reads`."""
    return [replace(v, needs_grad=None, reads=None) for v in values]


def _t5_like(n: int = 8) -> list[LiveValue]:
    """A chain of hidden states h0..h(n-2); unit 2 also makes `bias` from its parameters alone (as T5's first decoder
    block makes the relative-position bias), read by units 3..5; unit 3 makes `mixed` from `bias` and h2."""
    values = [_value("ids", -1, [0], [], needs_grad=False)]
    values += [_value(f"h{u}", u, [u + 1], [f"h{u - 1}"] if u else ["ids"]) for u in range(n - 1)]
    values.append(_value("bias", 2, [3, 4, 5], [], action="relay"))
    values.append(_value("bias2", 3, [4, 5], ["bias"], action="relay"))
    values.append(_value("mask", 0, [1, 2, 3, 4, 5, 6], [], needs_grad=False, action="recompute"))
    return values


def test_a_value_made_from_parameters_only_is_found_where_a_later_stage_reads_it() -> None:
    values = _t5_like()
    assert weight_only_sends(values, ((0, 2), (2, 4), (4, 6), (6, 8))) == [(1, "bias"), (1, "bias2")]
    # bias2 is made from bias, which stage 1 receives with its gradient to send back: not from parameters alone.
    assert weight_only_sends(values, ((0, 3), (3, 6), (6, 8))) == []
    assert weight_only_sends(values, ((0, 2), (2, 6), (6, 8))) == []  # read inside the stage that makes it
    assert weight_only_sends(values, ((0, 2), (2, 3), (3, 8))) == [(1, "bias")]
    assert weight_only_sends(values, ((0, 4), (4, 8))) == []  # the first stage's outputs are fine
    assert weight_only_sends(_old(values), ((0, 2), (2, 4), (4, 6), (6, 8))) == []  # profiles before the fields


def test_the_refusal_names_the_stage_the_value_and_what_runs() -> None:
    why = split_backward_refusal(_t5_like(), ((0, 2), (2, 4), (4, 6), (6, 8)), "ZBVZeroBubble")
    assert why is not None and why.startswith("ZBVZeroBubble excluded: with its split, stage 1 sends on 'bias'")
    assert "(GPipe, 1F1B, Interleaved1F1B, LoopedBFS, Chimera) run it" in why


def _profile() -> Profile:
    p = synthetic_profile(8)
    return Profile(replace(p.meta, live_values=tuple(_t5_like())), p.units, p.edges)


def _request(schedule: ScheduleName | None, synthesize: bool = False) -> PlanRequest:
    return PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=2**40), global_batch=8, schedule=schedule,
                       pins=LayoutPins(pp=4, dp=1), num_microbatches=8, synthesize=synthesize,
                       synth_time_limit_s=2.0)


def test_a_pinned_split_backward_schedule_is_refused_at_planning_with_the_reason() -> None:
    # 4 ranks x 2 stages of one unit each: unit 2's stage would send the bias on; before, the plan was made and the
    # run failed ("stage 2 sends on ['bias'] made from its parameters only ...").
    with pytest.raises(InfeasibleError, match=r"ZBVZeroBubble excluded: with its split, stage 2 sends on 'bias'"):
        make_plan(_profile(), _request(ScheduleName.ZBV_ZERO_BUBBLE))


def test_auto_offers_only_what_runs_and_says_what_it_left_out() -> None:
    plan = make_plan(_profile(), _request(None, synthesize=True))
    assert plan.schedule is not ScheduleName.CUSTOM and not describe(plan.schedule).splits_backward
    assert any(n.startswith("ZBVZeroBubble excluded") for n in plan.notes)
    assert any(n.startswith("a synthesized order excluded") for n in plan.notes)


def test_a_model_without_such_values_keeps_every_schedule() -> None:
    plan = make_plan(synthetic_profile(8), _request(ScheduleName.ZBV_ZERO_BUBBLE))
    assert plan.schedule is ScheduleName.ZBV_ZERO_BUBBLE and not any("excluded" in n for n in plan.notes)


def test_values_every_reader_holds_cross_no_cut() -> None:
    # The runner sends a `recompute` value (a causal mask, rotary tables) to nobody: every stage that reads it holds
    # it. The planner's cut bytes (what a stage sends on, and what a recomputing stage keeps) leave it out.
    from autopp.costmodel import ProfileTable

    profile = _profile()
    for b in SIZES:
        cut = ProfileTable(profile).arrays(b).cut[1:-1]
        assert list(cut) == profile.cut_bytes(b, recompute=True) != profile.cut_bytes(b)


def test_a_pinned_configuration_torch_cannot_run_says_so_in_its_notes() -> None:
    from autopp.solve import Pinned, evaluate_pinned
    from autopp.solve.search.judge import Candidate
    pinned = Pinned(candidate=Candidate(schedule=ScheduleName.ZBV_ZERO_BUBBLE, layout=Layout(pp=2, v=2), microbatches=4,
                                        microbatch_size=2, bounds=((0, 2), (2, 4), (4, 6), (6, 8)),
                                        activations=(Activation.KEEP,) * 4), source="trainer.toml")
    plan = evaluate_pinned(_profile(), Cluster(num_devices=2, memory_bytes=2**40), pinned)
    assert [n for n in plan.notes if n.startswith("does not run")] == [
        "does not run (ZBVZeroBubble): stage 1 sends on 'bias', made from its parameters only, whose gradient "
        "torch's split I/W backward drops (the runner refuses it)",
        "does not run (ZBVZeroBubble): stage 1 sends on 'bias2', made from its parameters only, whose gradient "
        "torch's split I/W backward drops (the runner refuses it)"]
    # One wording for the planner's exclusions and a pinned configuration's notes.
    why = split_backward_refusal(_t5_like(), pinned.candidate.bounds, "ZBVZeroBubble")
    assert why is not None and plan.notes[-2].removeprefix("does not run (ZBVZeroBubble): ") in why


def test_a_faster_baseline_split_the_runner_refuses_does_not_replace_the_dp_split() -> None:
    # The DP's split (uneven, runnable) against the baselines: `even` ((0, 2), (2, 4), ...) simulates faster, but its
    # stage 1 sends the bias on. Before, plan_from_verdict took the fastest fitting baseline unchecked and the ZBV plan
    # carried a split the runner refuses (issue 13, point 3).
    from autopp.costmodel import ProfileTable
    from autopp.solve.assemble.from_verdict import plan_from_verdict
    from autopp.solve.search.judge import Candidate, judge

    profile, request = _profile(), replace(_request(ScheduleName.ZBV_ZERO_BUBBLE), pins=LayoutPins(pp=2),
                                           cluster=Cluster(num_devices=2, memory_bytes=2**40))
    a = ProfileTable(profile).arrays(1)
    dp_split = ((0, 3), (3, 5), (5, 7), (7, 8))
    assert weight_only_sends(_t5_like(), dp_split) == []
    best = judge(a, request.cluster, Candidate(schedule=ScheduleName.ZBV_ZERO_BUBBLE, layout=Layout(pp=2, v=2),
                                               microbatches=8, microbatch_size=1, bounds=dp_split,
                                               activations=(Activation.KEEP,) * 4))
    plan = plan_from_verdict(profile, request, best, a)
    even = plan.baselines["even"]
    assert even.step_time_s < best.step_s and weight_only_sends(_t5_like(), even.stage_units) != []  # the trap
    assert [s.units for s in plan.stages] == list(dp_split)
    unknown = Profile(replace(profile.meta, live_values=tuple(_old(_t5_like()))), profile.units, profile.edges)
    # A profile before `needs_grad` finds no weight-only value: the faster baseline still wins.
    assert [s.units for s in plan_from_verdict(unknown, request, best, ProfileTable(unknown).arrays(1)).stages] == \
        list(even.stage_units)


def test_the_chosen_schedule_is_not_noted_as_excluded() -> None:
    # Unit 1 makes `w` from its parameters alone for unit 2: ZBV on 4 ranks (one unit per stage) sends it on from
    # stage 1 and is left out; on 2 ranks x 2 replicas unit 1 sits in stage 0 and ZBV runs. Before, the ZBV plan's
    # notes still said "ZBVZeroBubble excluded: ...".
    values = [v for v in _t5_like() if v.name not in ("bias", "bias2")] + [_value("w", 1, [2], [])]
    p = synthetic_profile(8)
    profile = Profile(replace(p.meta, live_values=tuple(values)), p.units, p.edges)
    excluded: dict[str, str] = {}
    request = replace(_request(ScheduleName.ZBV_ZERO_BUBBLE), pins=LayoutPins(dp=None), num_microbatches=4)
    search(profile, request, excluded=excluded)
    assert excluded["ZBVZeroBubble"].startswith("ZBVZeroBubble excluded: with its split, stage 1 sends on 'w'")
    plan = make_plan(profile, request)
    assert plan.schedule is ScheduleName.ZBV_ZERO_BUBBLE and (plan.layout.pp, plan.layout.dp) == (2, 2)
    assert not any("excluded" in n for n in plan.notes)


def _zero_request(zero: int, schedule: ScheduleName | None = None, synthesize: bool = False) -> PlanRequest:
    from autopp.data.zero import ZERO
    return PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=2**40), global_batch=8, schedule=schedule,
                       pins=LayoutPins(pp=2, dp=2, zero=ZERO[zero]), synthesize=synthesize, synth_time_limit_s=2.0)


def test_zero_3_is_not_offered_beside_a_split_backward_and_is_refused_pinned() -> None:
    """A tester's run: ZeRO 3 under ZBVZeroBubble, InterleavedZeroBubble or a synthesized order (pp 2 x dp 2) failed
    validation (gradients 100 % off); ZeRO 1 and full backwards matched. The search leaves that out, a pin is
    refused with the reason, and ZeRO 1 keeps every schedule."""
    from autopp.solve.search.request import configs
    searched = {c.schedule for c in configs(_zero_request(3), 8)}
    assert searched and not any(describe(s).splits_backward for s in searched)
    split = {s for s in ScheduleName if describe(s).splits_backward}
    assert split <= {c.schedule for c in configs(_zero_request(1), 8)}
    plan = make_plan(synthetic_profile(8), _zero_request(3, synthesize=True))
    assert plan.layout.zero.stage == 3 and plan.schedule is not ScheduleName.CUSTOM
    assert not describe(plan.schedule).splits_backward
    with pytest.raises(LayoutError, match=r"^`zero` 3 with ZBVZeroBubble: torch.distributed.pipelining's split "
                                          r"backward .* plan with `zero` 1, or one of GPipe, 1F1B, Interleaved1F1B"):
        _zero_request(3, ScheduleName.ZBV_ZERO_BUBBLE)
