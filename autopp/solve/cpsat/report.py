"""CP-SAT's solves on the one progress line (autopp.progress; issue 26): when someone shows it (its logger on at
INFO), the solve's start and each better solution, with the share of the time limit spent and the rest of the limit
as the time left. The OR-Tools examples' solution printer, on the progress line instead of stdout."""

from __future__ import annotations

import logging

from ortools.sat.python import cp_model

from ...progress import PROGRESS_LOG, timed_line

__all__ = ["SolveProgress", "solve_progress"]

_log = logging.getLogger(PROGRESS_LOG)


class SolveProgress(cp_model.CpSolverSolutionCallback):
    """Says each better solution of a solve limited to `limit_s` and how far it is from the bound proved so far."""

    def __init__(self, what: str, limit_s: float) -> None:
        super().__init__()
        self.what, self.limit_s = what, limit_s

    def on_solution_callback(self) -> None:
        value, bound = self.objective_value, self.best_objective_bound
        gap = (value - bound) / value if value > 0 else 0.0
        _log.info(timed_line(self.wall_time, self.limit_s, f"{self.what}: a better solution, {gap:.1%} above the "
                                                           f"bound"))


def solve_progress(what: str, limit_s: float) -> SolveProgress | None:
    """The callback to solve with, its start said, where the progress line is shown; else None (no callback)."""
    if not _log.isEnabledFor(logging.INFO):
        return None
    _log.info(timed_line(0.0, limit_s, f"{what}: solving for at most {limit_s:g} s"))
    return SolveProgress(what, limit_s)
