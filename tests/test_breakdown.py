"""The time breakdown's value and JSON (autopp.data.breakdown): a plan writes it and reads it back; a bad field is
one line naming it."""

from __future__ import annotations

import json

import pytest

from autopp.data.breakdown import StageTime, TimeBreakdown
from autopp.data.plan import Plan
from autopp.errors import PlanError

from .test_plan import _plan as sample_plan

BREAKDOWN = TimeBreakdown(stages=(StageTime(compute_s=1.0, tp_s=0.5, recompute_s=0.25),
                                  StageTime(compute_s=2.0, zero_s=0.1, zero_hidden_s=0.3)),
                          bubble_s=0.4, sync_s=0.2, sync_hidden_s=0.6, optimizer_s=0.05)


def test_rows_sum_the_stages_and_list_the_steps_terms() -> None:
    rows = {name: (exposed, hidden) for name, exposed, hidden in BREAKDOWN.rows()}
    assert rows["compute"] == (3.0, 0.0) and rows["TP/SP collectives"] == (0.5, 0.0)
    assert rows["ZeRO collectives in F/B"] == pytest.approx((0.1, 0.3)) and rows["recomputation"] == (0.25, 0.0)
    assert rows["DP/ZeRO at the step's end"] == (0.2, 0.6) and rows["pipeline bubble"] == (0.4, 0.0)
    assert BREAKDOWN.stages[0].busy_s == 1.75
    assert {name: exposed for name, exposed, _ in BREAKDOWN.rows(2)}["compute"] == 1.5  # averaged over 2 ranks


def test_a_plan_writes_and_reads_its_breakdown_and_omits_none() -> None:
    from dataclasses import replace
    plan = replace(sample_plan(), time_breakdown=BREAKDOWN)
    data = json.loads(json.dumps(plan.to_json()))
    assert Plan.from_json(data).time_breakdown == BREAKDOWN
    assert "time_breakdown" not in sample_plan().to_json()
    data["time_breakdown"]["stages"][1]["zero_s"] = -1
    with pytest.raises(PlanError, match=r"zero_s"):
        Plan.from_json(data)
