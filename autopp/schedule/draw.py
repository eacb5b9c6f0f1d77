"""Pictures of a simulated step: a matplotlib timeline PNG and a Chrome/Perfetto trace JSON."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any, Sequence

from autopp.schedule.actions import Kind
from autopp.schedule.simulate import SimResult
from autopp.sizes import format_size, size_unit

__all__ = ["KIND_COLOURS", "stage_lane", "memory_steps", "memory_axis_unit", "timeline_figure",
           "draw_timeline", "write_chrome_trace", "chrome_trace"]

KIND_COLOURS: dict[Kind, str] = {Kind.F: "#4c72b0", Kind.I: "#dd8452", Kind.W: "#55a868", Kind.B: "#c44e52"}
"""Box colour per compute kind."""
_KIND_NAMES = {Kind.F: "F forward", Kind.I: "I input gradient", Kind.W: "W weight gradient", Kind.B: "B backward"}

_ROW = 0.8
"""The height of a rank's row of boxes (1 between rank centres)."""

_LABEL_PT = 6.0
"""Largest microbatch-number font (points); smaller where rows are low, none below `_SMALLEST_PT`."""
_SMALLEST_PT = 4.0
_TITLE_CHARS = 150
"""Title lines are wrapped at this many characters (14-inch figure, 10-point font), never cut off."""


def _num_ranks(result: SimResult) -> int:
    return len(result.memory_timeline)


def _chunks(result: SimResult) -> list[list[int]]:
    """Per rank, the stages it runs in model order (its chunk index is the position in this list)."""
    held: list[set[int]] = [set() for _ in range(_num_ranks(result))]
    for e in result.events:
        held[e.rank].add(e.action.stage)
    return [sorted(s) for s in held]


def stage_lane(rank: int, chunk: int, chunks: int) -> tuple[float, float]:
    """(bottom, height) on the y axis of the boxes that the `chunk`-th of a rank's `chunks` stages runs (in model
    order: a V schedule's rank r holds stages r and 2p - 1 - r, an interleaved one r, r + p, ...): the rank's row
    split into one lane per stage, the first on top (the y axis points down). A lane tells a box's stage at any
    width, where a hatch vanished on the boxes a pixel wide of 128 microbatches and crossed out their numbers."""
    height = _ROW / max(chunks, 1)
    return rank - _ROW / 2 + chunk * height, height


def _axes_points(ax: Any) -> tuple[float, float]:
    """The axes' width and height in points, from its place in the figure (before or after layout)."""
    fig = ax.get_figure()
    box = ax.get_position()
    width, height = fig.get_size_inches()
    return box.width * width * 72, box.height * height * 72


def _labels(ax: Any, result: SimResult, span_s: float | None = None) -> int:
    """Microbatch numbers on the boxes wide and tall enough for the longest number (so that boxes of one width are
    all numbered or none is, and no number leaves its box: a rank's boxes do not overlap), centred in their stage's
    lane (`stage_lane`); returns how many."""
    width_pt, height_pt = _axes_points(ax)
    ranks, span = max(_num_ranks(result), 1), max(span_s or result.step_time_s, 1e-12)  # the axis's seconds
    chunks = _chunks(result)
    most = max(map(len, chunks), default=1)
    size = min(_LABEL_PT, _ROW * 0.7 * height_pt / ranks / most)  # the digits are about 0.7 of the font
    digits = max((len(str(e.action.microbatch)) for e in result.events), default=1)
    room = (0.62 * size * digits + 1.5) / width_pt * span  # the shortest box a number fits in, in seconds
    if size < _SMALLEST_PT:
        return 0
    fits = [e for e in result.events if e.end_s - e.start_s >= room]
    for e in fits:
        bottom, height = stage_lane(e.rank, chunks[e.rank].index(e.action.stage), most)
        ax.text((e.start_s + e.end_s) / 2, bottom + height / 2, str(e.action.microbatch), ha="center", va="center",
                fontsize=size, color="white", clip_on=True)
    return len(fits)


#: Boxes narrower than this (points: 3 pixels at the pictures' 120 dpi) blend into each other's colours.
_BLEND_PT = 3 * 72 / 120


