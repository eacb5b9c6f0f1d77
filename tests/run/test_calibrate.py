"""Link calibration runs: torch's schedules on synthetic stages give one row per config, with every stage's times."""

from __future__ import annotations

import pytest

from autopp.links import fit_calibration, simulate_row
from autopp.run.calibrate import DEFAULT_CONFIGS, CalibrationConfig, run_calibration


def test_three_ranks_one_config_gives_every_stage() -> None:
    config = CalibrationConfig("1F1B", 3, 1, width=64, rows=4)
    (row,) = run_calibration(3, configs=(config,), warmup=1, steps=2, timeout_s=120)
    assert (row.schedule, row.microbatches, row.layers, row.message_bytes) == ("1F1B", 3, 1, 64 * 4 * 4)
    assert len(row.forward_s) == len(row.backward_s) == 3 and min(row.forward_s + row.backward_s) > 0
    assert row.measured_s > 0
    # a middle stage pays the overhead on both sides: more overhead can only slow the simulated step
    assert simulate_row(row, 1e-5, 1e9, 1e-3, 0.0) > simulate_row(row, 1e-5, 1e9, 0.0, 0.0)
    assert fit_calibration([row], 1e-5, 1e9).rows[0].predicted_s > 0


def test_default_configs_cover_both_schedules_and_microbatch_counts() -> None:
    assert {c.schedule for c in DEFAULT_CONFIGS} == {"GPipe", "1F1B"}
    assert {c.microbatches for c in DEFAULT_CONFIGS} == {2, 4, 8} and len({c.layers for c in DEFAULT_CONFIGS}) == 2


@pytest.mark.parametrize(("ranks", "steps", "message"), [(1, 2, "at least 2 ranks"), (2, 0, "steps >= 1")])
def test_bad_arguments(ranks: int, steps: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_calibration(ranks, steps=steps)
