"""Roofline times of counted work, and their calibration: per op FLOPs and bytes moved, split at the ridge point the
efficiencies give (`Efficiency.ridge`) into compute-bound FLOPs and memory-bound bytes, turned into seconds as
`C / (peak * e_c) + M / (bandwidth * e_m) + ops * t_op + t_call`; the fit of e_c, e_m, t_op and t_call from measured
times, and the calibration file that stores it (docs/analytic.md). Imports no torch."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..data.profile import EXPERT_PARTS, EXPERT_PASSES, expert_column
from ..errors import AutoppError
from ..jsonio import read_json, write_json

__all__ = ["CALIBRATION_VERSION", "ATTENTION_OPS", "CalibrationError", "OpCounts", "PhaseLoad", "Efficiency",
           "default_efficiency", "phase_time", "expert_seconds", "FitRow", "fit_efficiency", "UnitError", "Calibration",
           "load_calibration"]

CALIBRATION_VERSION = 1
#: The prefix of the fused attention kernels' aten names (`aten::_scaled_dot_product_flash_attention` and its CPU,
#: memory-efficient and cuDNN siblings, forward and backward): the ops `Efficiency.attention` times.
ATTENTION_OPS = "aten::_scaled_dot_product"


class CalibrationError(AutoppError):
    """A calibration file is missing, malformed, or for another device."""


@dataclass(frozen=True)
class PhaseLoad:
    """One phase's work reduced for a device: FLOPs of compute-bound ops, bytes of memory-bound ops, op count, and
    calls (1 for a phase that runs, 0 for one that does not, such as the first unit's input gradients)."""

    compute_flops: float = 0.0
    memory_bytes: float = 0.0
    ops: int = 0
    calls: int = 0

    def __add__(self, other: PhaseLoad) -> PhaseLoad:
        return PhaseLoad(self.compute_flops + other.compute_flops, self.memory_bytes + other.memory_bytes,
                         self.ops + other.ops, self.calls + other.calls)


@dataclass(frozen=True)
class OpCounts:
    """One phase's work on one unit: per aten op (views and metadata ops left out) its FLOPs (torch's
    `torch.utils.flop_counter` formulas) and the bytes of its inputs and outputs."""

    flops: tuple[int, ...] = ()
    bytes: tuple[int, ...] = ()
    linear: tuple[bool, ...] = ()
    """Per op: it is a matmul of a linear layer (`aten.mm`/`aten.addmm`, forward and both gradients; MoE experts'
    `aten._grouped_mm`), what an FP8
    recipe runs in FP8 (autopp.data.precision); () for counts made before the flag (none is)."""
    expert_weight: tuple[int, ...] = ()
    """Per op: the bytes of stacked expert weights (or their gradients) it reads or writes, part of its `bytes`: > 0
    marks a grouped GEMM of a mixture of experts (autopp.measure.counting.expert_weight_bytes); () for none."""
    names: tuple[str, ...] = ()
    """Per op: its aten name (`aten::add.Tensor`), for tables of where a phase's time goes (scripts/tp_row_ops.py);
    () for counts made without them."""

    def load(self, ridge_flops_per_byte: float, linear_speedup: float = 1.0,
             attention_slowdown: float = 1.0) -> PhaseLoad:
        """Ops whose arithmetic intensity (FLOPs / bytes) is above the ridge point count their FLOPs, the rest their
        bytes; every op counts once towards the overhead. A linear layer's matmul counts its FLOPs / `linear_speedup`
        (its peak over the phase's: 2 for FP8 matmuls beside bf16), so the phase's peak times it at its own; a fused
        attention kernel (`ATTENTION_OPS`, by its name) its FLOPs x `attention_slowdown`
        (`Efficiency.attention_slowdown`), so the compute efficiency times it at attention's own."""
        compute = memory = 0.0
        speeds = (linear_speedup if fast else 1.0 for fast in self.linear or (False,) * len(self.flops))
        slowdowns = (attention_slowdown if n.startswith(ATTENTION_OPS) else 1.0
                     for n in self.names or ("",) * len(self.flops))
        for flops, b, speed, slowdown in zip(self.flops, self.bytes, speeds, slowdowns):
            f = flops / speed * slowdown
            if f > ridge_flops_per_byte * b:
                compute += f
            else:
                memory += b
        return PhaseLoad(compute, memory, len(self.flops), 1 if self.flops else 0)

    def experts(self, linear_speedup: float = 1.0) -> tuple[float, float, float]:
        """The expert GEMMs' part (ops with `expert_weight` > 0): their FLOPs, linear ones / `linear_speedup` as
        `load` counts them, their expert-weight bytes, and their other bytes."""
        flops = weight = other = 0.0
        linear = self.linear or (False,) * len(self.flops)
        for f, b, fast, w in zip(self.flops, self.bytes, linear, self.expert_weight):
            if w > 0:
                flops, weight, other = flops + f / (linear_speedup if fast else 1.0), weight + w, other + b - w
        return flops, weight, other

    @property
    def total_flops(self) -> int:
        return sum(self.flops)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes)


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """How much of the datasheet a device reaches on counted work, and what each op costs besides."""

    compute: float
    """Fraction of peak FLOP/s reached by compute-bound ops, in (0, 1]."""
    memory: float
    """Fraction of peak memory bandwidth reached by memory-bound ops, in (0, 1]."""
    op_overhead_s: float
    """Seconds per op on top: kernel launch on a GPU, eager dispatch on a CPU."""
    call_overhead_s: float = 0.0
    """Seconds per phase that runs, on top: calling the piece, starting autograd's engine (Python time)."""
    attention: float | None = None
    """Fraction of peak FLOP/s that fused attention kernels (`ATTENTION_OPS`) reach on the work they compute (a
    causal one's blocks up to the diagonal: autopp.measure.counting.causal_computed), in (0, 1]; None: `compute`."""

    @property
    def attention_slowdown(self) -> float:
        """How much longer attention's FLOPs take than other compute-bound FLOPs: compute / attention (1: None)."""
        return 1.0 if self.attention is None else self.compute / self.attention

    def ridge(self, peak_flops: float, bandwidth: float) -> float:
        """The ridge point these efficiencies give (FLOP per byte): an op above it takes longer for its FLOPs at
        peak * e_c than for its bytes at bandwidth * e_m, so splitting ops here takes each op's slower side."""
        return peak_flops * self.compute / (bandwidth * self.memory)

    def check(self, where: str) -> None:
        """A CalibrationError naming `where` when an efficiency is outside (0, 1] or the overhead negative."""
        for name, value in (("compute", self.compute), ("memory", self.memory), ("attention", self.attention)):
            if value is None:
                continue
            if not 0.0 < value <= 1.0:
                raise CalibrationError(f"{where}: {name} efficiency {value} is outside (0, 1]; recalibrate with "
                                       "`autopp calibrate PROFILE`")
        for name, value in (("op_overhead_s", self.op_overhead_s), ("call_overhead_s", self.call_overhead_s)):
            if value < 0:
                raise CalibrationError(f"{where}: {name} {value} is negative; recalibrate")


