"""Schedule descriptors: one registry holds every schedule's layout, size rules, estimate, bound and torch class."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from autopp.errors import ScheduleError
from autopp.schedule import DESCRIPTORS, NAMED, Floors, StagePlacement, ScheduleName, describe

AUTOPP = Path(__file__).resolve().parents[2] / "autopp"


def test_registry_covers_every_schedule_and_named_ones_have_an_order() -> None:
    assert set(DESCRIPTORS) == set(ScheduleName)
    assert ScheduleName.CUSTOM not in NAMED and ScheduleName.SEQ_1F1B not in NAMED
    assert len(NAMED) == len(ScheduleName) - 2
    seq = describe(ScheduleName.SEQ_1F1B)
    assert seq.sequence_chunks and seq.runnable and seq.builder is not None
    for name in NAMED:
        d = describe(name)
        assert d.name is name and d.builder is not None and d.estimate is not None and d.pipe_bound is not None
    custom = describe(ScheduleName.CUSTOM)
    assert custom.builder is None and custom.placement is StagePlacement.GIVEN
    with pytest.raises(ScheduleError, match="the plan gives it"):
        custom.build(2, 4)
    with pytest.raises(ScheduleError, match="the plan gives each stage's rank"):
        custom.stage_to_rank(2)


def test_torch_classes_exist() -> None:
    from torch.distributed.pipelining import schedules

    from tests.schedule.torch_reference import TORCH_CLASSES
    for name in NAMED:
        if describe(name).torch_class:  # Chimera: torch ships none (autopp's runner runs it)
            assert getattr(schedules, describe(name).torch_class) is TORCH_CLASSES[name]
    assert hasattr(schedules, describe(ScheduleName.CUSTOM).torch_class)


def test_layouts_and_stages_per_rank() -> None:
    assert describe(ScheduleName.INTERLEAVED_1F1B).stage_to_rank(2, 2) == [0, 1, 0, 1]
    assert describe(ScheduleName.ZBV_ZERO_BUBBLE).stage_to_rank(2, 1) == [0, 1, 1, 0]  # V: always 2 per rank
    assert describe(ScheduleName.ONE_F_ONE_B).stage_to_rank(3) == [0, 1, 2]
    assert describe(ScheduleName.LOOPED_BFS).v_choices(None) == [2, 4]
    assert describe(ScheduleName.LOOPED_BFS).v_choices(3) == [3]
    assert describe(ScheduleName.DUAL_PIPE_V).v_choices(4) == []  # a pinned v it does not run: not tried
    assert describe(ScheduleName.DUAL_PIPE_V).v_choices(2) == [2] == describe(ScheduleName.DUAL_PIPE_V).v_choices(None)
    with pytest.raises(ScheduleError, match=r"GPipe runs exactly 1 stage per rank \(2 != 1\)"):
        describe(ScheduleName.GPIPE).stages_per_rank(2)
    with pytest.raises(ScheduleError, match=r"ZBVZeroBubble runs exactly 2 stages per rank \(3 != 2\)"):
        describe(ScheduleName.ZBV_ZERO_BUBBLE).stages_per_rank(3)


@pytest.mark.parametrize(("name", "p", "m", "v", "message"), [
    (ScheduleName.ONE_F_ONE_B, 4, 3, 1, r"1F1B needs microbatches >= stages \(3 < 4\)"),
    (ScheduleName.DUAL_PIPE_V, 2, 3, 2, r"DualPipeV needs microbatches >= stages \(3 < 4\)"),
    (ScheduleName.INTERLEAVED_1F1B, 2, 5, 2, r"multiple of rounds .* \(5 % 2 = 1\)"),
    (ScheduleName.GPIPE, 2, 0, 1, r"GPipe needs microbatches >= 1 \(0 < 1\)"),
])
def test_size_rules_carry_their_numbers(name: ScheduleName, p: int, m: int, v: int, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        describe(name).validate(p, m, v)


def test_closed_form_estimates_by_hand() -> None:
    # Two stages on two ranks: F = (1, 3), I = (1, 1), W = (1, 0): T = (3, 4), B = (2, 1); one 0.5 s hop; m = 4.
    args = ([1.0, 3.0], [1.0, 1.0], [1.0, 0.0], [0, 1], [0.5], 4)
    assert describe(ScheduleName.ONE_F_ONE_B).estimate(*args) == 7 + 1 + 3 * 4  # type: ignore[misc]
    assert describe(ScheduleName.GPIPE).estimate(*args) == 7 + 1 + 3 * (3 + 2)  # type: ignore[misc]
    # Four stages, loop layout on two ranks (v = 2): R = (3 + 3, 4 + 4) = (6, 8).
    loop = ([1.0, 3.0, 1.0, 3.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0], [0, 1, 0, 1], [0.5, 0.0, 0.5], 4)
    assert describe(ScheduleName.INTERLEAVED_1F1B).estimate(*loop) == (4 + 1 / 2) * 8 + 2 * 1.0  # type: ignore[misc]
    # Zero bubble: m max R + (p - 1) / v max (F + I - W)^+ + 2 sum c / v, max (F + I - W) = 3 + 1 - 0 = 4.
    zb = describe(ScheduleName.INTERLEAVED_ZERO_BUBBLE).estimate
    assert zb is not None and zb(*loop) == 4 * 8 + 1 / 2 * 4 + 2 * 1.0 / 2


def _bound(name: ScheduleName, floors: Floors, m: int, p: int, v: int, estimate_only: bool = False) -> float:
    d = describe(name)
    bound = d.estimate_bound or d.pipe_bound if estimate_only else d.pipe_bound
    assert bound is not None
    return bound(floors, m, p, v)


def test_pipe_bounds_by_hand() -> None:
    floors = Floors(rank=8.0, total=10.0, stage=4.0, gap=-1.0, comm=2.0, path=7.0)
    # simulated: max(m max T, sum T + 2 sum c, sum T / (1 - (1 - 1/m)^p)) = max(16, 12, 10 / (1 - 9/16))
    assert _bound(ScheduleName.GPIPE, floors, 4, 2, 1) == pytest.approx(10 / (7 / 16))
    assert _bound(ScheduleName.GPIPE, floors, 4, 2, 1, estimate_only=True) == 24  # sum T + (m - 1) max T + 2 sum c
    assert _bound(ScheduleName.ONE_F_ONE_B, floors, 8, 2, 1) == pytest.approx(10 / (15 / 64))  # max(32, 12, 42.7)
    assert _bound(ScheduleName.ONE_F_ONE_B, floors._replace(total=30.0, stage=1.0), 1, 2, 1) == 32  # the round trip
    # simulated: max(m R, sum T + 2 sum c) = max(32, 12); the estimate's (m + (p - 1) / v) R + 2 sum c = 38
    assert _bound(ScheduleName.LOOPED_BFS, floors, 4, 2, 2) == 4 * 8
    assert _bound(ScheduleName.LOOPED_BFS, floors._replace(total=40.0), 4, 2, 2) == 42
    assert _bound(ScheduleName.LOOPED_BFS, floors, 4, 2, 2, estimate_only=True) == 38
    # simulated: max(m R, path + 2 sum c); the estimate's m R + (p - 1) / v max(0, gap) + 2 sum c / v, gap clipped
    assert _bound(ScheduleName.ZBV_ZERO_BUBBLE, floors, 4, 2, 2) == 4 * 8
    assert _bound(ScheduleName.ZBV_ZERO_BUBBLE, floors, 1, 2, 2) == 7 + 2
    assert _bound(ScheduleName.ZBV_ZERO_BUBBLE, floors, 4, 2, 2, estimate_only=True) == 4 * 8 + 1


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that stand alone as statements (module, class, function and field docstrings)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_no_schedule_name_strings_past_the_json_edge() -> None:
    """Only the registry spells schedule names, in code and in messages (a message naming a family of schedules
    builds the list from the registry: `listed`); docstrings may cite them, and export/ and the trainers' rules
    (data/trainers.py) speak the trainers' own vocabulary (Megatron's interleaved 1F1B, DeepSpeed's TrainSchedule)."""
    names = [n.value for n in ScheduleName]
    spelt = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, names)) + r")(?!\w)")
    allowed = {AUTOPP / "schedule" / "descriptors.py", AUTOPP / "data" / "trainers.py"}
    found = []
    for path in sorted(AUTOPP.rglob("*.py")):
        if path in allowed or path.parent.name == "export":
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                    and spelt.search(node.value)):
                found.append(f"{path.relative_to(AUTOPP)}:{node.lineno}: {node.value!r}")
    assert not found, "schedule names spelt outside the registry:\n" + "\n".join(found)
