"""Fit the costs a pipeline's messages add on a CPU host, beyond latency and bandwidth: the per-message overhead that
keeps a rank busy and gloo's progress delay (docs/accuracy.md). Runs of torch's schedules on synthetic stages
(autopp.run.calibrate) give the rows; `fit_calibration` finds the overhead and progress delay with which the
simulator, fed those runs' own F and B, reproduces their measured steps."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..data.cluster import Cluster, Link
from ..costmodel import message_overheads, progress_delays, transfer_time
from ..schedule import ScheduleName, StageCost, simulate_named

__all__ = ["CalibrationRow", "CalibrationFit", "simulate_row", "fit_calibration", "format_link_calibration"]


@dataclass(frozen=True)
class CalibrationRow:
    """What one synthetic pipeline measured (medians over the timed steps) and what the fitted link predicts."""

    schedule: ScheduleName
    microbatches: int
    layers: int
    message_bytes: int
    forward_s: tuple[float, ...]
    """Per stage, the median forward action."""
    backward_s: tuple[float, ...]
    """Per stage, the median backward action."""
    measured_s: float
    """Median step (barrier to barrier, slowest rank)."""
    predicted_s: float = 0.0
    """The simulator's step with the run's F and B and the fitted link (filled by fit_calibration)."""


@dataclass(frozen=True)
class CalibrationFit:
    """The link costs `fit_calibration` found, and the rows with their predictions under them."""

    overhead_s: float
    progress_s: float
    rms_error: float
    """Root mean square of (measured - predicted) / predicted over the rows."""
    rows: tuple[CalibrationRow, ...]


def simulate_row(row: CalibrationRow, latency_s: float, bandwidth_bytes_per_s: float, overhead_s: float,
                 progress_s: float) -> float:
    """The simulator's step time of `row`'s pipeline with its own F and B and this link."""
    n = len(row.forward_s)
    link = Link(latency_s=latency_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s, overhead_s=overhead_s,
                progress_s=progress_s)
    owner = list(range(n))
    cluster = Cluster(num_devices=n, memory_bytes=1, link=link)
    costs = [StageCost(forward_s=f, backward_input_s=b / 2, backward_weight_s=b / 2, backward_s=b, overhead_s=o)
             for f, b, o in zip(row.forward_s, row.backward_s, message_overheads(cluster, owner))]
    comm = [transfer_time(link, row.message_bytes)] * (n - 1)
    return simulate_named(row.schedule, n, row.microbatches, costs, comm,
                          progress_s=progress_delays(cluster, owner)).step_time_s


def _sse(rows: Sequence[CalibrationRow], latency_s: float, bandwidth: float, o: float, d: float) -> float:
    total = 0.0
    for row in rows:
        predicted = simulate_row(row, latency_s, bandwidth, o, d)
        total += ((row.measured_s - predicted) / predicted) ** 2
    return total


def fit_calibration(rows: Sequence[CalibrationRow], latency_s: float, bandwidth_bytes_per_s: float,
                    max_overhead_s: float = 2e-3, max_progress_s: float = 10e-3) -> CalibrationFit:
    """The overhead and progress delay (within [0, max]) that minimise the squared relative step-time error of
    `rows`, with the link's latency and bandwidth fixed: an 11 x 11 grid, then twice an 11 x 11 grid of a fifth of
    the spacing around the best point."""
    if not rows:
        raise ValueError("need at least one calibration row to fit")
    step_o, step_d = max_overhead_s / 10, max_progress_s / 10
    best = (0.0, 0.0)
    centre = (max_overhead_s / 2, max_progress_s / 2)
    for _ in range(3):
        grid = [(min(max(centre[0] + i * step_o, 0.0), max_overhead_s), min(max(centre[1] + j * step_d, 0.0),
                                                                            max_progress_s))
                for i in range(-5, 6) for j in range(-5, 6)]
        best = min(sorted(set(grid)), key=lambda p: _sse(rows, latency_s, bandwidth_bytes_per_s, *p))
        centre, step_o, step_d = best, step_o / 5, step_d / 5
    o, d = best
    fitted = tuple(replace(r, predicted_s=simulate_row(r, latency_s, bandwidth_bytes_per_s, o, d)) for r in rows)
    rms = (sum(((r.measured_s - r.predicted_s) / r.predicted_s) ** 2 for r in fitted) / len(fitted)) ** 0.5
    return CalibrationFit(overhead_s=o, progress_s=d, rms_error=rms, rows=fitted)


def format_link_calibration(rows: Sequence[CalibrationRow]) -> str:
    """The calibration rows as `autopp profile-links` prints them: one per synthetic pipeline, its schedule by its
    name (`GPipe`, as the links JSON writes it), step times in ms."""
    lines = [f"{'schedule':<8} {'m':>2} {'layers':>6} {'measured':>9} {'predicted':>9} {'error':>6}"]
    lines += [f"{r.schedule.value:<8} {r.microbatches:>2} {r.layers:>6} {r.measured_s * 1e3:>9.2f} "
              f"{r.predicted_s * 1e3:>9.2f} {(r.measured_s - r.predicted_s) / r.predicted_s:>+6.0%}" for r in rows]
    return "\n".join(lines)