#: Defaults by device kind, used without a calibration file. These are assumptions, not measurements: GPU dense
#: GEMMs commonly reach 60-80 % of the datasheet peak and streaming kernels ~80 % of HBM bandwidth; 5 us is the
#: order of a CUDA kernel launch plus PyTorch's eager dispatch, and the Python time of a call runs ahead of the
#: GPU's queue (0). The CPU figures are eager PyTorch's per-op dispatch (~10 us), a modest share of one core's peak,
#: and 100 us per call (the order the fits on this CPU find, docs/analytic.md). `autopp calibrate` fits them, but
#: attention's. A GPU's fused attention at 0.3 of the peak: FlashAttention-2, torch's flash SDPA kernel, reaches
#: "only 35% utilization on the H100 GPU" (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, abstract), where
#: FlashAttention-3 and cuDNN's reach about 75 % (scripts/device_check.sh measures it; no GPU has run it yet); an H100
#: figure taken for every GPU of the catalog (on an A100 FlashAttention-2 reaches 50-73 %, Dao 2023). On the
#: CPU the flash kernel is taken at the GEMMs' share (None): what it computes is counted by its blocks, measured
#: (scripts/bench_causal_attention.py).
_DEFAULTS = {"gpu": Efficiency(compute=0.6, memory=0.8, op_overhead_s=5e-6, attention=0.3),
             "cpu": Efficiency(compute=0.5, memory=0.7, op_overhead_s=1e-5, call_overhead_s=1e-4)}


