"""Pictures: the timeline PNG is written and readable at real size (checked on the figure's matplotlib objects, not
pixels), and the Chrome trace has one slice per simulated action."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib import pyplot as plt

import pytest

from autopp.schedule.draw import draw_timeline, memory_steps, stage_lane, timeline_figure, write_chrome_trace
from autopp.schedule import ScheduleName
from autopp.schedule.effects import StageCost
from autopp.schedule.simulate import SimResult, simulate_named
from autopp.sizes import format_size


def _result() -> SimResult:
    costs = [StageCost(forward_s=1e-3, backward_input_s=1e-3, backward_weight_s=5e-4, static_bytes=2**20,
                       activation_bytes=2**18, input_bytes=2**10)] * 4
    return simulate_named(ScheduleName.ZBV_ZERO_BUBBLE, 2, 4, costs, [1e-4] * 3)


def test_draw_timeline_writes_png(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    draw_timeline(_result(), path, title="ZBV")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chrome_trace_events(tmp_path: Path) -> None:
    result = _result()
    path = tmp_path / "trace.json"
    write_chrome_trace(result, path)
    events = json.loads(path.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(result.events)
    first = min(slices, key=lambda e: (e["pid"], e["ts"]))
    assert first["name"] == "0F0" and first["pid"] == 0 and first["ts"] == 0.0
    assert first["dur"] == 1e-3 * 1e6
    assert {e["pid"] for e in slices} == {0, 1}
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"rank 0", "rank 1"}


def test_memory_curve_reaches_the_peak_with_working_memory() -> None:
    costs = [StageCost(forward_s=1e-3, backward_input_s=1e-3, backward_weight_s=5e-4, static_bytes=2**20,
                       activation_bytes=2**18, input_bytes=2**10, transient_bytes=3 * 2**20)] * 4
    result = simulate_named(ScheduleName.ZBV_ZERO_BUBBLE, 2, 4, costs, [1e-4] * 3)
    fig, ax = plt.subplots()
    memory_steps(ax, result)
    held_top = max(max(b for _, b in t) for t in result.memory_timeline)
    assert max(result.peak_memory_bytes) == held_top + 3 * 2**20  # the peak counts one action's working memory
    drawn = [y for c in ax.collections for seg in c.get_segments() for _, y in seg]
    assert max(drawn) == max(result.peak_memory_bytes) / 2**20  # ... and the figure reaches it
    labels = [line.get_label() for line in ax.get_lines()]
    assert all("+ working 3 MiB" in lb for lb in labels[:-1]) and len(labels) == 3
    assert labels[-1] == "dotted: a rank's peak with one action's working memory"  # issue 26: the lines say what
    assert ax.get_ylabel() == "memory (MiB)"
    plt.close(fig)


def _big(name: ScheduleName, ranks: int, microbatches: int, v: int = 1) -> SimResult:
    """A step at real size: 1 s forwards of a 40 GiB-class stage, 2 GiB of activation per microbatch."""
    stages = ranks * v
    costs = [StageCost(forward_s=1.0 / v, backward_input_s=1.0 / v, backward_weight_s=1.0 / v,
                       static_bytes=20 * 2**30, activation_bytes=2**30, input_bytes=2**20,
                       transient_bytes=2**30)] * stages
    return simulate_named(name, ranks, microbatches, costs, [1e-3] * (stages - 1), v=v)


def _boxes_panel(result: SimResult, title: str = "model.py: a title as long as a plan's " * 5) -> tuple[Any, Any]:
    fig = timeline_figure(result, title=title)
    fig.canvas.draw()
    return fig, fig.axes[0]


def test_title_is_wrapped_inside_the_figure() -> None:
    """Issue 26: at 32 microbatches the title was cut off at both sides."""
    fig, top = _boxes_panel(_big(ScheduleName.ONE_F_ONE_B, 8, 32))
    box, width = top.title.get_window_extent(), fig.bbox.width
    assert 0 <= box.x0 and box.x1 <= width and "\n" in top.get_title()
    assert top.get_title().splitlines()[-1].startswith("bubble per rank: ")


def test_a_wrapped_title_keeps_figures_with_their_names_and_units() -> None:
    """A tester: "bubble⏎22.5%" and "optimizer 11.3⏎ms" at a wrap; and beyond 8 ranks the bubbles of ranks 0-7 and
    "...", hiding the worst ranks."""
    from autopp.schedule.draw import _GLUED, _bubbles
    text = _GLUED.sub("\u00a0", "step 49 s (pipeline 49 s + optimizer 11.3 ms), bubble 22.5%, pp 16 x dp 4")
    assert text == ("step\u00a049\u00a0s (pipeline\u00a049\u00a0s + optimizer\u00a011.3\u00a0ms), bubble\u00a022.5%, "
                    "pp\u00a016\u00a0x dp\u00a04")
    assert _bubbles([0.1, 0.2]) == "bubble per rank: 10%, 20%"
    many = [0.04] * 16
    many[15], many[3] = 0.29, 0.01
    assert _bubbles(many) == "bubble per rank: lowest 1% (rank 3), highest 29% (rank 15), of 16 ranks"


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_microbatch_numbers_stay_inside_their_boxes() -> None:
    """Issue 26: numbers overlapped into noise; now a box too narrow for the longest number carries none, and each
    number drawn lies inside its own box."""
    for ranks, m in ((8, 32), (16, 128)):
        result = _big(ScheduleName.ONE_F_ONE_B, ranks, m)
        fig, top = _boxes_panel(result)
        to_px = top.transData.transform
        centres = {(round((e.start_s + e.end_s) / 2, 9), e.rank): e for e in result.events}
        for t in top.texts:
            x, y = t.get_position()
            e = centres[(round(x, 9), round(y))]
            text = t.get_window_extent()
            assert to_px((e.start_s, 0))[0] <= text.x0 and text.x1 <= to_px((e.end_s, 0))[0], t.get_text()
        legend = [x.get_text() for x in top.get_legend().get_texts()]
        if top.texts:
            assert ranks == 8 and "numbers: microbatch,\nwhere a box has room" in legend
        else:
            assert "boxes too narrow\nfor microbatch numbers" in legend


def test_v_placed_stages_are_told_apart() -> None:
    """Issue 26: nothing showed which of a rank's two V-placed stages a box belongs to."""
    result = _big(ScheduleName.ZBV_ZERO_BUBBLE, 8, 32, v=2)
    fig, top = _boxes_panel(result)
    assert [t.get_text() for t in top.get_yticklabels()][:2] == ["rank 0: stages 0, 15", "rank 1: stages 1, 14"]
    lanes: dict[tuple[int, int], set[float]] = {}  # (rank, stage) -> the bottoms of its boxes
    for kind_boxes in top.collections:
        for path in kind_boxes.get_paths():
            x0, y0 = path.vertices.min(axis=0)
            e = next(e for e in result.events if abs(e.start_s - x0) < 1e-9 and abs(e.rank - 0.4 - y0) < 0.41)
            lanes.setdefault((e.rank, e.action.stage), set()).add(round(float(y0), 9))
    assert lanes[(0, 0)] == {-0.4} and lanes[(0, 15)] == {0.0}  # rank 0: stage 0 in the top lane, 15 below it
    assert all(len(bottoms) == 1 for bottoms in lanes.values())  # each stage keeps to its lane
    legend = [x.get_text() for x in top.get_legend().get_texts()]
    assert "a rank's stages: one lane\neach, top to bottom as\nnamed on the left" in legend


