"""The profile's one progress line (issue 26: the bar restarted at every unit and gave no time left): the share done
weighs each walk by its microbatch size and each piece by its parameters (the analytic count: each walk the same),
never goes back, and extrapolates the time left from the rate so far (on an injected display clock)."""

from __future__ import annotations

import re

import pytest

from autopp.measure import MeasureOptions, ProfileOptions, profile_model
from autopp.measure.analytic import analytic_profile
from autopp.measure.settings import Overall

from ..conftest import MODELS
from ..models.fakeclock import CLOCK


def test_walks_weigh_their_microbatch_sizes() -> None:
    now = [0.0]
    said: list[str] = []
    line = Overall(said.append, [1, 4], now=lambda: now[0])
    line.next_phase()
    assert line.fraction(0.0) == 0.0 and line.fraction(1.0) == pytest.approx(0.2)
    line.next_phase()
    assert line.fraction(0.5) == pytest.approx(0.6) and line.fraction(2.0) == 1.0
    now[0] = 120.0  # 60% done in 2 min: 80 s left
    line(0.5, "microbatch 4: unit 3")
    assert said == ["[############........] 60%, about 80 s left: microbatch 4: unit 3"]


def test_no_time_left_before_there_is_a_rate() -> None:
    now = [0.0]
    line = Overall(lambda _m: None, [1], now=lambda: now[0])
    line.next_phase()
    now[0] = 10.0
    assert line.line(0.001, "x") == "[....................] 0%: x"
    assert line.line(0.5, "x") == "[##########..........] 50%, about 10 s left: x"


@pytest.mark.parametrize("limit", [None, 0])  # the model's pieces in one window; one piece per window
def test_a_profile_reports_one_rising_line_to_the_end(limit: int | None) -> None:
    said: list[str] = []
    profile_model(MODELS / "ticking.py", ProfileOptions(microbatch_sizes=(1, 2)),
                  MeasureOptions(warmup=1, repeats=2, compare_whole=False, clock=CLOCK, memory_limit_bytes=limit),
                  progress=said.append)
    shares = [int(re.search(r"\] (\d+)%", m).group(1)) for m in said]  # type: ignore[union-attr]
    assert shares == sorted(shares) and shares[-1] > 50  # a line says where the step it begins starts
    assert all(m.startswith("[") for m in said) and any("microbatch 2: " in m for m in said)
    assert any(re.search(r"sizes of unit 0 of 0-\d+ \(", m) for m in said)  # units numbered as the table numbers them


def test_a_count_weighs_its_walks_evenly() -> None:
    """The analytic count's line: counting on fake tensors costs per op, so every walk (a size, or a size of a TP
    shard) weighs the same, and the time left is the rate so far over the rest."""
    now = [0.0]
    said: list[str] = []
    line = Overall.counting(said.append, 4, now=lambda: now[0])
    line.next_phase()
    line.next_phase()
    now[0] = 30.0  # a quarter and half a walk's eighth: 3/8 done in 30 s, 50 s left
    line(0.5, "microbatch 2: unit 3/5 counting")
    assert said == ["[#######.............] 38%, about 50 s left: microbatch 2: unit 3/5 counting"]
    assert Overall.counting(said.append, 0).phases == [1.0]  # nothing to count: no division by zero


def test_an_analytic_profile_reports_one_line_over_sizes_and_tp_degrees() -> None:
    """Issue 26: the counting bar restarted for each microbatch size and TP degree; now one line rises over all of
    them (2 sizes x (the model + its tp 2 shard) = 4 walks of 5 units: the shard's walks start at half)."""
    said: list[str] = []
    analytic_profile(MODELS / "tpticks.py", "h100-sxm", ProfileOptions(microbatch_sizes=(1, 2), tp_degrees=(2,)),
                     progress=said.append)
    shares = [int(re.search(r"\] (\d+)%", m).group(1)) for m in said]  # type: ignore[union-attr]
    assert len(said) == 4 * 5 and shares == sorted(shares) and shares[-1] == 95
    first_tp = next(i for i, m in enumerate(said) if "(tp 2)" in m)
    assert first_tp == 10 and shares[first_tp] == 50
    assert said[first_tp].endswith("microbatch 1 (tp 2): unit 1/5 counting")
