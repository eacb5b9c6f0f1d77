"""A run report's measured step as a simulator result, and a picture of it above the predicted one and the memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..data.zero import zero_stage
from ..schedule import Event, SimResult, parse_action
from ..schedule.draw import memory_axis_unit, memory_steps
from ..sizes import format_in, format_size
from .report import RunReport, first_up_microbatch, host_oversubscribed, mirrored, step_time_unit

__all__ = ["measured_timeline", "measured_headline", "predicted_headline", "report_figure", "draw_report"]


def _as_dict(report: RunReport | dict[str, Any]) -> dict[str, Any]:
    return report.to_json() if isinstance(report, RunReport) else report


def _drawn(data: dict[str, Any], replica: int) -> list[dict[str, Any]]:
    """The report's ranks a timeline draws: replica `replica`'s, tp rank 0 of each group, by pipeline rank."""
    return sorted((r for r in data.get("ranks", []) if r["replica"] == replica and r.get("tp_rank", 0) == 0),
                  key=lambda r: r["pp_rank"])


def measured_timeline(report: RunReport | dict[str, Any], replica: int = 0) -> SimResult:
    """The median step of one replica as a SimResult: events per pipeline rank (start/end from that rank's step
    start, after a barrier; with tensor parallelism, tp rank 0 of each group, which runs the same actions as its
    peers), that step's time, busy-time bubbles, and each rank's measured peak memory (a flat memory line: the
    runner measures the peak, not its timeline)."""
    data = _as_dict(report)
    ranks = _drawn(data, replica)
    if not ranks:
        raise ValueError("the report has no per-rank measurements (an incomplete run, or a version-1 report)")
    step = data.get("timeline_step") or 0
    step_time = max(float(r["step_times_s"][step]) for r in ranks)
    events = [Event(r["pp_rank"], parse_action(text), float(start), float(end))
              for r in ranks for text, start, end in r["actions"]]
    busy = [sum(e.end_s - e.start_s for e in events if e.rank == r["pp_rank"]) for r in ranks]
    peaks = [int(r["peak_memory_bytes"]) for r in ranks]
    return SimResult(events=events, step_time_s=step_time,
                     bubble_fraction=[max(0.0, 1 - b / step_time) if step_time > 0 else 0.0 for b in busy],
                     peak_memory_bytes=peaks, memory_timeline=[[(0.0, p)] for p in peaks],
                     mirror=first_up_microbatch(str(data.get("schedule")), int(data.get("num_microbatches", 0))))


def measured_headline(report: RunReport | dict[str, Any], drawn_step: bool = True) -> str:
    """The report's measured step time as its text prints it (the median of the timed steps), which step the
    timeline draws (the median step; with an even count, the faster of the two middle ones; not said when
    `drawn_step` is False: no measured timeline is drawn), and whether the host's ranks outnumbered its cores."""
    data = _as_dict(report)
    median, times = data.get("measured_step_time_s"), data.get("step_times_s") or []
    step = data.get("timeline_step") or 0
    unit = _step_unit(data)
    drawn = f"drawn: step {step + 1} of {len(times)}, {format_in(times[step], unit)}" if step < len(times) \
        else "drawn: one step"
    timed = f"median of steps 2-{len(times)}" if len(times) > 2 else ("step 2" if len(times) == 2 else "one step")
    figure = "-" if median is None else format_in(float(median), unit)
    over = host_oversubscribed(data)
    return f"step {figure} ({timed}{'; ' + drawn if drawn_step else ''})" + (f"; {over}" if over else "")


def predicted_headline(report: RunReport | dict[str, Any], predicted: SimResult) -> str:
    """The report's predicted step time (the plan's prediction) as its text prints it, and what it adds to the
    simulated pipeline drawn (the optimizer step and the data-parallel all-reduce)."""
    data = _as_dict(report)
    step = float(data.get("predicted_step_time_s", predicted.step_time_s))
    rest = step - predicted.step_time_s
    zero = zero_stage(data.get("zero", 0))
    sync = "replicas' gradient sum" if mirrored(str(data.get("schedule"))) else \
        "all-reduce" if zero.replicated else f"{zero} collectives"
    unit = _step_unit(data)
    return f"step {format_in(step, unit)}" + (f" (pipeline {format_in(predicted.step_time_s, unit)} + optimizer and "
                                              f"{sync} {format_in(rest, unit)})" if rest > 1e-9 else "")


