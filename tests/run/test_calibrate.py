"""Link calibration runs: torch's schedules on synthetic stages give one row per config, with every stage's times,
and a measured link gets its overhead and progress delay fitted to them."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.measure.calibration import fit_calibration, simulate_row
from autopp.measure.links import LinkProfile, PairFit, load_link, load_links
from autopp.run.calibrate import CalibrationConfig, calibrate_links, default_configs, run_calibration
from autopp.schedule import ScheduleName


@pytest.mark.integration
def test_three_ranks_one_config_gives_every_stage() -> None:
    config = CalibrationConfig(ScheduleName.ONE_F_ONE_B, 3, 1, width=64, rows=4)
    (row,) = run_calibration(3, configs=(config,), warmup=1, steps=2, timeout_s=120)
    assert (row.schedule, row.microbatches, row.layers, row.message_bytes) == (ScheduleName.ONE_F_ONE_B, 3, 1,
                                                                               64 * 4 * 4)
    assert len(row.forward_s) == len(row.backward_s) == 3 and min(row.forward_s + row.backward_s) > 0
    assert row.measured_s > 0
    # a middle stage pays the overhead on both sides: more overhead can only slow the simulated step
    assert simulate_row(row, 1e-5, 1e9, 1e-3, 0.0) > simulate_row(row, 1e-5, 1e9, 0.0, 0.0)
    assert fit_calibration([row], 1e-5, 1e9).rows[0].predicted_s > 0


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_default_configs_cover_both_schedules_with_enough_microbatches(ranks: int) -> None:
    configs = default_configs(ranks)
    assert {c.schedule for c in configs} == {ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B}
    assert len({c.layers for c in configs}) == 2
    assert {c.microbatches for c in configs} == {ranks, 2 * ranks, 4 * ranks}


@pytest.mark.parametrize(("ranks", "steps", "message"), [(1, 2, "at least 2 ranks"), (2, 0, "steps >= 1"),
                                                         (3, 2, r"1F1B needs microbatches >= stages \(2 < 3\)")])
def test_bad_arguments(ranks: int, steps: int, message: str) -> None:
    configs = (CalibrationConfig(ScheduleName.ONE_F_ONE_B, 2, 1),)
    with pytest.raises(ValueError, match=message):
        run_calibration(ranks, configs=configs, steps=steps)


def _measured(backend: str) -> LinkProfile:
    """A link as measure_links leaves it (uncalibrated), with made-up ping-pong figures."""
    pair = PairFit(0, 1, (3e-5, 4e-3), (1e-6, 1e-4), 3e-5, 2e9)
    return LinkProfile(backend=backend, device="cpu", ranks=2, message_bytes=(4, 8 << 20), repeats=5, pairs=(pair,),
                       latency_s=3e-5, bandwidth_bytes_per_s=2e9)


@pytest.mark.integration
def test_calibrate_links_fits_overhead_and_progress_delay(tmp_path: Path) -> None:
    links = calibrate_links(_measured("gloo"), steps=2, timeout_s=90)
    assert (links.latency_s, links.bandwidth_bytes_per_s) == (3e-5, 2e9)  # the ping-pong fit is kept
    assert len(links.calibration) == 12 and links.calibration_rms is not None
    assert all(r.measured_s > 0 and r.predicted_s > 0 and min(r.forward_s + r.backward_s) > 0
               for r in links.calibration)
    assert links.overhead_s is not None and links.progress_s is not None
    path = links.save(tmp_path / "links.json")
    assert load_links(path) == links
    assert (load_link(path).overhead_s, load_link(path).progress_s) == (links.overhead_s, links.progress_s)


def test_calibrate_links_leaves_an_nccl_link_alone() -> None:
    links = _measured("nccl")
    assert calibrate_links(links) is links
