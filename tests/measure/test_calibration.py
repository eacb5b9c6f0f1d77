"""The calibration fit: the per-message overhead and progress delay that made known steps are found again."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.measure.calibration import CalibrationRow, fit_calibration, simulate_row
from autopp.schedule import ScheduleName


def _rows() -> list[CalibrationRow]:
    """Rows shaped like the calibration's: two action lengths, GPipe and 1F1B, 2-8 microbatches."""
    return [CalibrationRow(schedule=s, microbatches=m, layers=layers, message_bytes=32768,
                           forward_s=(f, 1.1 * f), backward_s=(2 * f, 2.2 * f), measured_s=0.0)
            for s in (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B) for m in (2, 4, 8) for layers, f in ((2, 0.3e-3), (10, 1.7e-3))]


@pytest.mark.integration  # a grid search over the simulator (~1.2 s)
def test_calibration_fit_recovers_overhead_and_progress_delay() -> None:
    truth = (180e-6, 2.6e-3)
    rows = [replace(r, measured_s=simulate_row(r, 50e-6, 3e9, *truth)) for r in _rows()]
    fit = fit_calibration(rows, 50e-6, 3e9)
    assert fit.overhead_s == pytest.approx(truth[0], abs=10e-6)
    assert fit.progress_s == pytest.approx(truth[1], abs=0.1e-3)
    assert fit.rms_error < 0.01
    assert all(r.predicted_s == pytest.approx(r.measured_s, rel=0.02) for r in fit.rows)


@pytest.mark.integration  # a second full grid search (~1 s): the unit tier keeps the fit above
def test_calibration_fit_without_delays_finds_none() -> None:
    rows = [replace(r, measured_s=simulate_row(r, 50e-6, 3e9, 0.0, 0.0)) for r in _rows()]
    fit = fit_calibration(rows, 50e-6, 3e9)
    assert fit.overhead_s < 5e-6 and fit.rms_error < 0.01
    with pytest.raises(ValueError, match="at least one calibration row"):
        fit_calibration([], 50e-6, 3e9)


def test_profile_links_names_its_calibration_schedules_as_the_json_does() -> None:
    """A tester: `profile-links` printed `ScheduleName.GPIPE` (Python 3.12 formats a str enum by its name), and the
    columns no longer lined up; the JSON says `GPipe`."""
    from autopp.measure.calibration import CalibrationRow, format_link_calibration
    from autopp.schedule import ScheduleName
    rows = [CalibrationRow(schedule=name, microbatches=4, layers=2, message_bytes=1024, forward_s=(0.001,),
                           backward_s=(0.002,), measured_s=0.012, predicted_s=0.010)
            for name in (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B)]
    lines = format_link_calibration(rows).splitlines()
    assert lines[1:] == ["GPipe     4      2     12.00     10.00   +20%",
                         "1F1B      4      2     12.00     10.00   +20%"]
    assert len({len(line) for line in lines}) == 1  # the columns line up with the header
