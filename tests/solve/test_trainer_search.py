"""`PlanRequest.trainer` (`autopp plan --for`): the search keeps to what the trainer runs (autopp.data.trainers), one
activation policy for every stage, and its plan exports; without it the search may pick what the trainer cannot run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.data.cluster import Cluster
from autopp.data.layout import LayoutPins
from autopp.data.overlap import Overlap
from autopp.data.profile import Profile
from autopp.data.trainers import trainer_rules
from autopp.data.zero import ZERO
from autopp.errors import InfeasibleError, LayoutError, ProfileError
from autopp.export import Target, export_plan
from autopp.schedule import Activation, ScheduleName
from autopp.solve import PlanRequest, RecomputeMode, make_plan
from autopp.solve.search.request import Group, configs


def _request(**kw: object) -> PlanRequest:
    base: dict[str, object] = dict(cluster=Cluster(num_devices=4, memory_bytes=2 << 30), global_batch=8,
                                   schedule=None, recompute=RecomputeMode.AUTO)
    return PlanRequest(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("trainer", ["megatron", "deepspeed"])
def test_every_configuration_searched_is_one_the_trainer_runs(shipped_gpt: Profile, trainer: str) -> None:
    rules = trainer_rules(trainer)
    free, kept = configs(_request(), shipped_gpt.num_units), configs(_request(trainer=trainer), shipped_gpt.num_units)
    assert kept and len(kept) < len(free)
    assert {c.schedule for c in kept} <= set(rules.schedules)
    assert all(rules.schedule_refusal(c.schedule, c.layout, c.m) is None for c in kept)
    assert set(kept) == {c for c in free if rules.schedule_refusal(c.schedule, c.layout, c.m) is None
                         and rules.layout_refusal(c.layout) is None}


def test_megatron_plan_exports_where_the_free_one_does_not(shipped_gpt: Profile) -> None:
    """On 4 ranks of the shipped gpt profile the unrestricted search (with synthesis) picks an order Megatron-Core
    cannot run; `trainer` megatron picks one it runs, with one policy for every stage, at a step no faster."""
    free = make_plan(shipped_gpt, _request(synthesize=True))
    mine = make_plan(shipped_gpt, _request(trainer="megatron"))
    assert free.schedule not in trainer_rules("megatron").schedules
    assert mine.schedule in trainer_rules("megatron").schedules
    assert len({s.activation for s in mine.stages}) == 1
    assert mine.predicted.step_time_s >= free.predicted.step_time_s
    assert any("`trainer` megatron applies one activation policy" in n for n in mine.notes)
    assert "--pipeline-model-parallel-size" in export_plan(mine, Target.MEGATRON, "x").text
    # a tester: the plan "fit" counting the profile's sgd, which Megatron's Adam would exceed; the plan says so
    said = [n for n in mine.notes if n.startswith("optimizer: the plan's memory counts sgd's state (the profile's); "
                                                  "Megatron-Core trains with Adam")]
    assert len(said) == 1 and said[0].endswith("profile again with --optimizer adamw (2 fp32 states per parameter) "
                                               "and plan again")
    assert said[0].removeprefix("optimizer: ") in " ".join(export_plan(mine, Target.MEGATRON, "x").notes)  # as said
    assert not any(n.startswith("optimizer:") for n in free.notes)  # no trainer, nothing to compare with


def test_a_uniform_policy_is_chosen_under_a_tight_memory(shipped_gpt: Profile) -> None:
    """Under a memory limit where the free search recomputes some stages only, a trainer's plan gives every stage
    one policy (here all keep, at other microbatches), and fits."""
    free = make_plan(shipped_gpt, _request(schedule=ScheduleName.ONE_F_ONE_B))
    tight = replace(_request().cluster, memory_bytes=int(max(free.predicted.peak_memory_bytes) * 0.9))
    mixed = make_plan(shipped_gpt, _request(cluster=tight))
    plan = make_plan(shipped_gpt, _request(cluster=tight, trainer="deepspeed"))
    assert len({s.activation for s in mixed.stages}) == 2
    assert len({s.activation for s in plan.stages}) == 1
    assert max(plan.predicted.peak_memory_bytes) <= tight.memory_bytes


@pytest.mark.parametrize("kw, message", [
    ({"trainer": "nemo"}, "`trainer` 'nemo' is not one autopp exports to"),
    ({"trainer": "megatron", "synthesize": True}, "`synthesize` with `trainer` megatron: Megatron-Core runs no"),
    ({"trainer": "deepspeed", "schedule": ScheduleName.GPIPE}, "`schedule` GPipe with `trainer` deepspeed"),
    ({"trainer": "torchtitan", "recompute": RecomputeMode.NONE, "recompute_stages": (1,)},
     "`recompute_stages` pins a policy per stage, and torchtitan applies one to every stage: give `recompute` auto"),
])
def test_requests_a_trainer_cannot_run_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("(", r"\(")):
        _request(**kw)


@pytest.mark.parametrize("kw, message", [
    # the tester's --zero 2 --for torchtitan, planned pp 8 x dp 1 (where ZeRO no longer matters) instead of refused
    ({"trainer": "torchtitan", "pins": LayoutPins(zero=ZERO[2], dp=None)}, "`trainer` torchtitan cannot run `zero` 2: "
                                                                           "torchtitan has no ZeRO stage 2"),
    ({"trainer": "megatron", "pins": LayoutPins(zero=ZERO[3], pp=2, dp=None)}, "`trainer` megatron cannot run `zero` "
                                                                               "3 with `pp` 2: Megatron-LM shards"),
    # planned a whole-stage checkpoint, which the export refused ("re-plan with `activations` keep or ...")
    ({"trainer": "torchtitan", "recompute": RecomputeMode.ALL},
     "`recompute` all .activation policy recompute. with `trainer` torchtitan: torchtitan's activation_checkpoint"),
    # issue 30: Megatron-Core's combined 1F1B, which neither torchtitan nor DeepSpeed runs
    ({"trainer": "torchtitan", "overlap": Overlap(ep_a2a=True)}, "`overlap` ep_a2a with `trainer` torchtitan: "
                                                                 "torch.distributed.pipelining's schedules run each"),
    ({"trainer": "deepspeed", "overlap": Overlap(ep_a2a=True)}, "`overlap` ep_a2a with `trainer` deepspeed: its "
                                                                "TrainSchedule runs each microbatch's forward"),
])
def test_what_the_trainer_cannot_run_is_refused_before_the_search(monkeypatch: pytest.MonkeyPatch,
                                                                  shipped_gpt: Profile, kw: dict[str, object],
                                                                  message: str) -> None:
    import autopp.solve.assemble.make as make
    monkeypatch.setattr(make, "_make_plan", lambda *a: pytest.fail("searched"))
    with pytest.raises(LayoutError, match=message):
        make_plan(shipped_gpt, _request(**kw))


@pytest.mark.parametrize("trainer", ["torchtitan", "megatron", "deepspeed"])
def test_offload_is_offered_only_without_a_trainer(trainer: str) -> None:
    """No trainer applies autopp's per-stage activation offload (`ActivationPolicy.refusal`): where the free search
    offloads a stage, the trainer's plan gives every stage one policy it applies."""
    from autopp.data.catalog import cluster_from_catalog, load_device
    from autopp.data.layout import LayoutPins
    from autopp.data.synthetic_profile import synthetic_profile
    from autopp.schedule import Activation
    cluster = cluster_from_catalog(load_device("h100-sxm"), 4, memory_bytes=int(2.35 * 2**30))
    profile, pins = synthetic_profile(6, hidden=2048, seq=8192), LayoutPins(pp=4, dp=1, tp=1)
    ask = dict(cluster=cluster, num_microbatches=8, schedule=ScheduleName.ONE_F_ONE_B, pins=pins)
    assert Activation.OFFLOAD in {s.activation for s in make_plan(profile, _request(**ask)).stages}
    plan = make_plan(profile, _request(**ask, trainer=trainer))
    used = {s.activation for s in plan.stages}
    assert len(used) == 1 and Activation.OFFLOAD not in used


