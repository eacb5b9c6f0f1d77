"""The roofline formula, the ridge-point split, the efficiency fit on synthetic data, and the calibration file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopp.costmodel.roofline import (Calibration, CalibrationError, Efficiency, FitRow, OpCounts, PhaseLoad,
                                       UnitError, default_efficiency, expert_seconds, fit_efficiency,
                                       load_calibration, phase_time)
from autopp.data.profile import EXPERT_COLUMNS, EXPERT_PASSES, expert_column

PEAK, BW = 100e12, 2e12  # ridge 50 FLOP/byte


def test_load_splits_ops_at_the_ridge_point() -> None:
    counts = OpCounts(flops=(1000, 10, 0), bytes=(10, 10, 40))  # intensities 100, 1, 0
    assert counts.load(50.0) == PhaseLoad(compute_flops=1000, memory_bytes=50, ops=3, calls=1)
    assert counts.load(200.0) == PhaseLoad(compute_flops=0, memory_bytes=60, ops=3, calls=1)
    assert OpCounts().load(50.0) == PhaseLoad()  # a phase that does not run costs nothing, not even a call


def test_linear_matmuls_run_at_their_own_peak() -> None:
    """An FP8 recipe's linear matmuls count FLOPs / speedup at the phase's peak (time at twice the peak); other ops
    and counts made before the flag are untouched, and an op may fall below the ridge once sped up."""
    counts = OpCounts(flops=(1000, 1000, 10), bytes=(10, 10, 10), linear=(True, False, True))
    assert counts.load(40.0, 2.0) == PhaseLoad(compute_flops=1500, memory_bytes=10, ops=3, calls=1)
    assert counts.load(40.0) == PhaseLoad(compute_flops=2000, memory_bytes=10, ops=3, calls=1)
    assert counts.load(60.0, 2.0) == PhaseLoad(compute_flops=1000, memory_bytes=20, ops=3, calls=1)
    assert OpCounts(flops=(1000,), bytes=(10,)).load(50.0, 2.0) == PhaseLoad(1000, 0, 1, 1)


def test_fused_attention_runs_at_its_own_efficiency() -> None:
    """A fused attention kernel (by its aten name) counts its FLOPs x compute / attention, so the compute efficiency
    times it at attention's own; other ops, and counts without names, are untouched."""
    names = ("aten::_scaled_dot_product_flash_attention", "aten::mm", "aten::_scaled_dot_product_efficient_attention"
             "_backward")
    counts = OpCounts(flops=(1000, 1000, 1000), bytes=(1, 1, 1), names=names)
    eff = Efficiency(compute=0.6, memory=0.8, op_overhead_s=0.0, attention=0.3)
    assert eff.attention_slowdown == 2.0
    assert counts.load(50.0, 1.0, eff.attention_slowdown) == PhaseLoad(compute_flops=5000, ops=3, calls=1)
    assert counts.load(50.0) == PhaseLoad(compute_flops=3000, ops=3, calls=1)
    assert OpCounts(flops=(1000,), bytes=(1,)).load(50.0, 1.0, 2.0) == PhaseLoad(1000, 0, 1, 1)
    assert Efficiency(compute=0.6, memory=0.8, op_overhead_s=0.0).attention_slowdown == 1.0


def test_expert_gemms_are_timed_apart_on_the_roofline() -> None:
    """Issue 30: the ops with expert-weight bytes (an expert GEMM of 1e12 FLOPs moving 4e9 weight and 1e9 other
    bytes, a linear one: at twice the peak under FP8) beside a dense op that is left out: FLOPs at peak x e_c, weight
    and other bytes at bandwidth x e_m, per pass, in the profile's columns."""
    eff = Efficiency(compute=0.5, memory=0.25, op_overhead_s=1e-6)
    ops = OpCounts(flops=(10**12, 10**9), bytes=(5 * 10**9, 10**6), linear=(True, True), expert_weight=(4 * 10**9, 0))
    assert ops.experts() == (1e12, 4e9, 1e9) and ops.experts(2.0) == (5e11, 4e9, 1e9)
    assert OpCounts(flops=(1,), bytes=(1,)).experts() == (0.0, 0.0, 0.0)  # counts without the field: none
    times = expert_seconds({phase: ops if phase == "forward" else OpCounts() for phase in EXPERT_PASSES},
                           PEAK, BW, eff, 2.0)
    assert set(times) == set(EXPERT_COLUMNS)
    assert times[expert_column("forward", "flop")] == pytest.approx(5e11 / (PEAK * 0.5))
    assert times[expert_column("forward", "weights")] == pytest.approx(4e9 / (BW * 0.25))
    assert times[expert_column("forward", "other")] == pytest.approx(1e9 / (BW * 0.25))
    assert times[expert_column("backward", "flop")] == 0.0


def test_phase_time_is_the_sum_of_the_four_terms() -> None:
    eff = Efficiency(compute=0.5, memory=0.25, op_overhead_s=1e-6, call_overhead_s=3e-4)
    load = PhaseLoad(compute_flops=1e12, memory_bytes=1e9, ops=10, calls=1)
    assert phase_time(load, PEAK, BW, eff) == pytest.approx(1e12 / 50e12 + 1e9 / 0.5e12 + 1e-5 + 3e-4, rel=1e-12)