def test_chimeras_two_pipelines_are_told_apart() -> None:
    """A tester: Chimera's picture numbered both pipelines' microbatches with nothing to say which way each runs.
    Each lane is one pipeline's (its microbatches all below or all from `mirror`), its rank label says which, and
    the legend says which microbatches run down and which up."""
    result = _big(ScheduleName.CHIMERA, 4, 8)
    assert result.mirror == 4
    fig, top = _boxes_panel(result)
    labels = [t.get_text() for t in top.get_yticklabels()]
    assert labels == ["rank 0: stage 0 down, stage 3 up", "rank 1: stage 1 down, stage 2 up",
                      "rank 2: stage 1 up, stage 2 down", "rank 3: stage 0 up, stage 3 down"]
    for rank, stage, way in [(0, 0, "down"), (0, 3, "up"), (2, 1, "up"), (3, 3, "down")]:
        mbs = {e.action.microbatch for e in result.events if e.rank == rank and e.action.stage == stage}
        assert mbs == (set(range(4)) if way == "down" else set(range(4, 8)))
    legend = [x.get_text() for x in top.get_legend().get_texts()]
    assert "two pipelines:\nmicrobatches 0-3 down\n(stage 0 on rank 0),\n4-7 up (stage 0 on rank 3)" in legend
    two = _boxes_panel(_big(ScheduleName.CHIMERA, 2, 2))[1]  # one microbatch each way: "0", not "0-0"
    assert "two pipelines:\nmicrobatches 0 down\n(stage 0 on rank 0),\n1 up (stage 0 on rank 1)" in [
        x.get_text() for x in two.get_legend().get_texts()]
    one = _boxes_panel(_big(ScheduleName.ONE_F_ONE_B, 4, 8))[1]
    assert _big(ScheduleName.ONE_F_ONE_B, 4, 8).mirror is None
    assert not any("two pipelines" in x.get_text() for x in one.get_legend().get_texts())
    plt.close("all")


def test_stage_lanes_split_the_row() -> None:
    """A rank's row (0.8 high, centred on the rank) split into one lane per stage, the first on top."""
    assert stage_lane(3, 0, 1) == (2.6, 0.8)
    assert stage_lane(3, 0, 2) == (2.6, 0.4) and stage_lane(3, 1, 2) == (3.0, 0.4)
    bottoms = [stage_lane(0, c, 4)[0] for c in range(4)]
    assert bottoms == sorted(bottoms) and abs(bottoms[-1] + stage_lane(0, 3, 4)[1] - 0.4) < 1e-12


