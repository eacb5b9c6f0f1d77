"""Pictures of a simulated step: a matplotlib timeline PNG and a Chrome/Perfetto trace JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from autopp.schedule.actions import Kind
from autopp.schedule.simulate import SimResult
from autopp.sizes import format_size

__all__ = ["KIND_COLOURS", "memory_steps", "timeline_figure", "draw_timeline", "write_chrome_trace", "chrome_trace"]

KIND_COLOURS: dict[Kind, str] = {Kind.F: "#4c72b0", Kind.I: "#dd8452", Kind.W: "#55a868", Kind.B: "#c44e52"}
"""Box colour per compute kind."""

_MAX_LABELS = 4000
"""Above this many events, boxes are drawn without microbatch numbers (unreadable anyway, and slow)."""


def _num_ranks(result: SimResult) -> int:
    return len(result.memory_timeline)


def _draw_boxes(ax: Any, result: SimResult) -> None:
    label = len(result.events) <= _MAX_LABELS
    for kind, colour in KIND_COLOURS.items():
        for rank in range(_num_ranks(result)):
            spans = [(e.start_s, e.end_s - e.start_s) for e in result.events if e.rank == rank and e.action.kind is kind]
            if spans:
                ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.3)
    if label:
        for e in result.events:
            ax.text((e.start_s + e.end_s) / 2, e.rank, str(e.action.microbatch), ha="center", va="center",
                    fontsize=6, color="white", clip_on=True)


def _style_timeline(ax: Any, result: SimResult, title: str, headline: str | None = None) -> None:
    """Rank labels, the legend, and the title: `title`, then `headline` (the caller's figures: a plan's stored
    prediction, a report's median; default: the drawn step's time and mean bubble), then each rank's bubble."""
    from matplotlib.patches import Patch

    ranks = _num_ranks(result)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, max(result.step_time_s, 1e-12))
    mean = sum(result.bubble_fraction) / max(len(result.bubble_fraction), 1)
    per_rank = ", ".join(f"{b:.0%}" for b in result.bubble_fraction[:8])
    if headline is None:
        headline = f"step {result.step_time_s:.4g} s, bubble {mean:.0%}"
    ax.set_title(f"{title + ': ' if title else ''}{headline} "
                 f"(bubble per rank: {per_rank}{', ...' if len(result.bubble_fraction) > 8 else ''})")
    ax.legend(handles=[Patch(color=c, label=k.value) for k, c in KIND_COLOURS.items()], loc="lower left",
              bbox_to_anchor=(1.0, 0.0), fontsize=7, ncol=1, frameon=False)


def memory_steps(ax: Any, result: SimResult, what: str = "", colours: Sequence[str] | None = None) -> None:
    """Each rank's memory over the step as a step curve of the bytes it holds, labelled `rank R{what} (peak ...)`;
    where the peak also counts an action's working memory (schedule.effects, TRANSIENT), a dotted line of the same
    colour marks it and the label says how much of it that is, so the figure reaches the stated peak."""
    for rank, timeline in enumerate(result.memory_timeline):
        times = [t for t, _ in timeline] + [result.step_time_s]
        held = [b / 2**20 for _, b in timeline]
        held.append(held[-1])
        peak, top = result.peak_memory_bytes[rank], max(b for _, b in timeline)
        extra = f": held {format_size(top)} + working {format_size(peak - top)}" if peak > top else ""
        (line,) = ax.step(times, held, where="post", color=None if colours is None else colours[rank % len(colours)],
                          label=f"rank {rank}{what} (peak {format_size(peak)}{extra})")
        if peak > top:
            ax.hlines(peak / 2**20, 0, result.step_time_s, colors=line.get_color(), linestyles="dotted")


def _draw_memory(ax: Any, result: SimResult) -> None:
    memory_steps(ax, result)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("memory (MiB)")
    ax.set_xlim(0, max(result.step_time_s, 1e-12))
    if _num_ranks(result) <= 16:
        ax.legend(fontsize=7, loc="upper right")


def timeline_figure(result: SimResult, title: str = "", headline: str | None = None) -> Any:
    """A matplotlib Figure: one row per rank with F/I/W/B boxes numbered by microbatch, and each rank's memory
    below; the title carries `headline` (see `_style_timeline`).

    Renders with matplotlib's Agg canvas on a standalone Figure: no pyplot, no global backend change.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ranks = _num_ranks(result)
    fig = Figure(figsize=(14, 2.5 + 0.45 * ranks + 3))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [max(ranks, 2), 3]})
    _draw_boxes(top, result)
    _style_timeline(top, result, title, headline)
    _draw_memory(bottom, result)
    fig.tight_layout()
    return fig


def draw_timeline(result: SimResult, path: str | Path, title: str = "", headline: str | None = None) -> Any:
    """Write `timeline_figure` as a PNG to `path`; returns the Figure."""
    fig = timeline_figure(result, title, headline)
    fig.savefig(path, dpi=120)
    return fig


def chrome_trace(result: SimResult) -> dict[str, Any]:
    """Trace-event JSON object: one process per rank, compute as ph "X" slices, memory as ph "C" counters (µs)."""
    events: list[dict[str, Any]] = []
    for rank in range(_num_ranks(result)):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for t, held in result.memory_timeline[rank]:
            events.append({"name": "memory", "ph": "C", "pid": rank, "tid": 0, "ts": t * 1e6, "args": {"bytes": held}})
    for e in result.events:
        a = e.action
        events.append({"name": str(a), "cat": a.kind.value, "ph": "X", "pid": e.rank, "tid": 0, "ts": e.start_s * 1e6,
                       "dur": (e.end_s - e.start_s) * 1e6,
                       "args": {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind.value}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimResult, path: str | Path) -> None:
    """Write :func:`chrome_trace` to ``path`` (open in chrome://tracing or ui.perfetto.dev)."""
    Path(path).write_text(json.dumps(chrome_trace(result)))
