"""Link measurement: the latency + bytes/bandwidth fit is exact on known times; two gloo ranks give a usable Link."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autopp.cluster import DEFAULT_LINK, Link
from autopp.errors import AutoppError
from autopp.links import (CalibrationRow, fit_calibration, fit_link, load_link, load_links, measure_links,
                          simulate_row)


def test_fit_recovers_latency_and_bandwidth() -> None:
    link = Link(latency_s=50e-6, bandwidth_bytes_per_s=2e9)
    sizes = [4, 65536, 1 << 20, 8 << 20]
    latency, bandwidth = fit_link(sizes, [link.transfer_s(n) for n in sizes])
    assert latency == pytest.approx(50e-6) and bandwidth == pytest.approx(2e9)


def test_fit_needs_two_sizes_and_growing_times() -> None:
    with pytest.raises(ValueError, match="2 distinct message sizes"):
        fit_link([8, 8], [1e-3, 1e-3])
    with pytest.raises(ValueError, match="do not grow"):
        fit_link([8, 1024], [2e-3, 1e-3])


def test_two_gloo_ranks_round_trip_and_calibration(tmp_path: Path) -> None:
    links = measure_links(2, message_bytes=(4, 8 << 20), warmup=3, repeats=5, timeout_s=90, calibration_steps=2)
    assert links.backend == "gloo" and links.ranks == 2 and len(links.pairs) == 1
    assert all(t > 0 for t in links.pairs[0].seconds)
    assert len(links.calibration) == 12 and links.calibration_rms is not None
    assert all(r.measured_s > 0 and r.predicted_s > 0 and min(r.forward_s + r.backward_s) > 0
               for r in links.calibration)
    assert links.overhead_s is not None and links.progress_s is not None
    path = links.save(tmp_path / "links.json")
    assert load_links(path) == links
    link = load_link(path)
    assert link.latency_s == links.latency_s and link.bandwidth_bytes_per_s > 0
    assert (link.overhead_s, link.progress_s) == (links.overhead_s, links.progress_s)


def _rows() -> list[CalibrationRow]:
    """Rows shaped like the calibration's: two action lengths, GPipe and 1F1B, 2-8 microbatches."""
    return [CalibrationRow(schedule=s, microbatches=m, layers=layers, message_bytes=32768,
                           forward_s=(f, 1.1 * f), backward_s=(2 * f, 2.2 * f), measured_s=0.0)
            for s in ("GPipe", "1F1B") for m in (2, 4, 8) for layers, f in ((2, 0.3e-3), (10, 1.7e-3))]


def test_calibration_fit_recovers_overhead_and_progress_delay() -> None:
    truth = (180e-6, 2.6e-3)
    rows = [replace(r, measured_s=simulate_row(r, 50e-6, 3e9, *truth)) for r in _rows()]
    fit = fit_calibration(rows, 50e-6, 3e9)
    assert fit.overhead_s == pytest.approx(truth[0], abs=10e-6)
    assert fit.progress_s == pytest.approx(truth[1], abs=0.1e-3)
    assert fit.rms_error < 0.01
    assert all(r.predicted_s == pytest.approx(r.measured_s, rel=0.02) for r in fit.rows)


def test_calibration_fit_without_delays_finds_none() -> None:
    rows = [replace(r, measured_s=simulate_row(r, 50e-6, 3e9, 0.0, 0.0)) for r in _rows()]
    fit = fit_calibration(rows, 50e-6, 3e9)
    assert fit.overhead_s < 5e-6 and fit.rms_error < 0.01
    with pytest.raises(ValueError, match="at least one calibration row"):
        fit_calibration([], 50e-6, 3e9)


def test_version_1_file_loads_with_the_default_overhead_and_delay(tmp_path: Path) -> None:
    (tmp_path / "v1.json").write_text(json.dumps({
        "version": 1, "backend": "gloo", "device": "cpu", "ranks": 2, "message_bytes": [4, 1024], "repeats": 3,
        "pairs": [{"src": 0, "dst": 1, "seconds": [1e-5, 2e-5], "spread_s": [0, 0], "latency_s": 1e-5,
                   "bandwidth_bytes_per_s": 1e8}], "latency_s": 1e-5, "bandwidth_bytes_per_s": 1e8}))
    link = load_link(tmp_path / "v1.json")
    assert link.latency_s == 1e-5
    assert (link.overhead_s, link.progress_s) == (DEFAULT_LINK.overhead_s, DEFAULT_LINK.progress_s)


def test_bad_links_file(tmp_path: Path) -> None:
    (tmp_path / "l.json").write_text(json.dumps({"version": 7}))
    with pytest.raises(AutoppError, match=r"l\.json: links file version 7 is not one of \[1, 2\]"):
        load_link(tmp_path / "l.json")
    (tmp_path / "m.json").write_text(json.dumps({"version": 1, "latency_s": 1e-5}))
    with pytest.raises(AutoppError, match=r"m\.json: bad links file"):
        load_link(tmp_path / "m.json")
