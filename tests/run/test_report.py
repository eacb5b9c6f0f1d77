"""Unit tests of RunReport, its JSON and its table."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autopp.data.layout import Layout
from autopp.data.zero import ZERO
from autopp.errors import RunError
from autopp.run.report import (ParamDiff, RankMeasure, RunFailedError, RunReport, StageTimes, format_report,
                               load_report, median_step_time, relative_error)


def _report(**changes: object) -> RunReport:
    base = RunReport(plan_path="plan.json", model_path="examples/gpt.py", fingerprint="abc", schedule="1F1B",
                     layout=Layout(pp=2), num_microbatches=2, microbatch_size=2, steps=3, lr=0.01, backend="gloo",
                     grad_rtol=1e-4, loss_rtol=1e-5, predicted_step_time_s=0.1)
    return replace(base, **changes)  # type: ignore[arg-type]


def test_median_skips_the_first_step() -> None:
    assert median_step_time([5.0, 1.0, 3.0, 2.0]) == 2.0
    assert median_step_time([5.0, 1.0]) == 1.0
    assert median_step_time([4.0]) == 4.0
    assert median_step_time([]) is None


def test_relative_error() -> None:
    assert relative_error(0.15, 0.1) == pytest.approx((1.5, 0.5))
    assert relative_error(None, 0.1) == (None, None)
    assert relative_error(0.1, 0.0) == (None, None)


def test_json_round_trip_writes_inf_as_text(tmp_path: Path) -> None:
    diff = ParamDiff(name="w", stage=1, max_abs=1e-3, max_rel=float("inf"))
    report = _report(grad_diffs=(diff,), grad_max_rel_diff=float("inf"), losses=(1.0, 0.5), complete=True)
    data = json.loads(report.save(tmp_path / "sub" / "report.json").read_text())
    assert data["version"] == 1 and list(data)[0] == "version"
    assert data["grad_max_rel_diff"] == "inf" and data["grad_diffs"][0]["max_rel"] == "inf"
    assert data["losses"] == [1.0, 0.5] and data["complete"] is True and data["error"] is None


def test_format_report_shows_verdict_and_numbers() -> None:
    passed = _report(passed=True, measured_step_time_s=0.2, step_time_ratio=2.0, step_times_s=(0.3, 0.2),
                     losses=(9.1,), reference_losses=(9.1,), grad_max_rel_diff=1e-6, worst_param="h.0.w")
    text = format_report(passed)
    assert "measured 200 ms   predicted 100 ms   ratio 2.00" in text and "per step    300 200 ms" in text
    assert "worst h.0.w" in text and text.endswith("PASSED")
    assert format_report(_report(error="rank 1 failed: boom")).endswith("FAILED: rank 1 failed: boom")


def test_times_read_in_the_plans_units_and_each_stage_says_its_activation_policy() -> None:
    """Tester: the plan said 108 ms and 34 ms per microbatch, its run report 0.1388 s and 4.08e-02 s; and the
    report did not say which activation policy each stage's F and B ran under."""
    stage = StageTimes(stage=1, rank=1, forward_s=0.0408, backward_s=0.0558, input_s=None, weight_s=None,
                       predicted_forward_s=0.034, predicted_backward_s=0.0594, forward_error=0.2,
                       backward_error=-0.06, activation="recompute")
    text = format_report(_report(measured_step_time_s=0.1388, predicted_step_time_s=0.1077,
                                 step_times_s=(0.1871, 0.1525, 0.1251), stage_times=(stage,)))
    assert "step time   measured 139 ms   predicted 108 ms" in text and "per step    187 152 125 ms" in text
    assert "stage 1     F 40.8 ms (+20%)   B 55.8 ms (-6%)   vs predicted 34 ms / 59.4 ms   activations recompute" \
        in text
    long = format_report(_report(measured_step_time_s=12.0, predicted_step_time_s=9.0, step_times_s=(13.0, 12.0)))
    assert "measured 12 s   predicted 9 s" in long and "per step    13 12 s" in long  # one unit for the three


def test_the_header_says_the_microbatches_as_the_plan_does() -> None:
    """Tester: "1 x 16 microbatches" and "2 x 4 microbatches" read as counts; the plan says "1 microbatch of 16"."""
    assert ", 2 microbatches of 2, 3 steps, " in format_report(_report()).splitlines()[0]
    one = format_report(_report(num_microbatches=1, microbatch_size=16)).splitlines()[0]
    assert ", 1 microbatch of 16, 3 steps, " in one and " x 16" not in one


# Issue 26, point 10: a measuring run (`--no-validate`) must never read PASSED.
def test_a_run_that_was_not_validated_says_so_and_never_passes() -> None:
    text = format_report(_report(validated=False, losses=(2.0, 1.9), optimizer="adam"))
    assert text.endswith("NOT VALIDATED: measured only (--no-validate): no single-process reference ran")
    assert "PASSED" not in text and "max diff" not in text and "adam lr 0.01" in text.splitlines()[0]


# Issue 26, point 11: 300 steps printed 600 losses on one line.
def test_a_long_run_shows_its_first_and_last_steps() -> None:
    losses = tuple(1.0 + i / 1000 for i in range(300))
    text = format_report(_report(losses=losses, reference_losses=losses, step_times_s=(0.01,) * 300))
    line = next(t for t in text.splitlines() if "pipelined" in t)
    assert line.endswith("1.000000 1.001000 1.002000 1.003000 1.004000 1.005000 ... (291 more) ... 1.297000 1.298000 "
                         "1.299000")
    assert max(len(t) for t in text.splitlines()) < 200


