"""Pipeline action IR: typed ``(stage, kind, microbatch)`` actions in torch's text form, grids and CSV rows."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import NamedTuple

from autopp.errors import ScheduleError

__all__ = [
    "Kind",
    "Action",
    "Order",
    "COMPUTE_KINDS",
    "parse_action",
    "format_grid",
    "parse_grid",
    "to_csv_rows",
    "from_csv_rows",
]


class Kind(Enum):
    """What an action does; values are the letters torch.distributed.pipelining prints."""

    F = "F"
    """Forward of one microbatch through one stage."""
    I = "I"  # noqa: E741 - torch's letter for backward-input
    """Backward for the stage input only (zero-bubble split; weights later in W)."""
    W = "W"
    """Backward for the stage weights (after the matching I)."""
    B = "B"
    """Full backward: input and weight gradients together (I + W)."""
    SEND_F = "SEND_F"
    """Send a forward activation to the next stage."""
    RECV_F = "RECV_F"
    """Receive a forward activation from the previous stage."""
    SEND_B = "SEND_B"
    """Send an input gradient to the previous stage."""
    RECV_B = "RECV_B"
    """Receive an output gradient from the next stage."""

    # Members are singletons compared by identity, so the C-level identity hash is consistent with ==;
    # Enum's default hashes the name in Python, which dominated the simulator's dict lookups.
    __hash__ = object.__hash__


COMPUTE_KINDS: frozenset[Kind] = frozenset({Kind.F, Kind.I, Kind.W, Kind.B})
"""Kinds that occupy a rank's compute stream."""

_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|W|B)(\d+)")


class Action(NamedTuple):
    """One step of a schedule: ``kind`` on ``microbatch`` at pipeline ``stage``; prints as ``2F0``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"


Order = Mapping[int, Sequence[Action | None]]
"""Per-rank action lists (rank -> actions in execution order; ``None`` is a deliberate idle slot)."""


def parse_action(text: str) -> Action:
    """Parse torch's text form (``2F0``, ``1SEND_F3``) into an Action."""
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None:
        raise ScheduleError(f"cannot parse action {text!r} (expected STAGE KIND MICROBATCH, e.g. 2F0 or 1SEND_F3)")
    stage, kind, microbatch = match.groups()
    return Action(int(stage), Kind(kind), int(microbatch))


def _parse_cell(text: str) -> Action | None:
    return None if text.strip() == "" else parse_action(text)


def _cell(action: Action | None) -> str:
    return "" if action is None else str(action)


def _check_ranks(order: Order) -> int:
    ranks = sorted(order)
    if ranks != list(range(len(ranks))):
        raise ScheduleError(f"ranks must be 0..{len(ranks) - 1}, got {ranks}")
    return len(ranks)


def format_grid(order: Order) -> str:
    """Format per-rank actions as a step (row) x rank (column) grid, laid out like torch's printer."""
    num_ranks = _check_ranks(order)
    num_steps = max((len(order[r]) for r in range(num_ranks)), default=0)
    width = len(str(max(num_steps - 1, 0)))
    labels = ["Step " + str(i).zfill(width) for i in range(num_steps)]
    columns = [[_cell(a) for a in order[r]] + [""] * (num_steps - len(order[r])) for r in range(num_ranks)]
    headers = [f"Rank {r}" for r in range(num_ranks)]
    widths = [max([len(labels[0]) if labels else 0, len(h)] + [len(c) for c in col])
              for h, col in zip(headers, columns)]
    pad = len(labels[0]) + 2 if labels else len("Step 0") + 2
    lines = [" " * pad + " ".join(f"{h:<{w}}" for h, w in zip(headers, widths))]
    for i, label in enumerate(labels):
        lines.append(f"{label}: " + " ".join(f"{col[i]:<{w}}" for col, w in zip(columns, widths)))
    return "\n".join(lines) + "\n"


def _column_starts(header: str) -> list[int]:
    starts = [m.start() for m in re.finditer(r"Rank \d+", header)]
    if not starts:
        raise ScheduleError(f"grid header names no ranks: {header!r}")
    return starts


def parse_grid(text: str) -> dict[int, list[Action | None]]:
    """Parse the output of :func:`format_grid` back into per-rank lists (trailing idle slots dropped)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ScheduleError("grid is empty (0 lines)")
    starts = _column_starts(lines[0])
    order: dict[int, list[Action | None]] = {r: [] for r in range(len(starts))}
    for line in lines[1:]:
        bounds = starts + [max(len(line), starts[-1]) + 1]
        for r in range(len(starts)):
            order[r].append(_parse_cell(line[bounds[r] : bounds[r + 1]]))
    return {r: _strip_trailing(actions) for r, actions in order.items()}


def _strip_trailing(actions: list[Action | None]) -> list[Action | None]:
    end = len(actions)
    while end > 0 and actions[end - 1] is None:
        end -= 1
    return actions[:end]


def to_csv_rows(order: Order) -> list[list[str]]:
    """Rows in torch's ``compute_only`` CSV layout: row r is rank r, cells like ``0F0``, blanks for idle."""
    num_ranks = _check_ranks(order)
    return [[_cell(a) for a in order[r]] for r in range(num_ranks)]


def from_csv_rows(rows: Sequence[Sequence[str]]) -> dict[int, list[Action | None]]:
    """Inverse of :func:`to_csv_rows` (trailing blank cells dropped)."""
    return {r: _strip_trailing([_parse_cell(c) for c in row]) for r, row in enumerate(rows)}
