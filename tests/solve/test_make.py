"""autopp.solve.assemble.make: the notes `make_plan` adds to the plan it assembles."""

from __future__ import annotations

from autopp.cli.common import in_flags
from autopp.data.cluster import Cluster
from autopp.data.layout import LayoutPins
from autopp.data.synthetic_profile import synthetic_profile
from autopp.solve import PlanRequest, make_plan


def test_the_tp_note_is_a_whole_sentence_whatever_the_flags_said() -> None:
    """The tester saw "note: with --tp auto, only tp 1 was: the profile has no tensor-parallel rows" without giving
    --tp (auto is its default): the note says what was searched, in a finished sentence, with no flag it did not
    give."""
    profile = synthetic_profile(6)
    plan = make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**40), global_batch=4,
                                          pins=LayoutPins(tp=None)))
    note = next(in_flags(n) for n in plan.notes if "tensor-parallel rows" in n)
    assert note.startswith("tensor parallelism: only tp 1 was searched, as the profile has no tensor-parallel rows")
    assert "--tp auto" not in note and note.endswith("profile with --tp T, T a degree the model's TP plan allows")
    pinned = make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**40), global_batch=4))
    assert not any("tensor-parallel rows" in n for n in pinned.notes)


def test_a_sharded_layout_for_cpu_ranks_says_what_its_prediction_leaves_out() -> None:
    """A tester: the default gpt plan was ZeRO 3 over 2 CPU ranks, predicted as fast as Chimera and measured 1.75x
    slower; DTensor's and gloo's overhead on CPU ranks is in neither the profile nor the plan, and nothing said so.
    A GPU plan of the same layout, and a CPU plan without the mesh, say nothing of it."""
    from dataclasses import replace

    from autopp.cores import MESH_ON_CPU
    from autopp.data.zero import ZERO
    cpu = synthetic_profile(8)
    cpu = replace(cpu, meta=replace(cpu.meta, device="cpu (x86_64)"))  # as the profiler records it
    cluster = Cluster(num_devices=2, memory_bytes=80 * 2**30)
    zero3 = PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(pp=1, dp=2, zero=ZERO[3]))
    said = [n for n in make_plan(cpu, zero3).notes if n.startswith(MESH_ON_CPU)]
    assert said == [f"{MESH_ON_CPU}: the step above leaves it out, so a layout without it (ZeRO 0, tp 1) may run "
                    "faster on CPU ranks"]
    plain = PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(pp=1, dp=2))
    assert not any(n.startswith(MESH_ON_CPU) for n in make_plan(cpu, plain).notes)
    gpu = replace(cpu, meta=replace(cpu.meta, device="cuda: NVIDIA H100 80GB HBM3", extra={
        **cpu.meta.extra, "analytic_device": "h100-sxm"}))
    assert not any(n.startswith(MESH_ON_CPU) for n in make_plan(gpu, zero3).notes)


def test_keeping_every_activation_fits_where_the_splits_memory_check_alone_finds_no_split() -> None:
    """`recompute` none said "no split fits" at memory where `recompute` auto planned every stage keeping (the
    split's DP gives each of a rank's v stages 1/v of its memory, each at its own peak in flight; Llama 3 405B on
    8,192 GPUs): at the keep-all plan's own simulated peak the search now walks the memory-free split exactly
    (`search._loose`) and plans it; below that peak, no split fits, as before."""
    import pytest

    from autopp.errors import InfeasibleError
    from autopp.schedule import Activation, ScheduleName
    from autopp.solve import RecomputeMode
    from autopp.solve.search.search import pipe_spec
    from autopp.solve.search.request import Config
    from autopp.solve.partition.dp import feasible
    from autopp.costmodel import unit_arrays
    from autopp.data.layout import Layout

    profile = synthetic_profile(8)

    def request(memory: int, recompute: RecomputeMode = RecomputeMode.NONE) -> PlanRequest:
        return PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=memory), global_batch=8, num_microbatches=8,
                           pins=LayoutPins(pp=2, dp=1, v=2), schedule=ScheduleName.INTERLEAVED_1F1B,
                           recompute=recompute)
    roomy = make_plan(profile, request(2**40))
    peak = max(roomy.predicted.peak_memory_bytes)
    config = Config(ScheduleName.INTERLEAVED_1F1B, Layout(pp=2, v=2), 8, 1)
    assert not feasible(unit_arrays(profile, 1), pipe_spec(request(peak), config, Activation.KEEP))  # the DP's budgets
    plan = make_plan(profile, request(peak))
    assert all(s.activation is Activation.KEEP for s in plan.stages)
    assert max(plan.predicted.peak_memory_bytes) <= peak and [s.units for s in plan.stages] == \
        [s.units for s in roomy.stages] and plan.predicted.step_time_s == roomy.predicted.step_time_s
    with pytest.raises(InfeasibleError, match=r"^no split of 8 units fits .*; a plan fits in [0-9.]+ GiB, its "
                                              r"order's peak, where the split's count asks"):
        make_plan(profile, request(int(peak * 0.9)))  # the memory said is what the plan above needs, not the DP's
    auto = make_plan(profile, request(peak, RecomputeMode.AUTO))
    assert [s.activation for s in auto.stages] == [s.activation for s in plan.stages]
