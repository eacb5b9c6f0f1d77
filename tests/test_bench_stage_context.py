"""scripts/bench_stage_context.py (issue 29, item 1): fed the plan's own stage times, its re-simulation is the plan's
prediction, so a difference in its table comes from the in-context times alone."""

from __future__ import annotations


import pytest

from autopp.data.profile import load_profile

from .conftest import ROOT, load_script


def test_the_plans_own_times_resimulate_to_its_prediction() -> None:
    bench = load_script("bench_stage_context")
    plans = bench.plans_for(load_profile(ROOT / "profiles" / "gpt"), 2, 8, 1 << 30)
    for plan in plans.values():
        own = [(s.forward_s, s.backward_s) for s in plan.stages]
        assert bench.resimulated(plan, own) == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
        halved = [(f / 2, b / 2) for f, b in own]
        assert bench.resimulated(plan, halved) < plan.predicted.step_time_s
