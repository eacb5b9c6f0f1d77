"""Integration tests of run_plan on models that are not chains: a Hugging Face GPT-2 whose embedding is tied to its
head, a mask and a residual that skip stages under multi-stage schedules, and T5 (two gloo ranks); HF decoders with
rotary tables (Qwen2, GPT-NeoX) and a U-Net with long skips on four ranks under GPipe, 1F1B, Interleaved1F1B and V
schedules, a GPT-NeoX plan made with every schedule open (auto) and run, and a Qwen3-MoE mixture of experts on
two ranks (Mixtral and Qwen2-MoE: tests/test_moe_regression.py).
scripts/check_models.py runs the whole model x schedule matrix (docs/models.md)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from autopp.data.layout import Layout
from autopp.data.plan import Plan
from autopp.run import GRAD_RTOL, RunOptions, run_plan
from autopp.run.runner import FREED_RUN_NOTE
from autopp.schedule import Activation

from .conftest import ROOT, pipeline_plan, two_stage_plan

pytestmark = pytest.mark.integration

HF_GPT2 = ROOT / "examples" / "hf_gpt2.py"
HF_T5 = ROOT / "examples" / "hf_t5.py"
MASKED = ROOT / "tests" / "models" / "masked.py"
MODELS = ROOT / "tests" / "models"


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    """Skips without transformers; imported here, not at collection, so collecting the unit tier does not pay for it."""
    pytest.importorskip("transformers")


def test_tied_gpt2_sums_embedding_and_head_gradients_and_recomputes() -> None:
    # GPT-2's token embedding (stage 0) is the LM head's weight (stage 1): each rank holds a copy, and each copy's
    # gradient must be the sum of both shares (unsummed, stage 0's differs from the reference by ~80%). The loss
    # reads `output.logits`; stage 1 runs under activation checkpointing.
    plan = two_stage_plan(HF_GPT2, "transformer.h.2")
    plan = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], activation=Activation.RECOMPUTE)))
    report = run_plan(plan, RunOptions(steps=2, timeout_s=120))
    assert report.passed and report.notes == ()
    tied = [d for d in report.grad_diffs if d.name == "transformer.wte.weight"]
    assert [d.stage for d in tied] == [0, 1] and all(d.max_rel <= GRAD_RTOL for d in tied)
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)


def test_values_that_skip_stages_are_relayed_under_a_split_backward_v_schedule() -> None:
    # Stage 1 relays the embedding to stage 2 (rank 1 to rank 1 under ZBV's V layout) and stages 1 and 2 hold the
    # causal mask; stage 1 recomputes its activations and stages 0 and 3 recompute selectively (matmul outputs kept),
    # under the split I/W backward.
    plan = pipeline_plan(MASKED, ["blocks.1", "blocks.2", "head"], "ZBVZeroBubble", Layout(pp=2, v=2),
                         num_microbatches=4)
    policies = (Activation.SELECTIVE, Activation.RECOMPUTE, Activation.KEEP, Activation.SELECTIVE)
    plan = replace(plan, stages=tuple(replace(s, activation=a) for s, a in zip(plan.stages, policies)),
                   frees_outputs=True)  # as `--for megatron` plans it: the run says torch's stages hold them
    report = run_plan(plan, RunOptions(steps=2, timeout_s=90))
    assert report.passed and report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL
    assert FREED_RUN_NOTE in report.notes


def test_t5_two_stages() -> None:
    # The encoder output and the position biases skip stages; the input gradient sent back is made contiguous.
    plan = two_stage_plan(HF_T5, "decoder.block.1")
    report = run_plan(plan, RunOptions(steps=1, timeout_s=120))
    assert report.passed
    shared = [d for d in report.grad_diffs if d.name == "shared.weight"]
    assert [d.stage for d in shared] == [0, 1]


def _even_plan(model: Path, schedule: str, v: int, num_microbatches: int = 4) -> Plan:
    """Four ranks, the model's 8 units cut evenly into 4 * v stages, microbatches of one sample."""
    from autopp.model import discover_units, load_model_file

    mf = load_model_file(model)
    units = discover_units(mf, mf.build(0))
    per = len(units) // (4 * v)
    points = [str(units[i * per].split_point) for i in range(1, 4 * v)]
    return pipeline_plan(model, points, schedule, Layout(pp=4, v=v), num_microbatches=num_microbatches,
                         microbatch_size=1)


