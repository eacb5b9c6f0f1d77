"""Run a Plan with torch.distributed.pipelining on local ranks or through torchrun, measure it, validate it
(the only pipelining user)."""

from __future__ import annotations

from .options import Nodes, RunOptions
from .report import RunFailedError, RunReport, format_report, load_report
from .runner import run_plan
from .timeline import draw_report, measured_timeline
from .torchrun import torchrun_command
from .validate import GRAD_RTOL, LOSS_RTOL, TOLERANCES

__all__ = ["run_plan", "RunOptions", "RunReport", "RunFailedError", "format_report", "load_report",
           "measured_timeline", "draw_report", "Nodes", "torchrun_command", "GRAD_RTOL", "LOSS_RTOL", "TOLERANCES"]
