"""autopp.progress: the one progress line (issue 26: the bars restarted at every unit and gave no time left). The
share done weighs each walk by its microbatch size and each piece by its parameters (a count: each walk the same),
never goes back, and extrapolates the time left from the rate so far, on an injected display clock; a
time-limited solve's time left is the rest of its limit."""

from __future__ import annotations

import pytest

from autopp.progress import Overall, timed_line


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


def test_a_time_limited_solve_has_the_rest_of_its_limit_left() -> None:
    assert timed_line(2.5, 10.0, "CP-SAT") == "[#####...............] 25%, about 8 s left: CP-SAT"
    assert timed_line(12.0, 10.0, "x") == "[####################] 100%, about 1 s left: x"  # past the limit: stopping
    assert timed_line(0.0, 0.0, "x").startswith("[####################] 100%")


def test_several_walks_say_no_time_left_until_the_first_is_done() -> None:
    """A first walk's rate says little (repeats of a counted piece are nearly free): with several walks the time
    left is said once the first is done."""
    now = [0.0]
    line = Overall.counting(lambda _m: None, 4, now=lambda: now[0])
    line.next_phase()
    now[0] = 30.0
    assert line.line(0.9, "x") == "[####................] 22%: x"
    line.next_phase()
    now[0] = 40.0
    assert line.line(0.0, "x") == "[#####...............] 25%, about 2 min left: x"
