"""autopp.data.trainers: what each trainer runs beside pipeline parallelism, read by `--for` and the exporters."""

from __future__ import annotations

import pytest

from autopp.data.layout import Layout, LayoutPins
from autopp.data.trainers import TRAINER_RULES, interleaving_problem, trainer_rules
from autopp.data.zero import ZERO
from autopp.schedule import ScheduleName

S = ScheduleName


@pytest.mark.parametrize("trainer, runs", [
    ("torchtitan", {s for s in S} - {S.CHIMERA, S.SEQ_1F1B}),  # torch's named schedules, synthesized orders (CSV)
    ("megatron", {S.ONE_F_ONE_B, S.INTERLEAVED_1F1B}),
    ("deepspeed", {S.ONE_F_ONE_B}),
])
def test_each_trainer_runs_its_schedules(trainer: str, runs: set[ScheduleName]) -> None:
    rules = trainer_rules(trainer)
    layout = Layout(pp=2, v=2)  # interleaved placements; 4 microbatches: a multiple of pp
    ran = {s for s in S if rules.schedule_refusal(s, layout if s is S.INTERLEAVED_1F1B else Layout(pp=2), 4) is None}
    assert ran == runs
    assert set(TRAINER_RULES) == {"torchtitan", "megatron", "deepspeed"}


def test_no_trainer_runs_sequence_pipelining() -> None:
    """No trainer ships Seq1F1B: every exporter refuses it in one line and `--for` never offers it."""
    for name, rules in TRAINER_RULES.items():
        assert S.SEQ_1F1B not in rules.schedules
        assert rules.schedule_refusal(S.SEQ_1F1B, Layout(pp=2), 4) == f"{rules.title} runs only {rules.runs}"


def test_one_stage_on_one_pipeline_rank_is_no_pipeline_to_refuse() -> None:
    """A new user's pp 1 x tp 2 plan (named GPipe by the search) was refused by the Megatron and DeepSpeed exports
    for its schedule's name, although without a pipeline each runs it (no schedule at all); sequence chunks still
    need Seq1F1B, which none runs."""
    for rules in TRAINER_RULES.values():
        assert rules.schedule_refusal(S.GPIPE, Layout(pp=1, tp=2), 1) is None
        assert rules.schedule_refusal(S.SEQ_1F1B, Layout(pp=1), 4) == f"{rules.title} runs only {rules.runs}"
    assert trainer_rules("megatron").schedule_refusal(S.GPIPE, Layout(pp=2), 4) is not None


def test_megatron_interleaving_needs_pp_above_1_and_groups_of_pp() -> None:
    """The plan that megatron-core's parallel_state rejected (issue 26: Interleaved1F1B on one pipeline rank) is
    refused; microbatches that are not a multiple of pp are refused with the count to use."""
    rules = trainer_rules("megatron")
    assert "needs more than one pipeline rank" in str(rules.schedule_refusal(S.INTERLEAVED_1F1B, Layout(pp=1, v=2), 4))
    assert "it is 3; re-plan with `num_microbatches` 4" in str(interleaving_problem(2, 3))
    assert rules.schedule_refusal(S.INTERLEAVED_1F1B, Layout(pp=2, v=2), 6) is None
    assert trainer_rules("torchtitan").schedule_refusal(S.INTERLEAVED_1F1B, Layout(pp=2, v=2), 3) is None


def test_layout_rules_read_the_zero_and_axis_descriptors() -> None:
    assert trainer_rules("torchtitan").layout_refusal(Layout(pp=2, dp=2, zero=ZERO[2])) is not None
    assert trainer_rules("torchtitan").layout_refusal(Layout(pp=2, dp=2, zero=ZERO[3])) is None
    assert str(trainer_rules("megatron").layout_refusal(Layout(pp=2, dp=2, zero=ZERO[3]))).startswith(
        "zero 3 with pp 2: Megatron-LM shards parameters only through FSDP")
    assert trainer_rules("megatron").layout_refusal(Layout(pp=1, dp=2, zero=ZERO[3])) is None
    assert str(trainer_rules("deepspeed").layout_refusal(Layout(pp=2, tp=2))).startswith("tp 2: ")
    assert trainer_rules("deepspeed").layout_refusal(Layout(pp=2, dp=2, zero=ZERO[1])) is None


def test_hsdp_runs_in_torchtitan_alone() -> None:
    """Issue 25 item 3: HSDP (dp_replicate > 1) is torchtitan's replicate x shard; Megatron-LM and DeepSpeed say
    their nearest and refuse it, so `--for` them never chooses it."""
    hsdp = Layout(pp=2, dp=4, zero=ZERO[1], dp_replicate=2)
    assert trainer_rules("torchtitan").layout_refusal(hsdp) is None
    assert "--num-distributed-optimizer-instances" in (trainer_rules("megatron").layout_refusal(hsdp) or "")
    assert "ZeRO++ hpZ, MiCS" in (trainer_rules("deepspeed").layout_refusal(hsdp) or "")
    assert trainer_rules("megatron").layout_refusal(Layout(pp=2, dp=4, zero=ZERO[1])) is None


@pytest.mark.parametrize("trainer", sorted(TRAINER_RULES))
def test_no_trainer_runs_chimera_and_each_says_so_in_one_line(trainer: str) -> None:
    rules = trainer_rules(trainer)
    assert S.CHIMERA not in rules.schedules
    why = rules.schedule_refusal(S.CHIMERA, Layout(pp=2), 4)
    assert why is not None and why.startswith(f"{rules.title} runs no bidirectional pipelines (Chimera's two "
                                              "replicas of every stage per rank), only ") and "\n" not in why