@pytest.mark.parametrize("axis", ["cp", "ep"])
def test_torchtitan_search_beside_cp_or_ep_never_replicates(shipped_gpt: Profile, axis: str) -> None:
    """Review: `--for torchtitan` with cp 2 searched ZeRO 0, which torchtitan runs as FSDP over dp_shard x cp; a new
    user's: with ep 2 it kept ZeRO 0, whose export (dp_shard 1) builds no expert mesh in torchtitan. It keeps only
    the ZeRO stages that shard, where the unrestricted search has ZeRO 0 too."""
    from autopp.data.layout import LayoutPins
    pins = LayoutPins(pp=2, dp=None if axis == "cp" else 2, zero=None, **{axis: 2})
    groups = (Group(2, 1),) if axis == "cp" else (Group(1, 1),)
    free = configs(_request(pins=pins), shipped_gpt.num_units, groups)
    kept = configs(_request(pins=pins, trainer="torchtitan"), shipped_gpt.num_units, groups)
    assert all(getattr(c.layout, axis) == 2 for c in free) and any(c.layout.zero.replicated for c in free)
    assert kept and not any(c.layout.zero.replicated for c in kept)


def test_no_search_puts_several_stages_on_one_pipeline_rank(shipped_gpt: Profile) -> None:
    """Issue 26: without `trainer`, a `--pin-from` run picked Interleaved1F1B at pp 1 x dp 16 with v 2, a looped
    single rank that no trainer runs (Megatron-Core's parallel_state refuses it); pp 1 is still searched, with one
    stage per rank, and several stages per rank still where pp > 1."""
    found = configs(_request(pins=LayoutPins(dp=None)), shipped_gpt.num_units)
    assert {c.layout.dp for c in found} == {1, 2, 4}
    assert not [c for c in found if c.layout.pp == 1 and c.layout.v > 1]
    assert {c.schedule for c in found if c.layout.pp == 1} == {ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B}
    assert {c.layout.v for c in found if c.layout.pp > 1} >= {1, 2}


