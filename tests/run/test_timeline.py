"""A report's measured step as a SimResult, drawn above a prediction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autopp.data.layout import Layout
from autopp.run import draw_report, measured_timeline
from autopp.run.report import RankMeasure, RunReport, format_report, median_step_time, step_time_unit
from autopp.run.summary import median_step_index
from autopp.run.timeline import drawn_ranks, report_figure
from autopp.schedule import Kind, ScheduleName, StageCost, simulate_named
from autopp.sizes import format_in


def _report() -> dict[str, Any]:
    def rank(r: int, replica: int, actions: list[list[Any]]) -> dict[str, Any]:
        return {"rank": r, "replica": replica, "pp_rank": r % 2, "stages": [r % 2], "step_times_s": [0.5, 0.2],
                "wait_s": 0.01, "peak_memory_bytes": 1000 + r, "actions": actions}
    return {"timeline_step": 1, "ranks": [
        rank(0, 0, [["0F0", 0.0, 0.05], ["0B0", 0.1, 0.2]]),
        rank(1, 0, [["1F0", 0.05, 0.08], ["1B0", 0.08, 0.1]]),
        rank(2, 1, [["0F0", 0.0, 0.01]]),
        rank(3, 1, []),
    ]}


def test_measured_timeline_of_replica_zero() -> None:
    result = measured_timeline(_report())
    assert result.step_time_s == 0.2 and result.peak_memory_bytes == [1000, 1001]
    assert [(e.rank, str(e.action)) for e in result.events] == [(0, "0F0"), (0, "0B0"), (1, "1F0"), (1, "1B0")]
    assert result.events[1].action.kind is Kind.B
    assert result.bubble_fraction == pytest.approx([0.25, 0.75])
    assert len(measured_timeline(_report(), replica=1).events) == 1


def test_measured_timeline_draws_one_row_per_pipeline_rank_with_tensor_parallelism() -> None:
    data = _report()
    peers = [{**r, "rank": 10 + r["rank"], "tp_rank": 1, "peak_memory_bytes": 9} for r in data["ranks"]]
    data["ranks"] = [{**r, "tp_rank": 0} for r in data["ranks"]] + peers
    result = measured_timeline(data)
    assert result.peak_memory_bytes == [1000, 1001] and len(result.bubble_fraction) == 2
    assert [(e.rank, str(e.action)) for e in result.events] == [(0, "0F0"), (0, "0B0"), (1, "1F0"), (1, "1B0")]


def _grid_report() -> dict[str, Any]:
    """pp 2 x dp 2 as autopp places it (a new user's 4-rank run): replica 0 on global ranks 0 and 2."""
    return {"timeline_step": 0, "dp": 2, "ranks": [
        {"rank": g, "replica": g % 2, "pp_rank": g // 2, "stages": [g // 2], "step_times_s": [0.2], "wait_s": 0.0,
         "peak_memory_bytes": 2**20 * (g + 1), "actions": [[f"{g // 2}F0", 0.05 * (g // 2), 0.05 * (g // 2 + 1)]]}
        for g in range(4)]}


def test_the_drawn_lanes_say_which_process_they_are_from() -> None:
    """A new user's: `autopp show` of a pp 2 x dp 2 run labelled global rank 2's peak "rank 1" (the lane's pipeline
    rank) with nothing saying so; each lane's figure now names its process where it is not the pipeline rank."""
    assert drawn_ranks(_grid_report()) == ["rank 0", "rank 1 (global rank 2)"]
    assert measured_timeline(_grid_report()).peak_memory_bytes == [2**20, 3 * 2**20]
    assert drawn_ranks(_report()) == ["rank 0", "rank 1"]


def test_incomplete_report_has_no_timeline() -> None:
    with pytest.raises(ValueError, match="no per-rank measurements"):
        measured_timeline({"ranks": []})


@pytest.mark.integration  # draws PNGs with matplotlib (~1-2 s)
def test_draw_measured_above_predicted(tmp_path: Path) -> None:
    cost = StageCost(forward_s=0.05, backward_input_s=0.03, backward_weight_s=0.02)
    predicted = simulate_named(ScheduleName.GPIPE, 2, 1, [cost, cost], [0.0])
    path = draw_report(_report(), predicted, tmp_path / "t.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    fig = report_figure(_grid_report(), predicted)
    assert "measured (replica 0 of 2): step" in fig.axes[0].get_title().replace("\u00a0", " ")
    labels = [line.get_label() for line in fig.axes[2].get_lines() if "measured peak" in line.get_label()]
    assert labels == ["rank 0 measured peak 1 MiB", "rank 1 (global rank 2) measured peak 3 MiB"]


def _three_step_report(plan_path: str | None, predicted_s: float) -> RunReport:
    """Issue 13's case: 3 steps, the first left out; the median (0.346 s) is the mean of the two timed steps, and the
    timeline draws the faster of them (step 3, 0.316 s)."""
    per_rank = [(0.5, 0.376, 0.316), (0.49, 0.37, 0.31)]
    ranks = tuple(RankMeasure(rank=r, replica=0, pp_rank=r, stages=(r,), step_times_s=times, wait_s=0.0,
                              peak_memory_bytes=(20 + 10 * r) * 2**20, predicted_peak_memory_bytes=None,
                              memory_error=None, actions=((f"{r}F0", 0.01, 0.1), (f"{r}B0", 0.12, 0.3)))
                  for r, times in enumerate(per_rank))
    steps = tuple(max(t) for t in zip(*per_rank))
    return RunReport(plan_path=plan_path, model_path="m.py", fingerprint="f", schedule="1F1B", layout=Layout(pp=2),
                     num_microbatches=4, microbatch_size=2, steps=3, lr=0.01, backend="gloo", grad_rtol=1e-4,
                     loss_rtol=1e-5, predicted_step_time_s=predicted_s, step_times_s=steps,
                     measured_step_time_s=median_step_time(steps), timeline_step=median_step_index(steps), ranks=ranks,
                     memory_method="estimate", complete=True)


def test_a_chimera_runs_timeline_says_where_its_up_pipeline_starts() -> None:
    """The measured panel of a Chimera run tells its two pipelines apart as the plan's does (`SimResult.mirror`:
    the first up microbatch, m / 2); one pipeline has none."""
    from dataclasses import replace
    report = _three_step_report(None, 0.3)
    assert measured_timeline(report).mirror is None
    assert measured_timeline(replace(report, schedule="Chimera")).mirror == 2


@pytest.mark.integration  # draws PNGs with matplotlib (~1-2 s)
def test_report_text_json_png_and_show_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 13, point 9: the report PNG's title showed the drawn step (0.316 s) where the text gave the median
    (0.346 s), and it had no memory panel. Each figure has one source: the report's."""
    from autopp.cli import main
    from autopp.data.cluster import Cluster
    from autopp.data.plan import load_plan
    from autopp.predict import simulate_plan
    from autopp.data.profile import load_profile
    from autopp.solve import PlanRequest, make_plan

    from ..conftest import ROOT
    plan = make_plan(load_profile(ROOT / "profiles" / "mlp"),
                     PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**30), global_batch=8))
    plan_path = plan.save(tmp_path / "p.json")
    report = _three_step_report(str(plan_path), plan.predicted.step_time_s)
    data = json.loads(report.save(tmp_path / "r.json").read_text())
    assert data["measured_step_time_s"] == pytest.approx(0.346) and data["timeline_step"] == 2
    text = format_report(report)
    unit = step_time_unit(data["measured_step_time_s"], data["predicted_step_time_s"], data["step_times_s"])
    measured, predicted = (format_in(data[k], unit) for k in ("measured_step_time_s", "predicted_step_time_s"))
    assert measured == "346 ms" and f"measured {measured}   predicted {predicted}" in text

    fig = report_figure(data, simulate_plan(load_plan(plan_path)))
    top, middle, memory = fig.axes[:3]
    title = top.get_title().replace("\u00a0", " ")  # a wrap never parts a figure from its unit: no-break spaces
    assert title.startswith(f"m.py: 1F1B, 4 microbatches of 2, measured: step {measured} (median of steps 2-3; drawn: "
                            "step 3 of 3, 316 ms)")  # a tester: the titles did not say what ran
    assert middle.get_title().replace("\u00a0", " ").startswith(
        f"m.py: 1F1B, 4 microbatches of 2, predicted (simulated): step {predicted} (pipeline ")
    drawn = max(r["step_times_s"][data["timeline_step"]] for r in data["ranks"])  # the measured panel's step
    predicted_s = simulate_plan(load_plan(plan_path)).step_time_s
    assert memory.get_xlim()[1] == pytest.approx(max(drawn, predicted_s))  # one axis for both, to the longer
    labels = [line.get_label() for line in memory.get_lines()]
    assert [lb for lb in labels if "measured peak" in lb] == ["rank 0 measured peak 20 MiB, estimate",
                                                              "rank 1 measured peak 30 MiB, estimate"]
    assert sum("predicted (peak" in lb for lb in labels) == 2

    assert main(["show", str(tmp_path / "r.json"), "-o", str(tmp_path / "r.png")]) == 0
    shown = capsys.readouterr().out
    assert f"(measured step {measured} (median" in shown and f"; predicted step {predicted} (pipeline " in shown
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_measured_headline_says_when_ranks_outnumbered_the_cores() -> None:
    from autopp.run.timeline import measured_headline
    data = {**_report(), "measured_step_time_s": 0.2, "step_times_s": [0.5, 0.2], "ranks_per_host": 4,
            "host_cores": 2}
    assert measured_headline(data).endswith("; 4 ranks share 2 cores, 2.0 per core: compute is serialised, which "
                                            "the prediction (a core per rank) does not model")
    assert "per core" not in measured_headline({**data, "host_cores": 4})
