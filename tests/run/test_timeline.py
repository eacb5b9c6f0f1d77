"""A report's measured step as a SimResult, drawn above a prediction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autopp.run import draw_report, measured_timeline
from autopp.schedule import Kind, ScheduleName, StageCost, simulate_named


def _report() -> dict[str, Any]:
    def rank(r: int, replica: int, actions: list[list[Any]]) -> dict[str, Any]:
        return {"rank": r, "replica": replica, "pp_rank": r % 2, "stages": [r % 2], "step_times_s": [0.5, 0.2],
                "wait_s": 0.01, "peak_memory_bytes": 1000 + r, "actions": actions}
    return {"timeline_step": 1, "ranks": [
        rank(0, 0, [["0F0", 0.0, 0.05], ["0B0", 0.1, 0.2]]),
        rank(1, 0, [["1F0", 0.05, 0.08], ["1B0", 0.08, 0.1]]),
        rank(2, 1, [["0F0", 0.0, 0.01]]),
        rank(3, 1, []),
    ]}


def test_measured_timeline_of_replica_zero() -> None:
    result = measured_timeline(_report())
    assert result.step_time_s == 0.2 and result.peak_memory_bytes == [1000, 1001]
    assert [(e.rank, str(e.action)) for e in result.events] == [(0, "0F0"), (0, "0B0"), (1, "1F0"), (1, "1B0")]
    assert result.events[1].action.kind is Kind.B
    assert result.bubble_fraction == pytest.approx([0.25, 0.75])
    assert len(measured_timeline(_report(), replica=1).events) == 1


def test_incomplete_report_has_no_timeline() -> None:
    with pytest.raises(ValueError, match="no per-rank measurements"):
        measured_timeline({"ranks": []})


def test_draw_measured_above_predicted(tmp_path: Path) -> None:
    cost = StageCost(forward_s=0.05, backward_input_s=0.03, backward_weight_s=0.02)
    predicted = simulate_named(ScheduleName.GPIPE, 2, 1, [cost, cost], [0.0])
    path = draw_report(_report(), predicted, tmp_path / "t.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
