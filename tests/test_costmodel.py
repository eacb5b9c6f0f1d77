"""Closed-form step time, bubble and memory of 1F1B and GPipe."""

from __future__ import annotations

import pytest

from autopp.costmodel import Schedule, StageCost, bubble_fraction, stage_memory, step_time


def _equal(p: int) -> list[StageCost]:
    return [StageCost(1.0, 2.0, 100, 10, 0.0) for _ in range(p)]


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 16), (8, 3)])
def test_equal_stages_match_textbook_bubble(p: int, m: int) -> None:
    stages = _equal(p)
    step = step_time(stages, m, Schedule.ONE_F_ONE_B)
    assert step == pytest.approx((m + p - 1) * 3.0)
    assert bubble_fraction(stages, m, step) == pytest.approx((p - 1) / (m + p - 1))


def test_communication_counts_twice_per_cut() -> None:
    stages = [StageCost(1.0, 2.0, 0, 0, 0.5), StageCost(1.0, 2.0, 0, 0, 0.0)]
    assert step_time(stages, 4, Schedule.ONE_F_ONE_B) == pytest.approx(6.0 + 1.0 + 3 * 3.0)


def test_gpipe_takes_forward_and_backward_bottlenecks_apart() -> None:
    stages = [StageCost(2.0, 1.0, 0, 0, 0.0), StageCost(1.0, 2.0, 0, 0, 0.0)]
    assert step_time(stages, 3, Schedule.ONE_F_ONE_B) == pytest.approx(6.0 + 2 * 3.0)
    assert step_time(stages, 3, Schedule.GPIPE) == pytest.approx(6.0 + 2 * 4.0)


def test_memory_in_flight() -> None:
    c = StageCost(1.0, 1.0, static_bytes=1000, activation_bytes=10, send_s=0.0)
    assert [stage_memory(c, s, 4, 8, Schedule.ONE_F_ONE_B) for s in range(4)] == [1040, 1030, 1020, 1010]
    assert stage_memory(c, 0, 4, 2, Schedule.ONE_F_ONE_B) == 1020
    assert stage_memory(c, 3, 4, 8, Schedule.GPIPE) == 1080
