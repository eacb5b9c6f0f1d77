"""Run a Plan with torch.distributed.pipelining on local ranks, time it, validate it (the only pipelining user)."""

from __future__ import annotations

from .report import RunFailedError, RunReport, format_report
from .runner import run_plan
from .validate import GRAD_RTOL, LOSS_RTOL

__all__ = ["run_plan", "RunReport", "RunFailedError", "format_report", "GRAD_RTOL", "LOSS_RTOL"]
