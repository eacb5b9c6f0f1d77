"""A plan's device_order binds global rank r to device (launcher process slot) device_order[r]."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from autopp.run import RunOptions, format_report, run_plan

from .conftest import LINRELU, pipeline_plan


@pytest.mark.integration
def test_device_order_puts_pipeline_rank_0_on_device_1(tmp_path: Path) -> None:
    plan = replace(pipeline_plan(LINRELU, ["2"], "1F1B"), device_order=(1, 0))
    report = run_plan(plan, RunOptions(steps=2, timeout_s=180, work_dir=tmp_path))
    assert report.passed and report.complete
    assert [(m.rank, m.pp_rank, m.device) for m in report.ranks] == [(0, 0, 1), (1, 1, 0)]
    assert "rank 0    on device 1" in format_report(report)
    # the process the launcher started on slot 1 logged pipeline rank 0's stage
    assert "[rank 0] stages [0] built on pipeline rank 0 of replica 0, on device 1" in \
        (tmp_path / "rank1.out").read_text()