def _step_unit(data: dict[str, Any]) -> tuple[str, float]:
    """The unit the report's text writes its step times in (`step_time_unit`)."""
    return step_time_unit(data.get("measured_step_time_s"), float(data.get("predicted_step_time_s") or 0.0),
                          [float(t) for t in data.get("step_times_s") or []])


def drawn_ranks(report: RunReport | dict[str, Any], replica: int = 0) -> list[str]:
    """Per pipeline rank drawn (`measured_timeline`'s lanes, named by pipeline rank as the plan's table names them),
    with the process its measurements are from where that differs (dp or tp above 1): "rank 1 (global rank 2)"."""
    return [f"rank {r['pp_rank']}" + (f" (global rank {r['rank']})" if r["rank"] != r["pp_rank"] else "")
            for r in _drawn(_as_dict(report), replica)]


def _draw_memory(ax: Any, measured: SimResult, predicted: SimResult | None, method: str | None,
                 names: list[str]) -> None:
    """Each rank's measured peak (a flat dashed line: the runner measures the peak, not its course; `names`: the
    process it is from, `drawn_ranks`) over the predicted memory over the step, in the rank's colour."""
    colours = [f"C{r % 10}" for r in range(len(measured.peak_memory_bytes))]
    how = f", {method}" if method else ""
    unit = memory_axis_unit([*measured.peak_memory_bytes, *(predicted.peak_memory_bytes if predicted else [])])
    for rank, peak in enumerate(measured.peak_memory_bytes):
        ax.axhline(peak / unit[1], color=colours[rank], linestyle="--",
                   label=f"{names[rank]} measured peak {format_size(peak)}{how}")
    if predicted is not None:
        memory_steps(ax, predicted, " predicted", colours, unit)
    ax.set_ylabel(f"memory ({unit[0]})")
    ax.set_ylim(bottom=0)
    if len(colours) <= 16:  # beside the panel, as a plan's picture has it: over the lines it hid them (a tester)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def _what(data: dict[str, Any]) -> str:
    """What the run was, for its picture's titles (the plan's picture says as much): "gpt.py: 1F1B, 2 microbatches
    of 4, "; "" for a report without those fields."""
    from ..display import format_microbatches
    if not all(data.get(k) for k in ("model_path", "schedule", "num_microbatches", "microbatch_size")):
        return ""
    return (f"{Path(str(data['model_path'])).name}: {data['schedule']}, "
            f"{format_microbatches(int(data['num_microbatches']), int(data['microbatch_size']))}, ")


def report_figure(report: RunReport | dict[str, Any], predicted: SimResult | None) -> Any:
    """A matplotlib Figure: the measured step (top) above the predicted one, F/I/W/B boxes per rank, on one time
    axis, and each rank's memory below (measured peak, predicted course). The titles carry the report's figures:
    its median measured step time and its predicted step time, as `format_report` prints them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ..schedule.draw import _draw_boxes, _style_timeline, lay_out

    measured = measured_timeline(report)
    data = _as_dict(report)
    dp = int(data.get("dp", 1))  # the lanes are pipeline ranks: of which replica, where several
    results = [(measured, f"{_what(data)}measured" + (f" (replica 0 of {dp})" if dp > 1 else ""),
                measured_headline(report))]
    if predicted is not None:
        results.append((predicted, f"{_what(data)}predicted (simulated)", predicted_headline(report, predicted)))
    ranks = len(measured.peak_memory_bytes)
    fig = Figure(figsize=(14, 4 + 0.5 * ranks * len(results)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(results) + 1, 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [max(ranks, 2)] * len(results) + [3]})[:, 0]
    for ax, (result, title, headline) in zip(axes, results):
        _draw_boxes(ax, result)
        _style_timeline(ax, result, title, headline)
    _draw_memory(axes[-1], measured, predicted, data.get("memory_method"), drawn_ranks(report))
    axes[-1].set_xlabel("time (s)")
    span = max(r.step_time_s for r, _, _ in results) or 1e-12
    lay_out(fig, [(ax, *r) for ax, r in zip(axes, results)], span)
    return fig


def draw_report(report: RunReport | dict[str, Any], predicted: SimResult | None, path: str | Path) -> Path:
    """Write `report_figure` as a PNG to `path`."""
    report_figure(report, predicted).savefig(path, dpi=120)
    return Path(path)
