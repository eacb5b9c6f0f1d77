"""scripts/bench_stage_context.py (issue 29, item 1): fed the plan's own stage times, its re-simulation is the plan's
prediction, so a difference in its table comes from the in-context times alone."""

from __future__ import annotations

from dataclasses import replace

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


def test_without_runtime_cost_plans_as_before_the_profile_carried_one() -> None:
    bench = load_script("bench_stage_context")
    shipped = load_profile(ROOT / "profiles" / "gpt")  # measured before profiles carried the cost: 0
    costly = replace(shipped, meta=replace(shipped.meta, runtime_forward_s=1e-3, runtime_backward_s=2e-3))
    assert bench.without_runtime_cost(costly).meta == shipped.meta


@pytest.mark.integration
def test_every_way_times_every_stage_of_every_split(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench_stage_context")
    assert bench.main(["--model", "mlp", "--ways", *bench.WAYS, "--rounds", "1", "--idle-ms", "0.1"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| autopp |")]
    assert sorted((r[1], r[3]) for r in rows) == sorted((str(s), w) for s in (0, 1) for w in bench.WAYS)
    for r in rows:  # the runtime's bookkeeping: each action minus the compute inside it, more than none
        assert (r[3] == "runtime") == (r[7] != "-")
        assert r[3] != "runtime" or all(float(x) > 0 for x in r[7].split(" / "))