@pytest.mark.parametrize("precision, refused", [("bf16-pure", {"megatron", "deepspeed"}), ("fp8", {"deepspeed"}),
                                               ("bf16", set())])
def test_a_profile_in_a_recipe_the_trainer_cannot_train_is_refused_before_the_search(
        shipped_gpt: Profile, precision: str, refused: set[str]) -> None:
    """A bf16-pure profile keeps no master copy, which Megatron-LM and DeepSpeed always keep; DeepSpeed has no FP8:
    `trainer` refuses either in one line before searching, as the export would refuse its plan (autopp.data.
    precision); torchtitan trains all three."""
    made = Profile(replace(shipped_gpt.meta, dtype="bfloat16", extra={**shipped_gpt.meta.extra,
                                                                      "precision": precision}),
                   shipped_gpt.units, shipped_gpt.edges)
    for trainer in sorted(refused):
        with pytest.raises(ProfileError, match=rf"^`trainer` {trainer}: the profile's precision {precision}: .*"
                                               r"count the profile again with `precision` bf16 .*then re-plan$"):
            make_plan(made, _request(trainer=trainer))
    assert make_plan(made, _request(trainer="torchtitan", schedule=ScheduleName.ONE_F_ONE_B)).precision == precision


def test_the_trainers_overlap_is_the_default_on_a_gpu() -> None:
    """DeepSpeed's PipelineEngine reduces gradients only after the last backward (autopp.export.overlap): planned
    `--for deepspeed` on a GPU the default overlap hides none of it; torchtitan and Megatron keep the planner's
    default; an overlap asked for is kept, and CPU ranks overlap nothing whatever the trainer."""
    from autopp.data.overlap import NO_OVERLAP, TRAINER_OVERLAP, Overlap
    gpu = Cluster(num_devices=4, memory_bytes=2 << 30, device_kind="h100-sxm")
    assert _request(cluster=gpu).assumed_overlap == TRAINER_OVERLAP
    assert _request(cluster=gpu, trainer="megatron").assumed_overlap == TRAINER_OVERLAP
    assert _request(cluster=gpu, trainer="torchtitan").assumed_overlap == TRAINER_OVERLAP
    assert _request(cluster=gpu, trainer="deepspeed").assumed_overlap == Overlap(fsdp_prefetch=False,
                                                                                 grad_reduce=False)
    assert _request(cluster=gpu, trainer="deepspeed", overlap=TRAINER_OVERLAP).assumed_overlap == TRAINER_OVERLAP
    assert _request(trainer="deepspeed").assumed_overlap == NO_OVERLAP  # CPU ranks