def test_memory_axis_in_the_legends_unit() -> None:
    """Issue 26: the axis was in MiB (10000-70000) while the legend said GiB."""
    result = _big(ScheduleName.ONE_F_ONE_B, 8, 32)
    fig, _ = _boxes_panel(result)
    memory = fig.axes[1]
    assert memory.get_ylabel() == "memory (GiB)"
    peak = max(result.peak_memory_bytes)
    drawn = [y for c in memory.collections for seg in c.get_segments() for _, y in seg]
    assert max(drawn) == peak / 2**30 and f"(peak {format_size(peak)}:" in " ".join(
        t.get_text() for t in memory.get_legend().get_texts())


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_many_ranks_draw_a_few_memory_curves_and_say_which() -> None:
    """A tester: from 16 ranks the memory panel was solid areas of overlapping curves (offloading ranks switching
    fast), with ranks 13-15 drawn over the rest; now 4 ranks are drawn, each named, and the legend says which."""
    result = _big(ScheduleName.ONE_F_ONE_B, 32, 32)
    fig, top = _boxes_panel(result)
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    peaks = result.peak_memory_bytes
    high, low = max(range(32), key=lambda r: peaks[r]), min(range(32), key=lambda r: peaks[r])
    drawn = sorted({0, 31, high, low})
    assert [lb.split(" (")[0] for lb in legend if lb.startswith("rank ")] == [f"rank {r}" for r in drawn]
    assert len(fig.axes[1].get_lines()) <= 2 * len(drawn) + 1  # a curve and a dotted peak each, one legend line
    assert legend[-1] == (f"{len(drawn)} of 32 ranks drawn: the highest peak (rank {high}),\nthe lowest (rank {low}), "
                          "the first and the last;\nevery rank's peak: the plan table")


def test_a_vocabulary_output_pass_is_hatched_at_the_start_of_its_backward() -> None:
    """A tester read rank 0's B starting before rank 1's B ended as a broken dependency: the first part of each B of
    a vocabulary-parallel stage is the output pass every rank joins (`StageCost.sync_s`), drawn hatched now."""
    costs = [StageCost(forward_s=1e-3, backward_input_s=2e-3, backward_weight_s=1e-3, backward_s=3e-3, sync_s=1e-3,
                       static_bytes=2**20, activation_bytes=2**18, input_bytes=2**10)] * 2
    result = simulate_named(ScheduleName.ONE_F_ONE_B, 2, 2, costs, [1e-4])
    assert result.sync_s == (1e-3, 1e-3)
    fig, top = _boxes_panel(result)
    hatched = [c for c in top.collections if c.get_hatch()]
    assert len(hatched) == 2  # one broken bar per rank's stage, each over its 2 backwards
    starts = sorted(e.start_s for e in result.events if e.action.kind.value == "B")
    drawn = sorted(v[0][0] for c in hatched for v in (p.vertices for p in c.get_paths()))
    assert drawn == pytest.approx(starts)
    assert any("vocabulary output" in t.get_text() for t in top.get_legend().get_texts())
    plain = _boxes_panel(_result())[1]
    assert not [c for c in plain.collections if c.get_hatch()]
    assert not any("vocabulary" in t.get_text() for t in plain.get_legend().get_texts())


@pytest.mark.integration  # draws 4,000 boxes (~2 s)
def test_boxes_under_a_pixel_say_their_colours_mix() -> None:
    """A tester: at 256-512 microbatches F and B boxes blended into maroon, purple and lavender that the legend did
    not name; the legend now says so and where every action can be seen."""
    def said(result: SimResult) -> bool:
        fig, top = _boxes_panel(result)
        texts = [t.get_text() for t in top.get_legend().get_texts()]
        plt.close(fig)
        return any(t.startswith("boxes a few pixels wide") for t in texts)
    assert said(_big(ScheduleName.ONE_F_ONE_B, 4, 512)) and not said(_big(ScheduleName.ONE_F_ONE_B, 4, 16))


def test_overlapped_pairs_say_why_their_backwards_are_short() -> None:
    """A reader of an `ep_a2a` plan's picture saw backwards shorter than their forwards and nothing said why: where
    the step overlapped pairs (`SimResult.overlapped_s`), the legend says so; where it did not, nothing."""
    from autopp.schedule import Pairing, build_schedule, simulate, stage_to_rank
    name, p, m, v = ScheduleName.INTERLEAVED_1F1B, 2, 8, 2
    costs = [StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0, backward_s=2.0,
                       forward_comm_s=0.4, backward_comm_s=0.4, activation_bytes=2**20)] * (p * v)
    order, owner = build_schedule(name, p, m, v), stage_to_rank(name, p, v)
    said = "a short B ran beside the F\nbefore it, each one's all-to-alls\nunder the other's compute"
    for pairing, shown in ((Pairing.MICROBATCHES, True), (None, False)):
        result = simulate(order, costs, owner, [0.0] * (p * v - 1), pairing=pairing)
        assert any(result.overlapped_s) is shown
        _, top = _boxes_panel(result)
        assert (said in [t.get_text() for t in top.get_legend().get_texts()]) is shown
