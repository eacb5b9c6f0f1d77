"""Link calibration runs: torch's schedules on synthetic stages give one row per config, with every stage's times."""

from __future__ import annotations

import pytest

from autopp.links import fit_calibration, simulate_row
from autopp.run.calibrate import CalibrationConfig, default_configs, run_calibration


def test_three_ranks_one_config_gives_every_stage() -> None:
    config = CalibrationConfig("1F1B", 3, 1, width=64, rows=4)
    (row,) = run_calibration(3, configs=(config,), warmup=1, steps=2, timeout_s=120)
    assert (row.schedule, row.microbatches, row.layers, row.message_bytes) == ("1F1B", 3, 1, 64 * 4 * 4)
    assert len(row.forward_s) == len(row.backward_s) == 3 and min(row.forward_s + row.backward_s) > 0
    assert row.measured_s > 0
    # a middle stage pays the overhead on both sides: more overhead can only slow the simulated step
    assert simulate_row(row, 1e-5, 1e9, 1e-3, 0.0) > simulate_row(row, 1e-5, 1e9, 0.0, 0.0)
    assert fit_calibration([row], 1e-5, 1e9).rows[0].predicted_s > 0


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_default_configs_cover_both_schedules_with_enough_microbatches(ranks: int) -> None:
    configs = default_configs(ranks)
    assert {c.schedule for c in configs} == {"GPipe", "1F1B"} and len({c.layers for c in configs}) == 2
    assert {c.microbatches for c in configs} == {ranks, 2 * ranks, 4 * ranks}


@pytest.mark.parametrize(("ranks", "steps", "message"), [(1, 2, "at least 2 ranks"), (2, 0, "steps >= 1"),
                                                         (3, 2, "1F1B needs at least 3 microbatches on 3 ranks")])
def test_bad_arguments(ranks: int, steps: int, message: str) -> None:
    configs = (CalibrationConfig("1F1B", 2, 1),)
    with pytest.raises(ValueError, match=message):
        run_calibration(ranks, configs=configs, steps=steps)