def test_a_search_the_trainer_empties_says_the_trainers_reason(shipped_gpt: Profile) -> None:
    """The tester's `--pp 4 --schedule Interleaved1F1B --microbatches 6 --for megatron --global-batch 48` said "a
    global batch of 64 has one" (not divisible by the 6 microbatches); the reason is Megatron-Core's groups of pp."""
    req = _request(trainer="megatron", pins=LayoutPins(pp=4), schedule=ScheduleName.INTERLEAVED_1F1B,
                   num_microbatches=6, global_batch=12)
    with pytest.raises(InfeasibleError, match=r"^`trainer` megatron runs none of the 1 configuration the request "
                                              r"leaves \(Megatron-Core's interleaved 1F1B runs microbatches in groups "
                                              r"of pp \(4\) .* but it is 6; re-plan with `num_microbatches` 8"):
        make_plan(shipped_gpt, req)


@pytest.mark.parametrize("kw, message", [
    ({"pins": LayoutPins(pp=4), "num_microbatches": 2, "global_batch": 4}, "use `num_microbatches` 4 or more"),
    ({"pins": LayoutPins(dp=1), "global_batch": 2}, r"use a global batch of at least 4 \(it is 2\)"),
])
def test_the_schedule_rule_said_is_one_of_the_trainers_schedules(shipped_gpt: Profile, kw: dict[str, object],
                                                                  message: str) -> None:
    """With the schedule searched, the microbatch rule said is DeepSpeed's 1F1B's, with its count (it said
    "`num_microbatches` 1 or more", GPipe's, which DeepSpeed does not run; and the tester's `--tp 2 --for deepspeed`
    ended with Chimera's rule)."""
    with pytest.raises(InfeasibleError, match=r"^1F1B needs microbatches >= stages \(2 < 4\): " + message):
        make_plan(shipped_gpt, _request(trainer="deepspeed", **kw))


def test_a_megatron_plan_counts_its_stages_outputs_freed_once_sent(shipped_gpt: Profile) -> None:
    """Megatron-LM frees a stage's outputs once sent (`Trainer.frees_outputs`): `--for megatron` counts none of
    them (the last stage's model output still held), peaks lower on the same split, says so in a note and in the
    JSON, and the exports to a trainer that holds them (and to Megatron from a plan that held them) say what
    differs; asked for (`frees_outputs`) it is counted for any trainer."""
    from autopp.data.plan import Plan
    from autopp.solve.assemble.from_verdict import FREED_NOTE
    req = _request(trainer="megatron", pins=LayoutPins(pp=4), schedule=ScheduleName.ONE_F_ONE_B,
                   num_microbatches=8, recompute=RecomputeMode.NONE,
                   cluster=Cluster(num_devices=4, memory_bytes=64 << 30))
    freed, held = make_plan(shipped_gpt, req), make_plan(shipped_gpt, replace(req, frees_outputs=False))
    assert [s.units for s in freed.stages] == [s.units for s in held.stages]
    assert all(s.output_bytes == 0 for s in freed.stages[:-1]) and all(s.output_bytes > 0 for s in held.stages[:-1])
    assert freed.stages[-1].output_bytes == held.stages[-1].output_bytes
    assert all(f < h for f, h in zip(freed.predicted.peak_memory_bytes[:-1], held.predicted.peak_memory_bytes))
    assert freed.frees_outputs and not held.frees_outputs
    assert FREED_NOTE in freed.notes and FREED_NOTE not in held.notes
    assert freed.to_json()["frees_outputs"] is True and "frees_outputs" not in held.to_json()
    assert Plan.from_json(freed.to_json()).frees_outputs
    asked = make_plan(shipped_gpt, replace(req, trainer=None, frees_outputs=True))
    assert asked.frees_outputs and [s.output_bytes for s in asked.stages] == [s.output_bytes for s in freed.stages]

    def said(plan: Plan, target: Target) -> list[str]:
        modules = [[shipped_gpt.meta.unit_names[u]] for u in range(shipped_gpt.num_units)]
        return [n for n in export_plan(plan, target, "x", modules).notes if n.startswith("stage outputs:")]
    assert said(freed, Target.MEGATRON) == [] == said(held, Target.TORCHTITAN)
    assert "holds each microbatch's until its backward" in said(freed, Target.TORCHTITAN)[0]
    assert "holds each microbatch's until its backward" in said(freed, Target.DEEPSPEED)[0]
    assert "torch's PipelineStage holds each microbatch's" in said(freed, Target.TORCH_CSV)[0]
    assert "Megatron-Core frees them once sent" in said(held, Target.MEGATRON)[0]


