"""evaluate_pinned: a given split judged exactly as the planner judges its own, never replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.data.cluster import Cluster
from autopp.data.layout import Layout
from autopp.errors import PlanError
from autopp.data.profile import load_profile
from autopp.schedule import Activation, ScheduleName
from autopp.solve import Pinned, PlanRequest, evaluate_pinned, make_plan
from autopp.solve.search.judge import Candidate

GPT = Path(__file__).resolve().parents[2] / "profiles" / "gpt"


def _pinned(schedule: ScheduleName, pp: int, m: int, b: int, bounds: tuple[tuple[int, int], ...],
            source: str = "pinned configuration") -> Pinned:
    """A split pinned on `pp` ranks of one replica, every stage keeping its activations."""
    return Pinned(candidate=Candidate(schedule=schedule, layout=Layout(pp=pp), microbatches=m, microbatch_size=b,
                                      bounds=bounds, activations=(Activation.KEEP,) * len(bounds)), source=source)


def test_the_planners_own_split_evaluates_to_its_figures() -> None:
    profile = load_profile(GPT)
    cluster = Cluster(num_devices=2, memory_bytes=4 << 30)
    plan = make_plan(profile, PlanRequest(cluster=cluster, global_batch=8))
    assert all(s.activation is Activation.KEEP for s in plan.stages)
    pinned = _pinned(plan.schedule, plan.layout.pp, plan.num_microbatches, plan.microbatch_size,
                     tuple(s.units for s in plan.stages))
    again = evaluate_pinned(profile, cluster, pinned)
    assert again.predicted.step_time_s == plan.predicted.step_time_s
    assert again.predicted.peak_memory_bytes == plan.predicted.peak_memory_bytes


def test_a_slower_split_is_kept_and_an_overflow_noted() -> None:
    profile = load_profile(GPT)
    cluster = Cluster(num_devices=2, memory_bytes=1 << 20)
    pinned = _pinned(ScheduleName.GPIPE, 2, 8, 1, ((0, 1), (1, 8)), source="mine.args")
    plan = evaluate_pinned(profile, cluster, pinned)
    assert [s.units for s in plan.stages] == [(0, 1), (1, 8)]  # not replaced by a faster baseline
    assert plan.predicted.step_time_s > min(b.step_time_s for b in plan.baselines.values())
    assert any(n.startswith("does not fit: rank") for n in plan.notes) and "mine.args" in plan.notes[0]


@pytest.mark.parametrize("bounds, match", [(((0, 3), (4, 8)), "do not cover"), (((0, 8),), "needs 2 stages"),
                                           (((0, 0), (0, 8)), "leave a stage empty")])
def test_bad_splits_are_refused(bounds: tuple[tuple[int, int], ...], match: str) -> None:
    pinned = _pinned(ScheduleName.ONE_F_ONE_B, 2, 4, 2, bounds)
    with pytest.raises(PlanError, match=match):
        evaluate_pinned(load_profile(GPT), Cluster(num_devices=2, memory_bytes=4 << 30), pinned)


def test_a_pinned_megatron_configuration_counts_its_stages_outputs_freed() -> None:
    """A reviewer: `--pin-from` a Megatron config judged "yours" with each stage's outputs held, where autopp's own
    plan (`--for megatron`) counted them freed: `frees_outputs` judges it as the trainer runs it, equal to autopp's
    plan of the same split."""
    profile = load_profile(GPT)
    cluster = Cluster(num_devices=4, memory_bytes=4 << 30)
    plan = make_plan(profile, PlanRequest(cluster=cluster, global_batch=8, num_microbatches=8, trainer="megatron"))
    assert plan.frees_outputs and plan.layout.pp == 4
    pinned = _pinned(plan.schedule, 4, 8, 1, tuple(s.units for s in plan.stages))
    freed, held = evaluate_pinned(profile, cluster, pinned, frees_outputs=True), \
        evaluate_pinned(profile, cluster, pinned)
    assert freed.predicted.peak_memory_bytes == plan.predicted.peak_memory_bytes and freed.frees_outputs
    assert all(f < h for f, h in zip(freed.predicted.peak_memory_bytes[:-1], held.predicted.peak_memory_bytes))
