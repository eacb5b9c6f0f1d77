"""torch's pipelining runtime's own time per action, which a unit timed alone does not have: what `forward_one_chunk`
(with the last stage's loss call after it) and `backward_one_chunk` spend around a stage's compute.

A run times each action as torch's schedules call it (autopp.run.instrument), so every F and B of a stage carries
this bookkeeping once, however short the stage: flattening and caching the inputs and outputs, the debug-info
formatting, the loss call through the schedule, collecting the input gradients, detaching the outputs. It weighs
most on short stages: examples/resnet.py's last residual block with the classifier ran at 1.4x its profiled F + B
in the runs of docs/splits.md (issue 29), a stage of 8 blocks at 1.0-1.1x. It is measured once per profile on a
stage of almost no compute (a Linear(8, 8)), in a pipeline of one rank (gloo): the median action under torch's
Schedule1F1B against the median of the same forward, loss and backward called directly. Cf. the per-message overhead between actions, which the
link carries (`Link.overhead_s`, docs/accuracy.md): that one is outside the actions, this one inside.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from .timing import Budget, Timer

__all__ = ["RuntimeCost", "runtime_cost", "MICROBATCHES"]

MICROBATCHES = 4
"""Microbatches per timed step of the one-rank pipeline."""


@dataclass(frozen=True)
class RuntimeCost:
    """The runtime's own time in each forward action (with the loss call) and each backward action, in seconds."""

    forward_s: float
    backward_s: float


def runtime_cost(timer: Timer, budget: Budget) -> RuntimeCost | None:
    """Measure the runtime's time per action (module docstring) on CPU, `budget` steps of MICROBATCHES; None when
    it cannot be measured here: on a GPU (the host's bookkeeping runs beside the device's compute) or inside a
    process group of more than one rank (a group of one cannot be made without the others)."""
    if timer.device.type != "cpu" or (dist.is_initialized() and dist.get_world_size() != 1):
        return None
    with _one_rank():
        torch.manual_seed(0)
        module = nn.Linear(8, 8)
        batch = torch.randn(MICROBATCHES, 8)
        example = batch[:1].detach()
        stage = PipelineStage(module, 0, 1, timer.device, input_args=(example,),
                              output_args=(module(example).detach(),))
        actions = _actions(stage, timer, batch, budget)
        bare = _bare(module, batch, timer, budget)
    return RuntimeCost(forward_s=max(0.0, statistics.median(actions[0]) - statistics.median(bare[0])),
                       backward_s=max(0.0, statistics.median(actions[1]) - statistics.median(bare[1])))


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _actions(stage: PipelineStage, timer: Timer, batch: torch.Tensor, budget: Budget
             ) -> tuple[list[float], list[float]]:
    """Each F (extended over its loss, as the runner counts it) and B action of the timed steps."""
    times: tuple[list[float], list[float]] = ([], [])
    timed = [False]

    def wrap(fn: Callable[..., Any], kind: int) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            result, t = timer.time(lambda: fn(*args, **kwargs))
            if timed[0]:
                times[kind].append(t)
            return result
        return run

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        result, t = timer.time(lambda: _loss(output, target))
        if timed[0]:
            times[0][-1] += t
        return result

    stage.forward_one_chunk = wrap(stage.forward_one_chunk, 0)  # type: ignore[method-assign]
    stage.backward_one_chunk = wrap(stage.backward_one_chunk, 1)  # type: ignore[method-assign]
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss)
    target = torch.zeros(MICROBATCHES, 8)
    for run in budget.runs():
        timed[0] = run
        schedule.step(batch, target=target, losses=[], return_outputs=False)
        stage.submod.zero_grad(set_to_none=True)
    return times


def _bare(module: nn.Module, batch: torch.Tensor, timer: Timer, budget: Budget) -> tuple[list[float], list[float]]:
    """The same forward with its loss, and backward, called directly on the same microbatches, in 1F1B's order on
    one stage."""
    times: tuple[list[float], list[float]] = ([], [])
    target = torch.zeros(1, 8)
    for run in budget.runs():
        for chunk in batch.tensor_split(MICROBATCHES):
            loss, f = timer.time(lambda: _loss(module(chunk), target))
            _, b = timer.time(loss.backward)
            if run:
                times[0].append(f)
                times[1].append(b)
        module.zero_grad(set_to_none=True)
    return times


@contextmanager
def _one_rank() -> Iterator[None]:
    """The default process group of this process alone (gloo, an in-memory store), unless one exists already."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