def test_an_infeasible_trainer_request_suggests_a_policy_the_trainer_applies_to_every_stage() -> None:
    """A tester: `--recompute none --for megatron` that did not fit was told "`recompute` auto fits (stages: 4 keep,
    4 offload)", which Megatron-LM cannot run (one policy on every stage, no offload); it now names the one policy
    it applies that fits, and the plan `recompute` auto makes for it is that."""
    from autopp.data.synthetic_profile import synthetic_profile
    from autopp.schedule import Activation
    profile = synthetic_profile(10)

    def request(memory: int, recompute: RecomputeMode = RecomputeMode.NONE) -> PlanRequest:
        return _request(cluster=Cluster(num_devices=4, memory_bytes=memory), num_microbatches=8,
                        pins=LayoutPins(pp=4, dp=1), schedule=ScheduleName.ONE_F_ONE_B, trainer="megatron",
                        recompute=recompute)
    peak = max(make_plan(profile, request(2**40)).predicted.peak_memory_bytes)
    with pytest.raises(InfeasibleError, match=r"or: `recompute` auto fits \(every stage recompute-units, as "
                                              r"Megatron-Core applies one policy to all\)"):
        make_plan(profile, request(int(peak * 0.9)))
    auto = make_plan(profile, request(int(peak * 0.9), recompute=RecomputeMode.AUTO))
    assert {s.activation for s in auto.stages} == {Activation.BLOCKS}


def test_megatron_plans_full_recomputation_without_its_ep_a2a_overlap(shipped_gpt: Profile) -> None:
    """Megatron-Core asserts that overlap_moe_expert_parallel_comm runs without full recomputation: with
    `Overlap.ep_a2a`, `--for megatron` plans per-unit recomputation without the overlap, as Megatron would have to
    run it, and says so; the plan of that policy records the overlap off (its export then writes no such flag). It
    runs the overlap on a bf16 or fp16 model only: a float32 profile is refused before any search."""
    request = _request(trainer="megatron", activations=(Activation.KEEP, Activation.BLOCKS),
                       recompute=RecomputeMode.NONE, overlap=Overlap(ep_a2a=True))
    with pytest.raises(LayoutError, match=r"^`overlap` ep_a2a with `trainer` megatron: Megatron-Core runs its EP A2A "
                                          r"overlap on a bf16 or fp16 model only, and the model is float32"):
        make_plan(shipped_gpt, request)
    shipped_gpt = replace(shipped_gpt, meta=replace(shipped_gpt.meta, dtype="bfloat16"))
    said = ("each of keep, recompute-units was planned for all stages (keep, recompute-units fit), the fastest kept; "
            "recompute-units without the ep_a2a overlap, as Megatron-Core refuses full recomputation beside its EP "
            "A2A overlap")
    assert any(said in n for n in make_plan(shipped_gpt, request).notes)
    alone = make_plan(shipped_gpt, replace(request, activations=(Activation.BLOCKS,)))
    assert {s.activation for s in alone.stages} == {Activation.BLOCKS} and alone.overlap == Overlap()
    assert any("recompute-units without the ep_a2a overlap" in n for n in alone.notes)
    kept = make_plan(shipped_gpt, replace(request, activations=(Activation.KEEP,)))
    assert kept.overlap == Overlap(ep_a2a=True)
