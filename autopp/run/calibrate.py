"""Run torch's GPipe and 1F1B on synthetic stages, one per local CPU rank, to calibrate the link between them.

Each config is a stack of Linear layers per stage (two sizes) and 2-8 microbatches; every step and every F and B
is recorded the way `autopp run` records them. autopp.measure.calibration.fit_calibration then fits the link's
per-message overhead and progress delay to these rows; `calibrate_links` does both for a measured link.

It lives in run/ rather than measure/ because it runs pipelines: torch's schedules through this package's stage
recorder (run.instrument) and schedule table (run.pipeline), which the measuring side must not import.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from ..measure.allocator import keep_freed_memory
from ..measure.calibration import CalibrationRow, fit_calibration
from ..measure.links import LinkProfile
from ..errors import ScheduleError
from ..schedule import ScheduleName, describe, parse_action
from ..spawn import spawn_local
from .instrument import StepRecorder
from .pipeline import torch_schedule_class

__all__ = ["CalibrationConfig", "default_configs", "run_calibration", "calibrate_links"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationConfig:
    """One synthetic pipeline: `layers` Linear(width, width) per stage, microbatches of `rows` rows."""

    schedule: ScheduleName
    microbatches: int
    layers: int
    width: int = 512
    rows: int = 16


def default_configs(ranks: int) -> tuple[CalibrationConfig, ...]:
    """Two action lengths (about 0.3 and 1.7 ms of forward on the 2-core development machine) x GPipe and 1F1B x
    `ranks`, 2 x `ranks` and 4 x `ranks` microbatches (1F1B needs at least one per stage)."""
    return tuple(CalibrationConfig(s, m * ranks, layers) for s in (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B)
                 for m in (1, 2, 4)
                 for layers in (2, 10))


def _mse(output: Any, target: Any) -> Any:
    return ((output - target) ** 2).mean()


def _pipeline_times(rank: int, world: int, config: CalibrationConfig, warmup: int, steps: int
                    ) -> tuple[list[float], dict[str, list[float]]]:
    """Run `config` on this rank's stage: per timed step its time, and the durations of its F and B actions."""
    torch.manual_seed(rank)
    module = torch.nn.Sequential(*[torch.nn.Linear(config.width, config.width) for _ in range(config.layers)])
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    cls = torch_schedule_class(config.schedule)
    schedule = cls(stage, config.microbatches, loss_fn=_mse)
    recorder = StepRecorder()
    recorder.wrap_stages([stage])
    batch = torch.randn(config.microbatches * config.rows, config.width)
    step_times: list[float] = []
    actions: dict[str, list[float]] = {"F": [], "B": []}
    for step in range(warmup + steps):
        dist.barrier()
        recorder.start()
        if rank == 0:
            schedule.step(batch)
        elif rank == world - 1:
            schedule.step(target=torch.zeros_like(batch), losses=[])
        else:
            schedule.step()
        dist.barrier()
        took = recorder.now()
        module.zero_grad(set_to_none=True)
        if step >= warmup:
            step_times.append(took)
            for a in recorder.actions:
                actions[parse_action(a.action).kind.value].append(a.end_s - a.start_s)
    return step_times, actions


def _worker(rank: int, world: int, port: int, configs: Sequence[CalibrationConfig], warmup: int, steps: int,
            queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        keep_freed_memory()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        try:
            queue.put((rank, [_pipeline_times(rank, world, c, warmup, steps) for c in configs], None))
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # reported to the parent, which raises
        queue.put((rank, [], f"{type(exc).__name__}: {exc}"))


def run_calibration(ranks: int, configs: Sequence[CalibrationConfig] | None = None, warmup: int = 2,
                    steps: int = 20, timeout_s: float = 300.0) -> list[CalibrationRow]:
    """Run every config (default: `default_configs(ranks)`) on `ranks` local CPU processes (gloo, one thread each,
    one stage each) and return the measured rows, unfitted (autopp.measure.calibration.fit_calibration fits them)."""
    if ranks < 2:
        raise ValueError(f"need at least 2 ranks to calibrate a link, got {ranks}")
    configs = default_configs(ranks) if configs is None else tuple(configs)
    for c in configs:
        try:
            describe(c.schedule).validate(ranks, c.microbatches)
        except ScheduleError as exc:
            raise ValueError(f"calibration config {c}: {exc}") from None
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got {steps} and {warmup}")
    results = spawn_local(_worker, ranks, (configs, warmup, steps), timeout_s, "calibrating the link")
    rows = []
    for k, c in enumerate(configs):
        per_step = [max(results[r][k][0][i] for r in range(ranks)) for i in range(steps)]
        rows.append(CalibrationRow(
            schedule=c.schedule, microbatches=c.microbatches, layers=c.layers, message_bytes=c.rows * c.width * 4,
            forward_s=tuple(statistics.median(results[r][k][1]["F"]) for r in range(ranks)),
            backward_s=tuple(statistics.median(results[r][k][1]["B"]) for r in range(ranks)),
            measured_s=statistics.median(per_step)))
        log.info("calibration %s, %d microbatches, %d layers: step %.3f ms", c.schedule.value, c.microbatches, c.layers,
                 rows[-1].measured_s * 1e3)
    return rows


def calibrate_links(links: LinkProfile, steps: int = 20, timeout_s: float = 300.0) -> LinkProfile:
    """`links` with its per-message overhead and progress delay fitted (`fit_calibration`, at the link's measured
    latency and bandwidth) to torch's schedules run on `links.ranks` local CPU ranks, `steps` timed steps per
    synthetic pipeline; unchanged unless it is a gloo link (NCCL needs no progress thread)."""
    if links.backend != "gloo":
        return links
    fit = fit_calibration(run_calibration(links.ranks, steps=steps, timeout_s=timeout_s), links.latency_s,
                          links.bandwidth_bytes_per_s)
    return replace(links, overhead_s=fit.overhead_s, progress_s=fit.progress_s, calibration=fit.rows,
                   calibration_rms=fit.rms_error)
