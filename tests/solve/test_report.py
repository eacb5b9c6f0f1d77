"""autopp.solve.cpsat.report: CP-SAT's solves on the one progress line (issue 26), only where it is shown: the
start with the whole limit left, then each better solution, its share of the limit rising."""

from __future__ import annotations

import logging
import re

import pytest

from autopp.progress import PROGRESS_LOG
from autopp.solve.cpsat.report import solve_progress

from .test_synthesis import UNEVEN, _synth

LINE = re.compile(r"^\[[#.]{20}\] (\d+)%, about \d+ s left: CP-SAT synthesizing an order: ")


def test_no_callback_where_no_one_shows_the_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=PROGRESS_LOG):
        assert solve_progress("CP-SAT", 5.0) is None
    assert not caplog.records


def test_a_synthesis_says_its_start_and_each_better_order(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=PROGRESS_LOG):
        _synth(UNEVEN, [0, 1, 2], 4)
    said = [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOG]
    assert said[0] == "[....................] 0%, about 5 s left: CP-SAT synthesizing an order: solving for at most 5 s"
    assert len(said) >= 2 and all(LINE.match(m) for m in said)  # the warm start is CP-SAT's first solution
    assert all(re.search(r"a better solution, \d+\.\d% above the bound$", m) for m in said[1:])
    shares = [int(LINE.match(m).group(1)) for m in said]  # type: ignore[union-attr]
    assert shares == sorted(shares)