def default_efficiency(device_name: str) -> Efficiency:
    """The assumed efficiencies of a catalog device: the `cpu` entry's, or a GPU's."""
    return _DEFAULTS["cpu" if device_name == "cpu" else "gpu"]


def phase_time(load: PhaseLoad, peak_flops: float, bandwidth: float, eff: Efficiency) -> float:
    """Seconds of one phase: C / (peak e_c) + M / (bandwidth e_m) + ops t_op + calls t_call."""
    return (load.compute_flops / (peak_flops * eff.compute) + load.memory_bytes / (bandwidth * eff.memory)
            + load.ops * eff.op_overhead_s + load.calls * eff.call_overhead_s)


def expert_seconds(passes: Mapping[str, OpCounts], peak_flops: float, bandwidth: float, eff: Efficiency,
                   linear_speedup: float = 1.0) -> dict[str, float]:
    """The profile's expert columns (autopp.data.profile.EXPERT_COLUMNS) of one unit's counted `passes` (by name,
    EXPERT_PASSES): per pass its expert GEMMs (`OpCounts.experts`) on the roofline, their FLOPs at peak x e_c,
    their expert weights' bytes and their other bytes at bandwidth x e_m, apart, for the cost model to re-time under
    expert parallelism (autopp.costmodel.experts)."""
    out: dict[str, float] = {}
    for phase in EXPERT_PASSES:
        flops, weight, other = passes[phase].experts(linear_speedup)
        memory = bandwidth * eff.memory
        seconds = (flops / (peak_flops * eff.compute), weight / memory, other / memory)
        out.update({expert_column(phase, part): s for part, s in zip(EXPERT_PARTS, seconds)})
    return out


@dataclass(frozen=True)
class FitRow:
    """One measured time and the work counted for it."""

    load: PhaseLoad
    measured_s: float


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns: the best unconstrained solution on every subset of the
    columns that comes out non-negative (the optimum is one of them: the KKT point's free set)."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y ** 2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            x_sub, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(n)
            x[list(cols)] = x_sub
            res = float(np.sum((a @ x - y) ** 2))
            if res < best_res - 1e-15 * max(best_res, 1e-300):
                best, best_res = x, res
    return best


def fit_efficiency(rows: Sequence[FitRow], peak_flops: float, bandwidth: float,
                   attention_slowdown: float = 1.0) -> Efficiency:
    """e_c, e_m, t_op and t_call that minimise the squared relative error of `phase_time` over `rows`, with both
    efficiencies in (0, 1] and the overheads >= 0. The time is linear in x = (1/(peak e_c), 1/(bw e_m), t_op,
    t_call); writing x = (1/peak, 1/bw, 0, 0) + z with z >= 0 makes the bounds plain non-negativity, solved exactly
    (`_nnls`) on the rows divided by their measured time. The rows' loads count attention's FLOPs x
    `attention_slowdown` (`OpCounts.load`), so the fitted e_a is e_c / it (None at 1: attention at e_c)."""
    used = [r for r in rows if r.measured_s > 0]
    if not used:
        raise CalibrationError("no measured time above 0 to fit efficiencies to")
    a = np.array([[r.load.compute_flops, r.load.memory_bytes, r.load.ops, r.load.calls] for r in used], dtype=float)
    t = np.array([r.measured_s for r in used], dtype=float)
    floor = np.array([1.0 / peak_flops, 1.0 / bandwidth, 0.0, 0.0])
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # columns of very different magnitude: solve on unit scale
    weighted = a / t[:, None]
    z = _nnls(weighted / scale, 1.0 - weighted @ floor) / scale
    x = floor + z
    compute = min(1.0, float(1.0 / (x[0] * peak_flops)))
    return Efficiency(compute=compute, memory=min(1.0, float(1.0 / (x[1] * bandwidth))), op_overhead_s=float(x[2]),
                      call_overhead_s=float(x[3]),
                      attention=None if attention_slowdown == 1.0 else compute / attention_slowdown)


@dataclass(frozen=True)
class UnitError:
    """Measured and analytic forward + backward of one unit at one microbatch size."""

    unit: int
    name: str
    microbatch_size: int
    measured_s: float
    analytic_s: float

    @property
    def error(self) -> float:
        """Relative error of the analytic time (signed: positive when it predicts slower)."""
        return self.analytic_s / self.measured_s - 1.0 if self.measured_s > 0 else 0.0


@dataclass(frozen=True)
class Calibration:
    """Fitted efficiencies of one catalog device, with where they came from and how well they fit."""

    device: str
    dtype: str
    efficiency: Efficiency
    profile: str = ""
    """The measured profile it was fitted from."""
    fingerprint: str = ""
    units: tuple[UnitError, ...] = ()
    version: int = CALIBRATION_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median_error(self) -> float:
        return statistics.median(abs(u.error) for u in self.units) if self.units else 0.0

    @property
    def worst_error(self) -> float:
        return max((abs(u.error) for u in self.units), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "device": self.device, "dtype": self.dtype,
                "compute_efficiency": self.efficiency.compute, "memory_efficiency": self.efficiency.memory,
                "op_overhead_s": self.efficiency.op_overhead_s, "call_overhead_s": self.efficiency.call_overhead_s,
                "attention_efficiency": self.efficiency.attention,
                "fitted_from": {"profile": self.profile, "fingerprint": self.fingerprint},
                "median_error": self.median_error, "worst_error": self.worst_error,
                "units": [{**asdict(u), "error": u.error} for u in self.units], "extra": self.extra}

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_json())

    def check_dtype(self, dtype: str, where: str) -> None:
        """A CalibrationError naming `where` when these efficiencies were fitted for another dtype (a device's
        float32 and bfloat16 peaks and efficiencies differ)."""
        if self.dtype != dtype:
            raise CalibrationError(f"{where}: calibrated for dtype {self.dtype}, not {dtype}; calibrate from a "
                                   f"profile measured with `dtype` {dtype}, or profile with `dtype` {self.dtype}")