def test_torchtitan_keeps_no_whole_replicas_beside_cp() -> None:
    """Review: torchtitan shards over dp_shard x cp whenever cp > 1 (`ParallelDims.fsdp_enabled`), so ZeRO 0 beside
    cp is refused for it (and `--for torchtitan` never chooses it); Megatron-LM runs DDP beside cp."""
    titan = trainer_rules("torchtitan")
    why = titan.layout_refusal(Layout(pp=2, dp=2, cp=2))
    assert str(why).startswith("zero 0 with cp 2: torchtitan shards over dp_shard x cp whenever cp > 1")
    assert str(why).endswith("; re-plan with `zero` 1 or 3, or `cp` 1") and "\n" not in str(why)
    assert titan.layout_refusal(Layout(pp=2, dp=1, cp=2, zero=ZERO[1])) is None
    assert titan.layout_refusal(Layout(pp=2, dp=2)) is None
    assert trainer_rules("megatron").layout_refusal(Layout(pp=2, dp=2, cp=2)) is None


@pytest.mark.parametrize("trainer, pins, said", [
    ("torchtitan", LayoutPins(zero=ZERO[2], dp=None, tp=None), "`trainer` torchtitan cannot run `zero` 2: torchtitan "
                                                                "has no ZeRO stage 2"),
    ("deepspeed", LayoutPins(zero=ZERO[3], dp=None, tp=None), "`trainer` deepspeed cannot run `zero` 3: DeepSpeed's "
                                                               "PipelineEngine runs ZeRO stage 0 or 1 only"),
    ("megatron", LayoutPins(zero=ZERO[3], pp=2, dp=None, tp=None),
     "`trainer` megatron cannot run `zero` 3 with `pp` 2: Megatron-LM shards parameters only through FSDP"),
    ("megatron", LayoutPins(zero=ZERO[3], dp=2, tp=2), "`zero` 3 with `pp` 4:"),  # pp 16 / (dp 2 x tp 2), not pinned
    ("deepspeed", LayoutPins(tp=2, dp=None, zero=None), "`trainer` deepspeed cannot run `tp` 2: DeepSpeed's"),
    ("megatron", LayoutPins(dp=4, dp_replicate=2, zero=ZERO[1]), "`trainer` megatron cannot run `dp_replicate` 2 "
                                                                  "(HSDP):"),
])
def test_pins_the_trainer_refuses_are_refused_in_the_layouts_words(trainer: str, pins: LayoutPins, said: str) -> None:
    """The tester's `--zero 2 --for torchtitan` (planned pp 8 x dp 1, where ZeRO no longer matters), `--zero 3 --for
    deepspeed` (pp 16 x dp 1) and `--zero 3 --pp 2 --for megatron` (dp 1): refused, the exporter's reason given."""
    assert said in str(trainer_rules(trainer).pins_refusal(pins, 16))


@pytest.mark.parametrize("trainer, pins", [
    ("megatron", LayoutPins(zero=ZERO[3], dp=None, tp=None)),  # pp 1 left to the search: Megatron-FSDP runs it
    ("torchtitan", LayoutPins(zero=ZERO[3], pp=2, dp=None, tp=None)),
    ("deepspeed", LayoutPins(zero=None, dp=None, tp=None)),  # searched: the search keeps to what it runs
    ("torchtitan", LayoutPins(zero=None, cp=2, dp=None, tp=None)),  # ZeRO 0 beside cp refused only when pinned
])
def test_pins_the_trainer_runs_or_leaves_to_the_search_are_not_refused(trainer: str, pins: LayoutPins) -> None:
    assert trainer_rules(trainer).pins_refusal(pins, 16) is None


def test_torchtitan_carves_ep_from_its_shard_group() -> None:
    """A new user's export: torchtitan builds its expert mesh from dp_shard x cp x tp / ep, so an ep plan at ZeRO 0
    (dp written as data_parallel_replicate_degree, dp_shard 1) builds no mesh there: refused for it, in the layout's
    words and the pins'; Megatron-LM carves ep from dp x cp."""
    titan = trainer_rules("torchtitan")
    why = titan.layout_refusal(Layout(pp=2, dp=2, ep=2))
    assert str(why).startswith("zero 0 with ep 2: torchtitan carves the ep ranks from dp_shard x cp x tp")
    assert str(why).endswith("re-plan with `zero` 1 or 3, or `ep` 1") and "\n" not in str(why)
    assert titan.layout_refusal(Layout(pp=2, dp=2, ep=2, zero=ZERO[1])) is None
    assert titan.layout_refusal(Layout(pp=1, dp=4, ep=4, zero=ZERO[3])) is None
    assert trainer_rules("megatron").layout_refusal(Layout(pp=2, dp=2, ep=2)) is None
    pinned = titan.pins_refusal(LayoutPins(pp=2, dp=2, ep=2, zero=ZERO[0]), 4)
    assert str(pinned).startswith("`trainer` torchtitan cannot run `zero` 0 with `ep` 2: ")
    assert titan.pins_refusal(LayoutPins(pp=2, dp=2, ep=2, zero=None), 4) is None


def test_megatron_frees_a_stages_outputs_once_sent_and_the_others_hold_them() -> None:
    """Megatron-LM frees each stage's outputs once sent (`deallocate_pipeline_outputs`, which its arguments set);
    torch's PipelineStage (torchtitan, autopp run) and DeepSpeed's engine hold them; what the request asks wins."""
    from autopp.data.trainers import frees_outputs
    assert [trainer_rules(t).frees_outputs for t in ("megatron", "torchtitan", "deepspeed")] == [True, False, False]
    assert frees_outputs("megatron", None) and not frees_outputs("torchtitan", None) and not frees_outputs(None, None)
    assert frees_outputs(None, True) and frees_outputs("torchtitan", True) and not frees_outputs("megatron", False)
