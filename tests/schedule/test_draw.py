"""Pictures: the timeline PNG is written and the Chrome trace has one slice per simulated action."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib import pyplot as plt

from autopp.schedule.draw import draw_timeline, memory_steps, write_chrome_trace
from autopp.schedule import ScheduleName
from autopp.schedule.effects import StageCost
from autopp.schedule.simulate import SimResult, simulate_named


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
    assert all("+ working 3 MiB" in line.get_label() for line in ax.get_lines())
    plt.close(fig)
