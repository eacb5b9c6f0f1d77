"""scripts/published.py (issue 25, item 8): torchtitan's Llama 3.1 8B FSDP row pins its op-level selective
activation checkpointing of each block as autopp's per-unit selective recomputation (`selective-units`), which fits
the run's 96 GB GPU on the shipped profile (profiles/llama-3-8b-h100-96gb-500w-sxm-peak-s8192/) and redoes less than
per-unit full recomputation (`recompute-units`), the policy the row pinned before; (issue 30) NeMo AutoModel's
Qwen3-30B-A3B row pins FSDP8 beside EP8 as ZeRO 3 at pp 1."""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

from autopp.schedule.activation import Activation

from .conftest import load_script


def _script() -> ModuleType:
    return load_script("published")


def test_published_8b_fsdp_row_pins_selective_units_and_fits() -> None:
    script = _script()
    run = script.TITAN_8B_FSDP
    assert run.activations == (Activation.SELECTIVE_UNITS,)
    profile = script.profile_for(run, run.tp_degrees, run.precision)
    cluster = script.cluster_of(run)
    plan, why, _ = script._plan(profile, script.pinned_request(run, cluster))
    assert plan is not None, why
    assert plan.predicted.fits
    assert {s.activation for s in plan.stages} == {Activation.SELECTIVE_UNITS}
    assert max(plan.predicted.peak_memory_bytes) <= cluster.memory_bytes
    full, why, _ = script._plan(profile, replace(script.pinned_request(run, cluster),
                                                 activations=(Activation.BLOCKS,)))
    assert full is not None, why
    assert plan.predicted.step_time_s < full.predicted.step_time_s
    assert max(plan.predicted.peak_memory_bytes) > max(full.predicted.peak_memory_bytes)


def test_published_qwen3_row_pins_fsdp_beside_ep_and_holds_less_than_zero_2() -> None:
    """Issue 30: NeMo AutoModel's Qwen3-30B-A3B row (EP8 x FSDP8 at pp 1) is pinned as it ran, ZeRO 3 beside ep as
    FSDP2, no longer as ZeRO 2; with memory enough for either, its static bytes are below ZeRO 2's (the dense weights
    gathered per block, not held whole; the experts, ep = dp, as before)."""
    from autopp.data.zero import ZERO
    script = _script()
    run = script.QWEN3_30B
    assert run.layout.zero == ZERO[3] and (run.layout.pp, run.layout.dp, run.layout.ep) == (1, 8, 8)
    profile = script.profile_for(run, run.tp_degrees, run.precision)
    cluster = replace(script.cluster_of(run), memory_bytes=200 << 30)
    plans = {}
    for stage in (2, 3):
        request = script.pinned_request(run, cluster)
        plan, why, _ = script._plan(profile, replace(request, pins=replace(request.pins, zero=ZERO[stage])))
        assert plan is not None, why
        plans[stage] = plan
    assert plans[3].layout.fsdp and not plans[2].layout.fsdp
    assert plans[3].stages[0].static_bytes < plans[2].stages[0].static_bytes