def _median_box_points(ax: Any, result: SimResult) -> float:
    """The median action's width in points on `ax` (0 without actions)."""
    durations = sorted(e.end_s - e.start_s for e in result.events)
    return durations[len(durations) // 2] / max(result.step_time_s, 1e-12) * _axes_points(ax)[0] \
        if durations else 0.0


def _draw_boxes(ax: Any, result: SimResult) -> None:
    """F/I/W/B boxes per rank, coloured by kind, in the lane of the rank's stage that runs them (`stage_lane`); the
    microbatch numbers come once the figure is laid out (`lay_out`)."""
    chunks = _chunks(result)
    most = max(map(len, chunks), default=1)
    edge = 0.3 if _median_box_points(ax, result) >= 3 else 0.0  # a white edge would wash out boxes a few points wide
    for kind, colour in KIND_COLOURS.items():
        for rank, stages in enumerate(chunks):
            for c, stage in enumerate(stages):
                spans = [(e.start_s, e.end_s - e.start_s) for e in result.events
                         if e.rank == rank and e.action.kind is kind and e.action.stage == stage]
                if spans:
                    ax.broken_barh(spans, stage_lane(rank, c, most), facecolors=colour, edgecolor="white",
                                   linewidth=edge)
    _draw_sync(ax, result, chunks, most)


#: How a B's (or I's) leading collective is drawn over its box (`SimResult.sync_s`), and its legend entry.
_SYNC_HATCH, _SYNC_EDGE = "////", "#7a1f22"
_SYNC_NAME = "hatched: vocabulary output\npass (a collective of every\nrank), then the stage's own\nbackward"


def _draw_sync(ax: Any, result: SimResult, chunks: list[list[int]], most: int) -> None:
    """The collective part of each B or I of a stage with one (vocabulary parallelism's output pass, run on every
    rank before the action waits for its gradient), hatched over the start of its box: a tester read rank 0's B
    starting before rank 1's B ended as a broken dependency."""
    if not any(result.sync_s):
        return
    for rank, stages in enumerate(chunks):
        for c, stage in enumerate(stages):
            sync = result.sync_s[stage]
            spans = [(e.start_s, min(sync, e.end_s - e.start_s)) for e in result.events if sync and e.rank == rank
                     and e.action.stage == stage and e.action.kind in (Kind.B, Kind.I)]
            if spans:
                ax.broken_barh(spans, stage_lane(rank, c, most), facecolors="none", edgecolor=_SYNC_EDGE,
                               hatch=_SYNC_HATCH, linewidth=0)


#: The spaces a title is not wrapped at: between a figure and its unit (11.3 ms) and between a word and its
#: figure (bubble 22.5%), so that a wrapped line never parts them (a tester's "bubble" / "22.5%").
_GLUED = re.compile(r"(?<=\d) (?=[a-zA-Z%])|(?<=[a-z]) (?=\d)")


def _bubbles(fractions: Sequence[float]) -> str:
    """Each rank's bubble, or beyond 8 ranks the lowest and the highest with their ranks (a tester: the first 8 and
    "..." hid the worst ranks)."""
    if len(fractions) <= 8:
        return "bubble per rank: " + ", ".join(f"{b:.0%}" for b in fractions)
    low, high = (f(range(len(fractions)), key=lambda r: fractions[r]) for f in (min, max))
    return (f"bubble per rank: lowest {fractions[low]:.0%} (rank {low}), highest {fractions[high]:.0%} (rank {high}),"
            f" of {len(fractions)} ranks")


def _ways(result: SimResult) -> dict[tuple[int, int], str]:
    """Per (rank, stage) lane of two pipelines running opposite ways (`SimResult.mirror`: Chimera), "down" or "up"
    (each lane runs one of the two); {} for one pipeline. A tester could not tell the two apart."""
    if result.mirror is None:
        return {}
    return {(e.rank, e.action.stage): "down" if e.action.microbatch < result.mirror else "up" for e in result.events}


def _rank_label(rank: int, stages: Sequence[int], ways: dict[tuple[int, int], str]) -> str:
    if ways:
        return f"rank {rank}: " + ", ".join(f"stage {s} {ways.get((rank, s), '')}".rstrip() for s in stages)
    return f"rank {rank}" if len(stages) <= 1 else f"rank {rank}: stages {', '.join(map(str, stages))}"


def _ways_legend(result: SimResult) -> str:
    """What the two pipelines' microbatch numbers mean (`_ways`)."""
    assert result.mirror is not None
    last, ranks = max(e.action.microbatch for e in result.events), _num_ranks(result)
    def span(first: int, end: int) -> str:
        return str(first) if end == first else f"{first}-{end}"
    return (f"two pipelines:\nmicrobatches {span(0, result.mirror - 1)} down\n(stage 0 on rank 0),\n"
            f"{span(result.mirror, last)} up (stage 0 on rank {ranks - 1})")


def _style_timeline(ax: Any, result: SimResult, title: str, headline: str | None = None) -> None:
    """Rank labels (with their stages where a rank holds several), the legend, and the title: `title`, then
    `headline` (the caller's figures: a plan's stored prediction, a report's median; default: the drawn step's time
    and mean bubble), then each rank's bubble; wrapped, never cut off."""
    from matplotlib.patches import Patch

    ranks, chunks, ways = _num_ranks(result), _chunks(result), _ways(result)
    ax.set_yticks(range(ranks), [_rank_label(r, s, ways) for r, s in enumerate(chunks)],
                  fontsize=8 if ranks <= 32 else 6)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, max(result.step_time_s, 1e-12))
    mean = sum(result.bubble_fraction) / max(len(result.bubble_fraction), 1)
    if headline is None:
        headline = f"step {result.step_time_s:.4g} s, bubble {mean:.0%}"
    lines = [f"{title + ': ' if title else ''}{headline}", _bubbles(result.bubble_fraction)]
    ax.set_title("\n".join(w for line in lines for w in textwrap.wrap(_GLUED.sub("\u00a0", line), _TITLE_CHARS)),
                 fontsize=10)
    kinds = {e.action.kind for e in result.events} or set(KIND_COLOURS)
    handles = [Patch(color=c, label=_KIND_NAMES[k]) for k, c in KIND_COLOURS.items() if k in kinds]
    most = max(map(len, chunks), default=1)
    if any(result.sync_s):
        handles.append(Patch(facecolor=KIND_COLOURS[Kind.B], edgecolor=_SYNC_EDGE, hatch=_SYNC_HATCH, label=_SYNC_NAME))
    if any(result.overlapped_s):  # a reader saw backwards shorter than their forwards, nothing said why
        handles.append(Patch(color="none", label="a short B ran beside the F\nbefore it, each one's all-to-alls\n"
                                                 "under the other's compute"))
    if most > 1:  # what the lanes are, said once
        handles.append(Patch(color="none",
                             label="a rank's stages: one lane\neach, top to bottom as\nnamed on the left"))
    if ways:
        handles.append(Patch(color="none", label=_ways_legend(result)))
    labels = len(ax.texts)  # the microbatch numbers _labels placed
    numbers = ("numbers: microbatch" if labels == len(result.events) else
               "numbers: microbatch,\nwhere a box has room" if labels else "boxes too narrow\nfor microbatch numbers")
    handles.append(Patch(color="none", label=numbers))
    if _median_box_points(ax, result) < _BLEND_PT:  # a tester saw maroon and lavender boxes the legend did not name
        handles.append(Patch(color="none", label="boxes a few pixels wide:\ntheir colours mix; every action:\n"
                                                 "autopp show --trace (Perfetto)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=1, frameon=False)


def memory_axis_unit(peaks: Sequence[float]) -> tuple[str, float]:
    """The unit a memory axis is drawn in: that of its highest peak (`format_size`'s), so that the axis and the
    legend's peaks read alike (45.6 GiB on an axis of GiB)."""
    return size_unit(max(peaks, default=0))


def memory_steps(ax: Any, result: SimResult, what: str = "", colours: Sequence[str] | None = None,
                 unit: tuple[str, float] | None = None, ranks: Sequence[int] | None = None) -> None:
    """Each rank's memory (of `ranks`, default all; `colours` by position in them) over the step as a step curve of
    the bytes it holds, in `unit` (default `memory_axis_unit` of its peaks; the axis label says it), labelled
    `rank R{what} (peak ...)`; where the peak also counts an action's working memory (schedule.effects, TRANSIENT),
    a dotted line of the same colour marks it, the label says how much of it that is, and one legend entry says what
    the dotted lines are."""
    from matplotlib.lines import Line2D

    name, scale = unit or memory_axis_unit(result.peak_memory_bytes)
    dotted = False
    drawn = range(len(result.memory_timeline)) if ranks is None else ranks
    for i, rank in enumerate(drawn):
        timeline = result.memory_timeline[rank]
        times = [t for t, _ in timeline] + [result.step_time_s]
        held = [b / scale for _, b in timeline]
        held.append(held[-1])
        peak, top = result.peak_memory_bytes[rank], max(b for _, b in timeline)
        extra = f": held {format_size(top)} + working {format_size(peak - top)}" if peak > top else ""
        (line,) = ax.step(times, held, where="post", color=None if colours is None else colours[i % len(colours)],
                          label=f"rank {rank}{what} (peak {format_size(peak)}{extra})")
        if peak > top:
            ax.hlines(peak / scale, 0, result.step_time_s, colors=line.get_color(), linestyles="dotted")
            dotted = True
    ax.set_ylabel(f"memory ({name})")
    if dotted:  # a legend entry without data: what every dotted line means
        ax.add_line(Line2D([], [], color="black", linestyle="dotted",
                           label=f"dotted: a rank's peak{what} with one action's working memory"))


#: Ranks whose memory a plan's picture draws one curve each; beyond, only `_memory_ranks`' few.
_MEMORY_CURVES = 8


def _memory_ranks(result: SimResult) -> list[int]:
    """The ranks whose memory is drawn: every one up to `_MEMORY_CURVES`, else the highest and the lowest peak and
    the first and the last rank (a tester: 16 and more overlapping curves, offloading ones filling whole areas, hid
    all but the last drawn)."""
    n = _num_ranks(result)
    if n <= _MEMORY_CURVES:
        return list(range(n))
    peaks = result.peak_memory_bytes
    picked = [max(range(n), key=lambda r: peaks[r]), min(range(n), key=lambda r: peaks[r]), 0, n - 1]
    return sorted(set(picked))


def _draw_memory(ax: Any, result: SimResult) -> None:
    ranks = _memory_ranks(result)
    memory_steps(ax, result, colours=[f"C{i}" for i in range(len(ranks))], ranks=ranks)
    ax.set_xlabel("time (s)")
    ax.set_xlim(0, max(result.step_time_s, 1e-12))
    from matplotlib.patches import Patch

    handles, labels = ax.get_legend_handles_labels()
    if len(ranks) < _num_ranks(result):  # what is left out, said
        top, low = (f(range(_num_ranks(result)), key=lambda r: result.peak_memory_bytes[r]) for f in (max, min))
        handles.append(Patch(color="none"))
        labels.append(f"{len(ranks)} of {_num_ranks(result)} ranks drawn: the highest peak (rank {top}),\n"
                      f"the lowest (rank {low}), the first and the last;\nevery rank's peak: the plan table")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def lay_out(fig: Any, panels: Sequence[tuple[Any, SimResult, str, str | None]], span_s: float | None = None) -> None:
    """Lay `fig` out, then number each timeline panel's boxes (`_labels`) at its final width and style it
    (`_style_timeline`: its legend says whether every box is numbered), and lay it out again: numbers placed before
    the layout shrank the axes for the legends spilled out of their boxes (a tester's three-panel run picture).
    `span_s`: the shared time axis's end where the panels' steps differ (each panel's step otherwise)."""
    fig.tight_layout()
    for ax, result, title, headline in panels:
        _labels(ax, result, span_s)
        _style_timeline(ax, result, title, headline)  # again: its legend counts the numbers placed
        if span_s is not None:
            ax.set_xlim(0, span_s)
    fig.tight_layout()


def timeline_figure(result: SimResult, title: str = "", headline: str | None = None) -> Any:
    """A matplotlib Figure: one row per rank with F/I/W/B boxes numbered by microbatch, and each rank's memory
    below; the title carries `headline` (see `_style_timeline`).

    Renders with matplotlib's Agg canvas on a standalone Figure: no pyplot, no global backend change.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = 0.4 * max(_num_ranks(result), 4)  # inches: the boxes' panel, then the memory panel's 4
    fig = Figure(figsize=(16, rows + 4 + 1.5))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [rows, 4]})
    _draw_boxes(top, result)
    _style_timeline(top, result, title, headline)
    _draw_memory(bottom, result)
    lay_out(fig, [(top, result, title, headline)])
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
