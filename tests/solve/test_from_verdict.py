"""from_verdict.py: baselines judged with their own activation policies, and those that do not fit marked in the
plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.costmodel import ProfileTable
from autopp.data.cluster import Cluster
from autopp.data.plan import load_plan
from autopp.data.profile import load_profile
from autopp.display import format_plan
from autopp.data.layout import Layout
from autopp.schedule import Activation, ScheduleName
from autopp.solve import PlanRequest, RecomputeMode, make_plan
from autopp.solve.assemble.from_verdict import judge_recompute
from autopp.solve.search.judge import Candidate

GPT = Path(__file__).resolve().parents[2] / "profiles" / "gpt"
MiB = 1 << 20
KEEP, RECOMPUTE = Activation.KEEP, Activation.RECOMPUTE


def _gpipe_even() -> Candidate:
    return Candidate(schedule=ScheduleName.GPIPE, layout=Layout(pp=2), microbatches=8, microbatch_size=1,
                     bounds=((0, 4), (4, 8)), activations=(KEEP, KEEP))


def test_each_mode_judges_its_own_activation_policies() -> None:
    # profiles/gpt, GPipe m8 on 0-3 | 4-7: rank 0 peaks at 25 MiB, rank 1 at 41 MiB without recomputation, 16 MiB
    # with it; on 30 MiB devices only rank 1 must recompute.
    a = ProfileTable(load_profile(GPT)).arrays(1)
    cluster = Cluster(num_devices=2, memory_bytes=30 * MiB)
    none = judge_recompute(a, cluster, _gpipe_even(), (KEEP,))
    every = judge_recompute(a, cluster, _gpipe_even(), (RECOMPUTE,))
    auto = judge_recompute(a, cluster, _gpipe_even(), (KEEP, RECOMPUTE))
    assert none.candidate.activations == (KEEP, KEEP) and not none.fits
    assert every.candidate.activations == (RECOMPUTE, RECOMPUTE) and every.fits
    assert auto.candidate.activations == (KEEP, RECOMPUTE) and auto.fits and auto.step_s < every.step_s


def test_no_fitting_choice_is_judged_without_recomputation_and_marked() -> None:
    a = ProfileTable(load_profile(GPT)).arrays(1)
    cluster = Cluster(num_devices=2, memory_bytes=8 * MiB)  # nothing fits
    auto = judge_recompute(a, cluster, _gpipe_even(), (KEEP, RECOMPUTE))
    assert auto.candidate.activations == (KEEP, KEEP) and not auto.fits


def test_a_baseline_that_does_not_fit_is_marked_in_json_and_table(tmp_path: Path) -> None:
    # 1F1B m8 on 20 MiB devices: the time-balanced split 0-5 | 6-7 needs about 21 MiB on rank 0
    request = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=20 * MiB), global_batch=8, num_microbatches=8)
    plan = make_plan(load_profile(GPT), request)
    assert plan.predicted.fits and plan.baselines["even"].fits
    time = plan.baselines["time"]
    assert not time.fits and max(time.peak_memory_bytes) > 20 * MiB
    again = load_plan(plan.save(tmp_path / "p.json"))
    assert again.baselines["time"].fits is False and again.predicted.fits is True
    rows = {line.split()[0]: line for line in format_plan(plan).splitlines() if line}
    at = rows["split"].index(" fits") + 1
    assert rows["time"][at - 2:at + 4].split() == ["NO"] and rows["even"][at:at + 4].split() == ["yes"]
    assert "does not fit (a rank's simulated peak exceeds its device's memory): time" in format_plan(plan)


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


def test_a_plan_records_the_nodes_of_its_cluster() -> None:
    from autopp.data.catalog import cluster_from_catalog, load_device
    profile = load_profile(Path(__file__).resolve().parents[2] / "profiles" / "gpt")
    h100 = load_device("h100-sxm")
    for devices, nodes in ((4, (2, 2)), (2, None)):  # 2 per node: a cluster of nodes; all on one: flat
        cluster = cluster_from_catalog(h100, devices, devices_per_node=2, memory_bytes=2**32)
        assert make_plan(profile, PlanRequest(cluster=cluster, global_batch=8)).nodes == nodes


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


def test_a_warm_start_order_is_said_as_such_not_with_a_gap_of_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new user's plan said "order synthesized by CP-SAT (hint, gap nan%)" when CP-SAT found no order in its time
    limit and its warm start won (SynthStatus.HINT, gap NaN): said in words."""
    from dataclasses import replace

    from autopp.solve.assemble import make

    real = make.synthesized

    def as_hint(*args: object, **kw: object) -> object:
        found = real(*args, **kw)  # type: ignore[arg-type]
        return None if found is None else replace(found, status="hint", gap=float("nan"))
    monkeypatch.setattr(make, "synthesized", as_hint)
    plan = make_plan(load_profile(GPT), PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=2 << 30),
                                                    global_batch=8, schedule=ScheduleName.GPIPE,
                                                    synthesize=True))
    said = [n for n in plan.notes if n.startswith("order synthesized by CP-SAT")]
    assert said and "(its warm start: the solver found no faster order in its time limit)" in said[0]
    assert "nan" not in format_plan(plan)


def test_context_parallelism_beside_tp_is_said_to_be_costed_only() -> None:
    """A tester: a cp 2 x tp 2 plan was made without a word, then `autopp run` refused it (it runs cp with tp 1)."""
    from dataclasses import replace

    from autopp.data.cluster import Cluster
    from autopp.data.layout import LayoutPins
    from autopp.data.synthetic_profile import synthetic_profile
    from autopp.solve import PlanRequest, make_plan
    p = synthetic_profile(6, hidden=512, seq=64, tp_degrees=(2,))
    attention = {"heads": 8, "kv_heads": 8, "head_dim": 64, "causal": True}
    p = replace(p, meta=replace(p.meta, extra={**p.meta.extra, "hf_config": {
        "seq_len": 64, "task": "causal-lm", "model_type": "llama", "attention": attention}}))
    notes = {tp: [n for n in make_plan(p, PlanRequest(cluster=Cluster(num_devices=4 * tp, memory_bytes=2**40),
                                                       global_batch=8, pins=LayoutPins(pp=2, dp=1, cp=2, tp=tp))).notes
                  if n.startswith("context parallelism 2")] for tp in (1, 2)}
    assert notes[2][0].endswith("(costed only beside tp 2: `autopp run` runs context parallelism with tp 1; a "
                                "trainer runs it: `autopp export`)")
    assert "costed only" not in notes[1][0]
