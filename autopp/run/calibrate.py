"""Run torch's GPipe and 1F1B on synthetic stages, one per local CPU rank, to calibrate the link between them.

Each config is a stack of Linear layers per stage (two sizes) and 2-8 microbatches; every step and every F and B
is recorded the way `autopp run` records them. autopp.links.fit_calibration then fits the link's per-message
overhead and progress delay to these rows.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..links import CalibrationRow
from ..schedule import parse_action
from ..spawn import spawn_local

__all__ = ["CalibrationConfig", "default_configs", "run_calibration"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationConfig:
    """One synthetic pipeline: `layers` Linear(width, width) per stage, microbatches of `rows` rows."""

    schedule: str
    microbatches: int
    layers: int
    width: int = 512
    rows: int = 16


def default_configs(ranks: int) -> tuple[CalibrationConfig, ...]:
    """Two action lengths (about 0.3 and 1.7 ms of forward on the 2-core development machine) x GPipe and 1F1B x
    `ranks`, 2 x `ranks` and 4 x `ranks` microbatches (1F1B needs at least one per stage)."""
    return tuple(CalibrationConfig(s, m * ranks, layers) for s in ("GPipe", "1F1B") for m in (1, 2, 4)
                 for layers in (2, 10))


def _mse(output: Any, target: Any) -> Any:
    return ((output - target) ** 2).mean()


def _pipeline_times(rank: int, world: int, config: CalibrationConfig, warmup: int, steps: int
                    ) -> tuple[list[float], dict[str, list[float]]]:
    """Run `config` on this rank's stage: per timed step its time, and the durations of its F and B actions."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from .instrument import StepRecorder
    from .pipeline import SCHEDULES

    torch.manual_seed(rank)
    module = torch.nn.Sequential(*[torch.nn.Linear(config.width, config.width) for _ in range(config.layers)])
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = SCHEDULES[config.schedule](stage, config.microbatches, loss_fn=_mse)
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
        import torch
        import torch.distributed as dist

        from ..allocator import keep_freed_memory
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
    one stage each) and return the measured rows, unfitted (autopp.links.fit_calibration fits them)."""
    if ranks < 2:
        raise ValueError(f"need at least 2 ranks to calibrate a link, got {ranks}")
    configs = default_configs(ranks) if configs is None else tuple(configs)
    short = [c for c in configs if c.schedule == "1F1B" and c.microbatches < ranks]
    if short:
        raise ValueError(f"1F1B needs at least {ranks} microbatches on {ranks} ranks, got {short[0].microbatches}")
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
        log.info("calibration %s, %d microbatches, %d layers: step %.3f ms", c.schedule, c.microbatches, c.layers,
                 rows[-1].measured_s * 1e3)
    return rows