def _rows(eff: Efficiency) -> list[FitRow]:
    loads = [PhaseLoad(1e12 * k, 3e9 * (4 - k % 4), 20 + 7 * k, k % 3 and 1) for k in range(1, 9)]
    return [FitRow(load, phase_time(load, PEAK, BW, eff)) for load in loads]


@pytest.mark.parametrize("eff", [Efficiency(compute=0.6, memory=0.8, op_overhead_s=5e-6, call_overhead_s=1e-4),
                                 Efficiency(compute=0.05, memory=0.3, op_overhead_s=0.0),
                                 Efficiency(compute=1.0, memory=1.0, op_overhead_s=2e-5, call_overhead_s=0.02)])
def test_fit_recovers_known_efficiencies(eff: Efficiency) -> None:
    fit = fit_efficiency(_rows(eff), PEAK, BW)
    assert fit.compute == pytest.approx(eff.compute, rel=1e-9)
    assert fit.memory == pytest.approx(eff.memory, rel=1e-9)
    assert fit.op_overhead_s == pytest.approx(eff.op_overhead_s, rel=1e-9, abs=1e-15)
    assert fit.call_overhead_s == pytest.approx(eff.call_overhead_s, rel=1e-9, abs=1e-15)


def test_fit_keeps_efficiencies_at_most_one() -> None:
    """Times faster than the datasheet allows cannot give an efficiency above 1: it stops at 1."""
    rows = [FitRow(r.load, r.measured_s / 3) for r in _rows(Efficiency(compute=1.0, memory=1.0, op_overhead_s=0))]
    fit = fit_efficiency(rows, PEAK, BW)
    assert fit.compute == 1.0 and fit.memory == 1.0 and fit.op_overhead_s == fit.call_overhead_s == 0.0


def test_fit_without_measurements_is_refused() -> None:
    with pytest.raises(CalibrationError, match="no measured time"):
        fit_efficiency([FitRow(PhaseLoad(1, 1, 1, 1), 0.0)], PEAK, BW)


def test_defaults_differ_by_device_kind() -> None:
    assert default_efficiency("cpu") != default_efficiency("h100-sxm")
    assert default_efficiency("h100-sxm") == default_efficiency("a100-80gb")
    # A GPU's attention at FlashAttention-2's share of an H100 (about 0.3); the CPU's at its compute efficiency.
    assert default_efficiency("h100-sxm").attention == 0.3 and default_efficiency("cpu").attention is None


def _calibration() -> Calibration:
    return Calibration(device="cpu", dtype="float32", efficiency=Efficiency(compute=0.4, memory=0.9,
                                                                            op_overhead_s=3e-6, call_overhead_s=1e-4),
                       profile="profiles/gpt", fingerprint="0123456789abcdef",
                       units=(UnitError(0, "tok_emb", 2, 1.0, 1.1), UnitError(1, "h.0", 2, 2.0, 1.0),
                              UnitError(2, "h.1", 2, 2.0, 2.1)))


def test_calibration_round_trips_with_its_errors(tmp_path: Path) -> None:
    cal = _calibration()
    cal.save(tmp_path / "cal.json")
    back = load_calibration(tmp_path / "cal.json", device="cpu")
    assert back == cal and back.efficiency.attention is None
    with_attention = Calibration(**{**cal.__dict__, "efficiency": Efficiency(**{**cal.efficiency.__dict__,
                                                                                "attention": 0.45})})
    with_attention.save(tmp_path / "att.json")
    assert load_calibration(tmp_path / "att.json").efficiency.attention == 0.45
    old = {k: v for k, v in cal.to_json().items() if k != "attention_efficiency"}  # written before the field
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_calibration(tmp_path / "old.json") == cal
    data = json.loads((tmp_path / "cal.json").read_text())
    assert data["median_error"] == pytest.approx(0.1) and data["worst_error"] == pytest.approx(0.5)
    assert data["fitted_from"] == {"profile": "profiles/gpt", "fingerprint": "0123456789abcdef"}


def test_calibration_for_another_device_is_refused(tmp_path: Path) -> None:
    _calibration().save(tmp_path / "cal.json")
    with pytest.raises(CalibrationError, match="calibrated for device 'cpu', not 'h100-sxm'"):
        load_calibration(tmp_path / "cal.json", device="h100-sxm")


@pytest.mark.parametrize("change, message", [({"version": 9}, "version 9 is not 1"),
                                             ({"compute_efficiency": 1.5}, "compute efficiency 1.5 is outside"),
                                             ({"attention_efficiency": 0}, "attention efficiency 0.0 is outside"),
                                             ({"op_overhead_s": "x"}, "bad calibration field")])
def test_damaged_calibration_is_refused(tmp_path: Path, change: dict[str, object], message: str) -> None:
    data = {**_calibration().to_json(), **change}
    (tmp_path / "cal.json").write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=message):
        load_calibration(tmp_path / "cal.json")
