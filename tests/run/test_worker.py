"""Unit tests of the worker's pure helpers (stage placement, schedule choice)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.errors import RunError
from autopp.run.worker import SCHEDULES, make_schedule, stage_of_rank

from .conftest import GPT, two_stage_plan


def test_stage_of_rank() -> None:
    plan = two_stage_plan(GPT, "h.2")
    assert stage_of_rank(plan, 1).split_point == "h.2"
    swapped = replace(plan, stages=tuple(replace(s, rank=1 - s.rank) for s in plan.stages))
    placed = r"needs exactly stage 0 on rank 0; plan places \(stage, rank\) as \[\(0, 1\), \(1, 0\)\]"
    with pytest.raises(RunError, match=placed):
        stage_of_rank(swapped, 0)


def test_unknown_schedule_is_refused() -> None:
    assert sorted(SCHEDULES) == ["1F1B", "GPipe"]
    with pytest.raises(RunError, match=r"schedule 'ZBV' is not supported by the runner; use one of \['1F1B', "):
        make_schedule("ZBV", None, 2, None)  # type: ignore[arg-type]
