"""scripts/published.py (issue 25, item 8): torchtitan's Llama 3.1 8B FSDP row pins its op-level selective
activation checkpointing of each block as autopp's per-unit selective recomputation (`selective-units`), which fits
the run's 96 GB GPU on the shipped profile (profiles/llama-3-8b-h100-96gb-500w-sxm-peak-s8192/) and redoes less than
per-unit full recomputation (`recompute-units`), the policy the row pinned before."""

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


def test_published_8b_cp_row_pins_torchtitans_context_parallel_run() -> None:
    """Issue 27, item 4: torchtitan's Llama 3.1 8B at 131,072 tokens (Table 2, FSDP 2 x CP 4 on 8 H100, full AC)
    plans pinned as it ran on the shipped profile (profiles/llama-3.1-8b-h100-96gb-500w-sxm-peak-s131072-fp8/): cp 4
    beside dp 2, ZeRO 3 over the 8 dp x cp ranks, each block recomputed; keeping the activations does not fit."""
    script = _script()
    run = script.TITAN_8B_CP
    assert run in script.RUNS and run.seq_len == 131072 and run.gpus == 8
    profile = script.profile_for(run, run.tp_degrees, run.precision)
    cluster = script.cluster_of(run)
    plan, why, _ = script._plan(profile, script.pinned_request(run, cluster))
    assert plan is not None, why
    layout = plan.layout
    assert (layout.tp, layout.cp, layout.pp, layout.dp, layout.world) == (1, 4, 1, 2, 8)
    assert layout.sync == 8 and layout.zero == run.layout.zero
    assert {s.activation for s in plan.stages} == {Activation.BLOCKS}
    assert plan.predicted.fits and max(plan.predicted.peak_memory_bytes) <= cluster.memory_bytes
    kept, why, _ = script._plan(profile, replace(script.pinned_request(run, cluster), activations=(Activation.KEEP,)))
    assert kept is None and "no split of 34 units fits in 86.4 GiB" in why, why
