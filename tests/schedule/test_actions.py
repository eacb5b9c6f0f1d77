"""Action IR: text form, grid and CSV round trips, and agreement with torch's printer and CSV loader."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from autopp.errors import ScheduleError
from autopp.schedule.actions import Action, Kind, format_grid, from_csv_rows, parse_action, parse_grid, to_csv_rows
from autopp.schedule import ScheduleName, build_schedule
from tests.schedule.torch_reference import FakeStage, to_torch_action


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
def test_text_round_trip_every_kind(kind: Kind) -> None:
    action = Action(12, kind, 305)
    assert parse_action(str(action)) == action


def test_torch_text_form() -> None:
    assert str(Action(2, Kind.F, 0)) == "2F0"
    assert parse_action("1SEND_F3") == Action(1, Kind.SEND_F, 3)
    assert parse_action(" 0RECV_B7 ") == Action(0, Kind.RECV_B, 7)


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "2F0x", "2UNSHARD"])
def test_bad_text_raises(text: str) -> None:
    with pytest.raises(ScheduleError, match="cannot parse action"):
        parse_action(text)


def test_grid_round_trip_with_idle_slots() -> None:
    order = {0: [Action(0, Kind.F, 0), None, Action(0, Kind.B, 0)], 1: [None, Action(1, Kind.F, 0), Action(1, Kind.B, 0)]}
    assert parse_grid(format_grid(order)) == order


def test_grid_matches_torch_printer() -> None:
    from torch.distributed.pipelining.schedules import _format_pipeline_order

    order = build_schedule(ScheduleName.INTERLEAVED_ZERO_BUBBLE, 4, 8, 2)
    torch_order = {r: [to_torch_action(a) for a in acts] for r, acts in order.items()}
    assert format_grid(order) == _format_pipeline_order(torch_order)
    assert parse_grid(format_grid(order)) == order


def test_csv_round_trip_and_torch_loads_it(tmp_path: Path) -> None:
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    order = build_schedule(ScheduleName.ZBV_ZERO_BUBBLE, 2, 4, 2)
    rows = to_csv_rows(order)
    assert from_csv_rows(rows) == order
    path = tmp_path / "schedule.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    runtime = _PipelineScheduleRuntime([FakeStage(0, 4, 2, 0), FakeStage(3, 4, 2, 0)], 4)
    runtime._load_csv(str(path), format="compute_only")
    assert runtime.pipeline_order == {r: [to_torch_action(a) for a in acts] for r, acts in order.items()}
    assert runtime.stage_index_to_group_rank == {0: 0, 1: 1, 2: 1, 3: 0}


def test_csv_blank_cells_are_idle() -> None:
    assert from_csv_rows([["0F0", "", "0B0"]]) == {0: [Action(0, Kind.F, 0), None, Action(0, Kind.B, 0)]}


def test_grid_rejects_gapped_ranks() -> None:
    with pytest.raises(ScheduleError, match=r"ranks must be 0..1, got \[0, 2\]"):
        format_grid({0: [], 2: []})
