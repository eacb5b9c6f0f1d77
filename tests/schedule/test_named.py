"""Named schedules: our torch-free derivation equals the order torch.distributed.pipelining executes."""

from __future__ import annotations

import itertools

import pytest

from autopp.errors import ScheduleError
from autopp.schedule.actions import Kind
from autopp.schedule import NAMED, ScheduleName, build_schedule, describe, stage_to_rank, stages_per_rank, validate
from tests.schedule.torch_reference import FakeStage, torch_order

RANKS = (1, 2, 3, 4)
MICROBATCHES = (1, 2, 3, 4, 5, 6, 8, 9, 12)
IN_TORCH = [n for n in NAMED if describe(n).torch_class]  # Chimera: tests/schedule/test_chimera.py
ONE_OWNER = [n for n in NAMED if not describe(n).mirrored]
MULTI = (ScheduleName.INTERLEAVED_1F1B, ScheduleName.LOOPED_BFS, ScheduleName.INTERLEAVED_ZERO_BUBBLE)


def _cases() -> list[tuple[ScheduleName, int, int, int]]:
    cases: list[tuple[ScheduleName, int, int, int]] = []
    for name, p, m in itertools.product(NAMED, RANKS, MICROBATCHES):
        vs = (1, 2, 3) if name in MULTI else (stages_per_rank(name),)
        cases.extend((name, p, m, v) for v in vs)
    return cases


@pytest.mark.parametrize("name", IN_TORCH, ids=lambda n: n.value)
def test_equals_torch_over_grid(name: ScheduleName) -> None:
    checked = 0
    for _, p, m, v in [c for c in _cases() if c[0] is name]:
        try:
            expected = torch_order(name, p, m, v)
        except (ValueError, AssertionError, RuntimeError):
            with pytest.raises(ScheduleError):
                build_schedule(name, p, m, v)
            continue
        assert build_schedule(name, p, m, v) == expected, (name, p, m, v)
        checked += 1
    assert checked >= len(RANKS) * 3


def test_torch_1f1b_pipeline_order_skips_mb0_on_last_rank() -> None:
    # torch 2.13's Schedule1F1B._get_pipeline_order prints 2F1..2F4 on the last rank; its runtime runs 2F0..2F3.
    from torch.distributed.pipelining import schedules as ts

    printed = ts.Schedule1F1B(FakeStage(2, 3, 3, 2), 4).pipeline_order  # type: ignore[arg-type]
    assert printed is not None
    assert [str(a) for a in printed[2] if a is not None][0] == "2F1"
    assert str(build_schedule(ScheduleName.ONE_F_ONE_B, 3, 4)[2][0]) == "2F0"


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "message"),
    [
        (ScheduleName.ONE_F_ONE_B, 4, 2, 1, "1F1B needs microbatches >= stages (2 < 4)"),
        (ScheduleName.DUAL_PIPE_V, 3, 5, 2, "DualPipeV needs microbatches >= stages (5 < 6)"),
        (ScheduleName.INTERLEAVED_1F1B, 4, 9, 2, "(9 % 2 = 1)"),
        (ScheduleName.GPIPE, 2, 4, 2, "exactly 1 stage per rank (2 != 1)"),
        (ScheduleName.ZBV_ZERO_BUBBLE, 2, 4, 3, "exactly 2 stages per rank (3 != 2)"),
        (ScheduleName.LOOPED_BFS, 2, 0, 1, "microbatches >= 1 (0 < 1)"),
    ],
)
def test_constraint_errors_name_numbers(name: ScheduleName, p: int, m: int, v: int, message: str) -> None:
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(name, p, m, v)


def test_layouts() -> None:
    assert stage_to_rank(ScheduleName.INTERLEAVED_1F1B, 3, 2) == [0, 1, 2, 0, 1, 2]
    assert stage_to_rank(ScheduleName.ZBV_ZERO_BUBBLE, 3) == [0, 1, 2, 2, 1, 0]
    assert stage_to_rank(ScheduleName.GPIPE, 3) == [0, 1, 2]


@pytest.mark.parametrize("name", ONE_OWNER, ids=lambda n: n.value)
def test_every_microbatch_has_forward_and_backward(name: ScheduleName) -> None:
    p, m = 3, 6
    v = 2 if name in MULTI else 1
    order = build_schedule(name, p, m, v)
    owner = stage_to_rank(name, p, v)
    actions = [(r, a) for r, acts in order.items() for a in acts]
    assert all(owner[a.stage] == r for r, a in actions)
    forwards = {(a.stage, a.microbatch) for _, a in actions if a.kind is Kind.F}
    weights = {(a.stage, a.microbatch) for _, a in actions if a.kind in (Kind.B, Kind.W)}
    assert forwards == weights == {(s, i) for s in range(len(owner)) for i in range(m)}