@pytest.mark.parametrize("model, schedule", [("hf_qwen2.py", "1F1B"), ("hf_neox.py", "GPipe"), ("unet.py", "1F1B")])
def test_values_that_skip_stages_run_on_four_ranks_under_single_stage_schedules(model: str, schedule: str) -> None:
    # Regression (issue 13, points 0 and 3): HF Qwen2 / GPT-NeoX (rotary tables and masks made once, read by every
    # block) and a U-Net (long skips) on 4 ranks under the default 1F1B or GPipe failed with "PipeliningMetadataError:
    # Backward of skip connections not supported yet (at stage.py:1580)": torch's graph-built stage sent a value that
    # skips stages straight to each reader. Now the stages relay it (or hold it, when it is made of constants). The
    # relay is the stages', whichever single-stage schedule orders them: each model runs under one of the two here
    # (the whole model x schedule matrix: scripts/check_models.py).
    report = run_plan(_even_plan(MODELS / model, schedule, 1), RunOptions(steps=1, timeout_s=240))
    assert report.passed and report.complete and len(report.grad_diffs) > 0
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)
    # Every stage's F and B were timed (autopp.run.instrument wraps the neighbour-only stages as it did torch's).
    assert [(t.stage, t.forward_s is not None, t.backward_s is not None) for t in report.stage_times] == \
        [(s, True, True) for s in range(4)]


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_an_hf_decoder_runs_on_four_ranks_under_two_stage_per_rank_schedules(schedule: str) -> None:
    # Issue 13, point 0: the multi-stage schedules on 4 ranks for an HF decoder whose rotary tables and mask skip
    # stages (8 stages of one unit each; under ZBV the split I/W backward too).
    report = run_plan(_even_plan(MODELS / "hf_qwen2.py", schedule, 2, num_microbatches=8), RunOptions(steps=1, timeout_s=240))
    assert report.passed and report.complete and report.layout.v == 2
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)
    assert [t.stage for t in report.stage_times] == list(range(8))


def test_an_auto_plan_of_gpt_neox_on_four_ranks_runs() -> None:
    # Issue 13, point 3: GPT-NeoX planned with --devices 4 --schedule auto picked a plan whose run failed with
    # "PipeliningMetadataError: Backward of skip connections not supported yet". Profiled once, cheaply (one
    # microbatch size, one repeat: the figures only rank the choices), planned with every schedule open, run.
    from autopp.data.cluster import Cluster
    from autopp.measure import MeasureOptions, ProfileOptions, profile_model
    from autopp.solve import PlanRequest, make_plan

    profile = profile_model(MODELS / "hf_neox.py", ProfileOptions(microbatch_sizes=(1,)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False))
    plan = make_plan(profile, PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=2**34), global_batch=8,
                                          num_microbatches=8, schedule=None))
    assert plan.layout.pp == 4
    report = run_plan(plan, RunOptions(steps=1, timeout_s=240))
    assert report.passed and report.complete, (plan.schedule, report.error)
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)


def test_unet_long_skips_under_a_v_schedule_on_four_ranks() -> None:
    # Two stages per rank (V layout): the outermost skip, stem (stage 0) -> up1 (stage 6), is relayed by stages 1-5.
    report = run_plan(_even_plan(MODELS / "unet.py", "ZBVZeroBubble", 2), RunOptions(steps=1, timeout_s=240))
    assert report.passed and report.complete
    assert all(t.input_s is not None and t.weight_s is not None for t in report.stage_times)
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)


def test_a_qwen3_moe_runs_on_two_ranks() -> None:
    # Issue 30: a mixture of experts (4 experts, top-2, renormalised; transformers' grouped_mm experts, exported as its
    # float32 fallback op) split in two; the stacked expert weights' gradients are validated like any other.
    report = run_plan(two_stage_plan(MODELS / "hf_qwen3_moe.py", "model.layers.2"), RunOptions(steps=1, timeout_s=120))
    assert report.passed and report.complete
    assert any(d.name.endswith("mlp.experts.gate_up_proj") for d in report.grad_diffs)
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)
