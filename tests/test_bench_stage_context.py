"""scripts/bench_stage_context.py (issue 29, item 1): fed the plan's own stage times, its re-simulation is the plan's
prediction, so a difference in its table comes from the in-context times alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from autopp.data.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]


def test_the_plans_own_times_resimulate_to_its_prediction() -> None:
    spec = importlib.util.spec_from_file_location("bench_stage_context", ROOT / "scripts" / "bench_stage_context.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    plans = bench.plans_for(load_profile(ROOT / "profiles" / "gpt"), 2, 8, 1 << 30)
    for plan in plans.values():
        own = [(s.forward_s, s.backward_s) for s in plan.stages]
        assert bench.resimulated(plan, own) == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
        halved = [(f / 2, b / 2) for f, b in own]
        assert bench.resimulated(plan, halved) < plan.predicted.step_time_s
