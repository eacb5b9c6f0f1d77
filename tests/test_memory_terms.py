"""scripts/memory_terms.py (issues 25 and 30): a plan's peak rank split into the terms autopp counts, which add up
to the peak its order walk gives (autopp.schedule.effects.order_peaks)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.data.cluster import Cluster
from autopp.data.layout import LayoutPins
from autopp.data.synthetic_profile import synthetic_profile
from autopp.data.zero import ZERO
from autopp.predict import plan_order, plan_stage_costs
from autopp.schedule import Activation, ScheduleName
from autopp.schedule.effects import order_peaks
from autopp.solve import PlanRequest, make_plan

from .conftest import load_script


def test_the_terms_add_up_to_the_walked_peak_of_the_peak_rank() -> None:
    """Two pipeline ranks x dp 2 (ZeRO 1), 1F1B with 4 microbatches, every stage recomputing unit by unit: the static
    terms (weights, FSDP2's sharded parameters, fp32 profile: a copy of their own, gradients, optimizer state), the
    in-flight microbatches' kept inputs, the backward re-materialising one unit and the working memory sum to the
    order walk's peak of the rank the simulator names."""
    script = load_script("memory_terms")
    profile = synthetic_profile(8, hidden=2048, seq=8192)
    request = PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=64 * 2**30), global_batch=8,
                          num_microbatches=4, schedule=ScheduleName.ONE_F_ONE_B,
                          pins=LayoutPins(pp=2, dp=2, tp=1, zero=ZERO[1]), activations=(Activation.BLOCKS,))
    plan = make_plan(profile, request)
    rows, notes = script.terms(plan, profile)
    walked = order_peaks(plan_order(plan), plan_stage_costs(plan), [s.rank for s in plan.stages],
                         [s.activation for s in plan.stages])
    rank = max(range(2), key=lambda r: plan.predicted.peak_memory_bytes[r])
    assert abs(sum(b for _, b in rows) - walked[rank]) <= 2  # rounding of the static terms
    names = [n for n, _ in rows]
    assert names[:4] == [f"{t} (1 stage)" for t in ("weights", "sharded parameters", "gradients", "optimizer state")]
    assert dict(rows)[names[1]] > 0 and "no master copy" in notes[0]
    assert any("in flight x" in n for n in names) and any("re-materialising" in n for n in names)


def test_with_ep_equal_to_dp_under_fsdp2_the_note_gives_the_experts_weights_once_counted_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """dp 4 = ep 4 at pp 1, ZeRO 3 (FSDP2): no weights persist (the experts are FSDP2 over their one rank since
    2026-12-05) and, with a master copy (bf16), the note gives what was counted whole before: the rank's expert
    weights, by hand 3/4 of each block's parameter bytes over ep 4 (the synthetic MoE profile of
    tests/costmodel/test_parallel.py). Without one (no recipe recorded, as fp32 and bf16-pure) those weights are the
    master, whole and persistent on their rank, and the first note says so."""
    from autopp.data.profile import Profile

    from .costmodel.test_parallel import _moe_profile
    script = load_script("memory_terms")
    plain = _moe_profile()
    request = PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=64 * 2**30), global_batch=16,
                          num_microbatches=4, schedule=ScheduleName.ONE_F_ONE_B,
                          pins=LayoutPins(pp=1, dp=4, ep=4, tp=1, zero=ZERO[3]), activations=(Activation.BLOCKS,))
    monkeypatch.setattr(script, "GIB", 1)  # the notes in bytes: the synthetic profile's are a few kB
    blocks = plain.units[plain.units.microbatch_size == plain.units.microbatch_size.min()]
    expected = float((blocks.param_bytes * 3 // 4).iloc[1:3].sum()) / 4
    mixed = Profile(replace(plain.meta, extra={**plain.meta.extra, "precision": "bf16"}), plain.units, plain.edges)
    rows, notes = script.terms(make_plan(mixed, request), mixed)
    assert dict(rows)["weights (1 stage)"] == 0
    assert expected > 1000 and len(notes) == 2 and notes[1].endswith(f": {expected:.2f} GiB")
    rows, notes = script.terms(make_plan(plain, request), plain)
    assert dict(rows)["weights (1 stage)"] == 0 and len(notes) == 1
    assert "the optimizer steps" in notes[0] and notes[0].endswith(f": {expected:.2f} GiB)")
