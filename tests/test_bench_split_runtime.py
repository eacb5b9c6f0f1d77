"""scripts/bench_split_runtime.py's table logic (issue 29, item 2): gains paired by round, the 5-point verdict,
splits with the same stages run once, the rotated order. No run starts here."""

from __future__ import annotations

import math
from types import ModuleType

import pytest

from autopp.data.profile import load_profile

from .conftest import ROOT, load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_split_runtime")


def test_gains_are_paired_by_round(bench: ModuleType) -> None:
    """Round r's baseline against round r's autopp: a load change between rounds cancels out."""
    assert bench.round_gains([2.0, 1.1, 3.0], [1.0, 1.0, 2.0]) == pytest.approx([1.0, 0.1, 0.5])


def test_verdict_needs_at_least_as_fast_and_within_five_points(bench: ModuleType) -> None:
    assert bench.verdict(0.10, 0.14) == "ok"
    assert bench.verdict(0.10, 0.16) == "off by +6.0 pts"
    assert bench.verdict(0.02, -0.01) == "slower"
    assert bench.verdict(0.16, -0.01) == "slower, off by -17.0 pts"
    assert bench.verdict(0.0, math.nan) == "no measurement"  # a failed run is never ok


def test_rounds_rotate_the_order(bench: ModuleType) -> None:
    names = ["autopp", "even", "params"]
    assert [bench.rotated(names, r) for r in range(4)] == [
        names, ["even", "params", "autopp"], ["params", "autopp", "even"], names]
    assert bench.rotated([], 3) == []


def test_table_rows_from_gpts_plans(bench: ModuleType) -> None:
    """gpt on 2 ranks: the even and the parameter-balanced split are the same stages (0-3 / 4-7), so `params`
    shares `even`'s runs; the gain column is the median of the paired gains, with their min-max."""
    plans = bench.plans_for(load_profile(ROOT / "profiles" / "gpt"), 2, 8, 1 << 30)
    splits = bench.splits_of(plans)
    assert splits["params"].same_as == "even" and splits["even"].same_as is None
    splits["autopp"].steps, splits["even"].steps = [1.0, 2.0, 1.0], [1.2, 2.2, 1.3]
    splits["autopp"].stage_ratios = [[1.0, 2.0], [1.2, 2.2], [1.1, 2.1]]
    splits["even"].stage_ratios = [[1.0, 1.0]] * 3
    splits["autopp"].resims, splits["even"].resims = [1.0, 1.0, 1.0], [1.0, 1.1, 1.05]
    rows = bench.table("gpt", 2, splits)
    assert len(rows) == 3 and all(r.count("|") == bench.HEADER[0].count("|") for r in rows)
    ours, even, params = (r.split(" | ") for r in rows)
    assert ours[2] == "autopp" and ours[8] == "1.10 / 2.10" and ours[9:12] == ["-", "-", "-"]
    predicted = plans["even"].predicted.step_time_s / plans["autopp"].predicted.step_time_s - 1
    assert even[9] == f"{100 * predicted:+.1f}%"
    assert even[10] == "+5.0%"  # the median of the paired re-simulated gains
    assert even[11] == "+20.0% (+10.0% to +30.0%)"
    assert even[12] == bench.verdict(predicted, 0.2) + " |"
    assert params[2] == "params (= even)" and params[5] == even[5] and params[10:] == even[10:]
