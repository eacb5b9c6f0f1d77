"""A run report's measured step as a simulator result, and a picture of it above the predicted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..schedule import Event, SimResult, parse_action
from .report import RunReport

__all__ = ["measured_timeline", "draw_report"]


def _as_dict(report: RunReport | dict[str, Any]) -> dict[str, Any]:
    return report.to_json() if isinstance(report, RunReport) else report


def measured_timeline(report: RunReport | dict[str, Any], replica: int = 0) -> SimResult:
    """The median step of one replica as a SimResult: events per pipeline rank (start/end from that rank's step
    start, after a barrier), that step's time, busy-time bubbles, and each rank's measured peak memory (a flat
    memory line: the runner measures the peak, not its timeline)."""
    data = _as_dict(report)
    ranks = sorted((r for r in data.get("ranks", []) if r["replica"] == replica), key=lambda r: r["pp_rank"])
    if not ranks:
        raise ValueError("the report has no per-rank measurements (an incomplete run, or a version-1 report)")
    step = data.get("timeline_step") or 0
    step_time = max(float(r["step_times_s"][step]) for r in ranks)
    events = [Event(r["pp_rank"], parse_action(text), float(start), float(end))
              for r in ranks for text, start, end in r["actions"]]
    busy = [sum(e.end_s - e.start_s for e in events if e.rank == r["pp_rank"]) for r in ranks]
    peaks = [int(r["peak_memory_bytes"]) for r in ranks]
    return SimResult(events=events, step_time_s=step_time,
                     bubble_fraction=[1 - b / step_time if step_time > 0 else 0.0 for b in busy],
                     peak_memory_bytes=peaks, memory_timeline=[[(0.0, p)] for p in peaks])


def draw_report(report: RunReport | dict[str, Any], predicted: SimResult | None, path: str | Path) -> Path:
    """PNG: the measured step (top) above the predicted one (bottom) on one time axis, F/I/W/B boxes per rank."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ..schedule.draw import _draw_boxes, _style_timeline

    measured = measured_timeline(report)
    results = [(measured, "measured")] + ([(predicted, "predicted")] if predicted is not None else [])
    ranks = len(measured.peak_memory_bytes)
    fig = Figure(figsize=(14, 1.5 + 0.5 * ranks * len(results)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(results), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (result, title) in zip(axes, results):
        _draw_boxes(ax, result)
        _style_timeline(ax, result, title)
    axes[-1].set_xlim(0, max(r.step_time_s for r, _ in results) or 1e-12)
    axes[-1].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)
