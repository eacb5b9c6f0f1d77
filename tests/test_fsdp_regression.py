"""Regression (issue 25): pure FSDP, the standard recipe for models up to ~70B, could not be planned. Llama-3-8B
(analytic bf16 profile for h100-sxm at 8,192 tokens) on 8 x 8 H100:

    $ autopp plan --profile profiles/llama-3-8b-h100-sxm-s8192 --device h100-sxm --nodes 8 --devices-per-node 8 \\
          --pp 1 --dp 64 --zero 3 --recompute all
    autopp: error: no split of 34 units fits in 74.5 GiB ... smallest that works is 97.9 GiB

because ZeRO 3 was counted as torch's pipelining stage runs it (parameters and gradients whole at the peak), and its
collectives (15.8 s of a 92.3 s step with --memory 200GiB) at the step's end. At pp 1 it is FSDP2 as torchtitan runs
it: everything sharded, each layer gathered under its neighbour's compute (docs/parallelism.md, "Pure FSDP")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.data.catalog import cluster_from_catalog, load_device
from autopp.data.layout import Layout, LayoutPins
from autopp.data.overlap import NO_OVERLAP
from autopp.data.profile import load_profile
from autopp.data.zero import ZERO
from autopp.errors import InfeasibleError
from autopp.solve import PlanRequest, RecomputeMode, make_plan

from .conftest import ROOT

GiB = 2**30


def test_llama_3_8b_as_pure_fsdp_fits_8_x_8_h100_with_its_collectives_hidden() -> None:
    profile = load_profile(ROOT / "profiles" / "llama-3-8b-h100-sxm-s8192")
    cluster = cluster_from_catalog(load_device("h100-sxm"), nodes=8)
    request = PlanRequest(cluster=cluster, global_batch=128, recompute=RecomputeMode.ALL,
                          pins=LayoutPins(pp=1, dp=64, zero=ZERO[3]))
    plan = make_plan(profile, request)
    assert plan.layout == Layout(pp=1, dp=64, zero=ZERO[3]) and plan.predicted.fits
    assert max(plan.predicted.peak_memory_bytes) <= cluster.memory_bytes == 80 * 10**9 - 3 * GiB
    b = plan.time_breakdown
    assert b is not None and b.sync_s == 0 == plan.predicted.allreduce_s  # nothing left for the step's end
    zero, hidden = b.stages[0].zero_s, b.stages[0].zero_hidden_s
    assert hidden > 5 * zero  # FSDP2's prefetch hides most of the per-layer collectives
    exposed = make_plan(profile, replace(request, overlap=NO_OVERLAP))  # every collective on the critical path
    assert exposed.time_breakdown is not None and exposed.time_breakdown.stages[0].zero_s == \
        pytest.approx(zero + hidden)
    assert plan.predicted.step_time_s < exposed.predicted.step_time_s


def test_torchtitans_local_batch_of_2_fits_with_selective_recomputation_block_by_block() -> None:
    """torchtitan's Llama 3.1 8B FSDP row (128 H100 96GB, local batch 2, its default op-level selective AC) runs the
    local batch as one microbatch of 2: stage-level selective recomputation does not fit it (the whole 34-unit stage
    re-materialised at once in the backward), torchtitan's per-block selective checkpointing does, and the search
    chooses it, at less time than per-block full recomputation."""
    from autopp.schedule import Activation
    profile = load_profile(ROOT / "profiles" / "llama-3-8b-h100-sxm-s8192")
    cluster = cluster_from_catalog(load_device("h100-sxm"), 128, memory_bytes=96 * 10**9)

    def request(**kw: object) -> PlanRequest:
        return PlanRequest(cluster=cluster, global_batch=256, num_microbatches=1,  # type: ignore[arg-type]
                           pins=LayoutPins(pp=1, dp=128, tp=1, zero=ZERO[3], v=1), **kw)
    with pytest.raises(InfeasibleError, match=r"^no split of 34 units fits"):
        make_plan(profile, request(activations=(Activation.SELECTIVE,)))
    plan = make_plan(profile, request(recompute=RecomputeMode.AUTO))
    assert (plan.num_microbatches, plan.microbatch_size) == (1, 2) and plan.predicted.fits
    assert [s.activation for s in plan.stages] == [Activation.SELECTIVE_UNITS]
    full = make_plan(profile, request(activations=(Activation.BLOCKS,)))
    assert plan.predicted.step_time_s < full.predicted.step_time_s
    assert max(full.predicted.peak_memory_bytes) < max(plan.predicted.peak_memory_bytes) <= cluster.memory_bytes