def test_run_failed_error_carries_the_report() -> None:
    exc = RunFailedError("boom", _report(error="boom"))
    assert isinstance(exc, RunError) and exc.report.error == "boom" and str(exc) == "boom"


def _rank(rank: int, tp_rank: int, replica: int = 0) -> RankMeasure:
    return RankMeasure(rank=rank, replica=replica, pp_rank=0, tp_rank=tp_rank, stages=(0,), step_times_s=(0.1, 0.1),
                       wait_s=0.0, schedule_s=0.09, allreduce_s=0.0, optimizer_s=0.01, peak_memory_bytes=2**20,
                       predicted_peak_memory_bytes=2**20, memory_error=0.0, actions=())


def test_tp_ranks_and_the_zero_sync_column_are_told_apart(tmp_path: Path) -> None:
    """Issue 17 review (a), (b), (e): each rank's tp_rank is in the JSON and the text; with ZeRO the per-rank
    column after the schedule's step is not called an all-reduce (FSDP2 reduce-scatters inside the step); the
    grid is display.format_grid's."""
    layout = Layout(pp=1, dp=2, tp=2, zero=ZERO[1])  # ZeRO shards over replicas: dp 2
    report = _report(layout=layout, ranks=tuple(_rank(r, r % 2, r // 2) for r in range(4)))
    data = json.loads(report.save(tmp_path / "r.json").read_text())
    assert [r["tp_rank"] for r in data["ranks"]] == [0, 1, 0, 1]
    assert (data["num_ranks"], data["pp"], data["dp"], data["tp"], data["zero"]) == (4, 1, 2, 2, 1)
    text = format_report(report)
    assert "4 ranks = pp 1 x dp 2 x tp 2, ZeRO 1," in text
    assert "rank 1    (tp rank 1)" in text and "after step (ZeRO reduce-scatter is in step) 0 ms" in text
    assert "all-reduce" not in text
    plain = format_report(replace(report, layout=Layout(pp=1), ranks=(_rank(0, 0),)))
    assert "all-reduce 0 ms" in plain and "tp rank" not in plain
    chimera = format_report(replace(report, schedule="Chimera", layout=Layout(pp=2), ranks=(_rank(0, 0),)))
    assert "after step (the replicas' gradient sum is in step) 0 ms" in chimera  # a tester read it as the sum's time


@pytest.mark.parametrize("change, message", [
    ({"step_times_s": ["fast"]}, r"r\.json: field 'step_times_s' must be a list of finite numbers >= 0"),
    ({"ranks": {}}, r"r\.json: field 'ranks' must be a list, got dict"),
    ({"ranks": [{"rank": 0}]}, r"r\.json: ranks\[0\]: missing field 'replica'"),
    ({"ranks": [{"rank": 0, "replica": True, "pp_rank": 0, "peak_memory_bytes": 1, "step_times_s": [],
                 "actions": []}]}, r"r\.json: ranks\[0\]: field 'replica' must be an integer >= 0, got True"),
    ({"ranks": [{"rank": 0, "replica": 0, "pp_rank": 0, "peak_memory_bytes": 1, "step_times_s": [],
                 "actions": [["0F0", 0.0]]}]}, r"r\.json: ranks\[0\]: field 'actions' must be a list of \[action"),
])
def test_load_report_names_the_file_the_entry_and_the_field(tmp_path: Path, change: dict[str, object],
                                                            message: str) -> None:
    (tmp_path / "r.json").write_text(json.dumps({"version": 1, "grad_rtol": 1e-3, **change}))
    with pytest.raises(RunError, match=message + ".*: run the plan again with `autopp run PLAN`$"):
        load_report(tmp_path / "r.json")


def test_ranks_that_outnumber_the_cores_are_recorded_and_said_beside_the_ratio(tmp_path: Path) -> None:
    """Issue 29, item 3: 4 ranks on 2 cores measured 1.6-1.9x their prediction and nothing said why."""
    over = _report(measured_step_time_s=0.18, step_time_ratio=1.8, ranks_per_host=4, host_cores=2)
    line = next(x for x in format_report(over).splitlines() if "step time" in x)
    assert line.endswith("ratio 1.80   (4 ranks share 2 cores, 2.0 per core: compute is serialised, which the "
                         "prediction (a core per rank) does not model)")
    data = json.loads(over.save(tmp_path / "r.json").read_text())
    assert data["ranks_per_host"] == 4 and data["host_cores"] == 2
    assert load_report(tmp_path / "r.json")["host_cores"] == 2
    fits = _report(measured_step_time_s=0.1, step_time_ratio=1.0, ranks_per_host=2, host_cores=2)
    assert fits.oversubscribed is None and "per core" not in format_report(fits)
    assert _report(ranks_per_host=None, host_cores=None).oversubscribed is None  # NCCL: one GPU per rank


def test_a_report_with_a_bad_core_count_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**_report().to_json(), "host_cores": 0}))
    with pytest.raises(RunError, match="host_cores"):
        load_report(path)
