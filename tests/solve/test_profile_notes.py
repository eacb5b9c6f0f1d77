"""profile_notes.py: what a plan says of the profile it was made from (BatchNorm, a recipe or the model's output
not recorded, a microbatch size outside the profiled ones)."""

from __future__ import annotations

from pathlib import Path

from autopp.data.cluster import Cluster
from autopp.data.profile import load_profile
from autopp.schedule import ScheduleName
from autopp.solve import PlanRequest, make_plan

GPT = Path(__file__).resolve().parents[2] / "profiles" / "gpt"


def test_a_batch_norm_model_is_said_at_plan_time() -> None:
    """Issue 26 item 11: the profile records the model's BatchNorm modules (`extra.batch_norm`) and a plan with
    several microbatches says, in one note, why a pipelined step differs from one process and what to use; one
    microbatch of the whole batch says nothing."""
    from dataclasses import replace

    from autopp.data.synthetic_profile import synthetic_profile
    p = synthetic_profile(6)
    bn = replace(p, meta=replace(p.meta, extra={**p.meta.extra, "batch_norm": ["blocks.0.bn1", "blocks.1.bn1"]}))
    cluster = Cluster(num_devices=2, memory_bytes=80 * 2**30)
    plan = make_plan(bn, PlanRequest(cluster=cluster, global_batch=8, num_microbatches=4))
    said = [n for n in plan.notes if "BatchNorm" in n]
    assert said == ["the model normalizes with BatchNorm (blocks.0.bn1 and 1 more), whose statistics are per "
                    "microbatch (2 samples here, not the global batch), so a pipelined step differs from the "
                    "single-process one by design: `autopp run` measures it only with --no-validate; GroupNorm or "
                    "LayerNorm normalize each sample and validate"]
    one = make_plan(bn, PlanRequest(cluster=cluster, global_batch=1, num_microbatches=1,
                                    schedule=ScheduleName.GPIPE))
    assert not [n for n in one.notes if "BatchNorm" in n]
    assert not [n for n in make_plan(p, PlanRequest(cluster=cluster, global_batch=8)).notes if "BatchNorm" in n]


def test_a_bf16_profile_without_a_recipe_is_said_to_lack_the_fp32_gradients() -> None:
    """A bf16 profile counted before the precision recipes records none and counts its gradients at 2 bytes a
    parameter: its plans say what their memory lacks. One that records its recipe gets no such note, nor does a
    measured bf16 profile, which records none (bfloat16 implies bf16) but counts fp32 gradients (a reviewer)."""
    from dataclasses import replace
    from autopp.data.catalog import cluster_from_catalog, load_device
    from autopp.data.layout import LayoutPins
    current = load_profile(GPT.parent / "llama-3-8b-h100-sxm-s8192")
    assert current.meta.extra["precision"] == "bf16" and current.meta.dtype == "bfloat16"
    unrecorded = {k: v for k, v in current.meta.extra.items() if k != "precision"}
    measured = replace(current, meta=replace(current.meta, extra=unrecorded))
    old = replace(measured, units=measured.units.assign(grad_bytes=measured.units.param_bytes))
    request = PlanRequest(cluster=cluster_from_catalog(load_device("h100-sxm"), 16, devices_per_node=8),
                          global_batch=16, pins=LayoutPins(pp=2, dp=1, tp=8), num_microbatches=16)
    note = "the profile records no precision recipe (counted before autopp's recipes)"
    assert any(n.startswith(note) for n in make_plan(old, request).notes)
    for fine in (current, measured):
        assert not any(n.startswith(note) for n in make_plan(fine, request).notes)


def test_a_profile_without_the_models_output_is_said_to_lack_it() -> None:
    """A profile made before the model's output was recorded (its last unit's `output_bytes` 0) plans with its last
    stage lacking what torch's stage holds for the loss: said with what to do; a profile that records it is not."""
    from dataclasses import replace

    from autopp.costmodel import unit_arrays
    from autopp.data.synthetic_profile import synthetic_profile
    p = synthetic_profile(6)
    last = p.units.unit == 5
    old = replace(p, units=p.units.assign(output_bytes=p.units.output_bytes.where(~last, 0)))
    cluster = Cluster(num_devices=2, memory_bytes=80 * 2**30)
    note = ("the profile records no bytes for the model's output (made before 2026-12-06): the last stage's memory "
            "lacks the output torch's pipelining stage holds for the loss per in-flight microbatch (an LM's logits); "
            "profile the model again for them")
    before, now = (make_plan(q, PlanRequest(cluster=cluster, global_batch=8, num_microbatches=4)) for q in (old, p))
    assert note in before.notes and note not in now.notes
    held = unit_arrays(p, now.microbatch_size).model_output  # the head's output, interpolated between sizes 1 and 8
    assert now.stages[-1].output_bytes == held > before.stages[-1].output_bytes == 0


def test_a_microbatch_size_outside_the_profiled_ones_is_said_to_be_extrapolated() -> None:
    profile = load_profile(GPT)
    sizes = sorted(profile.meta.microbatch_sizes)
    cluster = Cluster(num_devices=1, memory_bytes=8 << 30)
    big = sizes[-1] * 2
    plan = make_plan(profile, PlanRequest(cluster=cluster, global_batch=big, num_microbatches=1))
    assert plan.microbatch_size == big
    assert f"microbatch size {big} is outside the profiled sizes {sizes}: its times and bytes are extrapolated along " \
           f"the line through {sizes[-2:]}; profile it (--microbatch-sizes {','.join(map(str, [*sizes, big]))})" \
           in " ".join(plan.notes)
    inside = make_plan(profile, PlanRequest(cluster=cluster, global_batch=sizes[-1], num_microbatches=1))
    assert not any("outside the profiled sizes" in n for n in inside.notes)