def load_calibration(path: str | Path, device: str | None = None, dtype: str | None = None) -> Calibration:
    """Read a calibration file; a CalibrationError naming the file and field when it is malformed, of another
    version, or (given `device`, `dtype`) for another device or dtype."""
    data = read_json(path, "calibration file (from `autopp calibrate`)", CalibrationError,
                     "write it again with `autopp calibrate PROFILE`")
    where = str(path)
    if not isinstance(data, dict) or data.get("version") != CALIBRATION_VERSION:
        version = data.get("version") if isinstance(data, dict) else None
        raise CalibrationError(f"{where}: calibration version {version!r} is not {CALIBRATION_VERSION}; write it "
                               "again with `autopp calibrate PROFILE`")
    try:
        eff = Efficiency(compute=float(data["compute_efficiency"]), memory=float(data["memory_efficiency"]),
                         op_overhead_s=float(data["op_overhead_s"]),
                         call_overhead_s=float(data.get("call_overhead_s", 0.0)),
                         attention=None if data.get("attention_efficiency") is None
                         else float(data["attention_efficiency"]))
        source = data.get("fitted_from", {})
        units = tuple(UnitError(int(u["unit"]), str(u["name"]), int(u["microbatch_size"]), float(u["measured_s"]),
                                float(u["analytic_s"])) for u in data.get("units", []))
        cal = Calibration(device=str(data["device"]), dtype=str(data.get("dtype", "float32")), efficiency=eff,
                          profile=str(source.get("profile", "")), fingerprint=str(source.get("fingerprint", "")),
                          units=units, extra=dict(data.get("extra", {})))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CalibrationError(f"{where}: bad calibration field {exc}; write it again with `autopp calibrate "
                               "PROFILE`") from None
    eff.check(where)
    if device is not None and cal.device != device:
        raise CalibrationError(f"{where}: calibrated for device {cal.device!r}, not {device!r}; calibrate from a "
                               f"profile measured on {device}")
    if dtype is not None:
        cal.check_dtype(dtype, where)
    return cal

