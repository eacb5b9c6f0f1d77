"""What a stage's actions cost in a run beyond its units' profiled times: torch's pipelining runtime's own time per
action, and the extra time of an action that starts after its rank waited.

The runtime's time: what `forward_one_chunk` (with the last stage's loss call after it) and `backward_one_chunk`
spend around a stage's compute.

A run times each action as torch's schedules call it (autopp.run.instrument), so every F and B of a stage carries
this bookkeeping once, however short the stage: flattening and caching the inputs and outputs, the debug-info
formatting, the loss call through the schedule, collecting the input gradients, detaching the outputs: 35-130 us
per action on examples/resnet.py's stages in context (scripts/bench_stage_context.py --ways runtime), which weighs
most on short stages. It is measured once per profile on a stage of almost no compute (a Linear(8, 8)), in a
pipeline of one rank (gloo): the median action under torch's Schedule1F1B against the median of the same forward,
loss and backward called directly. Cf. the per-message overhead between actions, which the link carries
(`Link.overhead_s`, docs/accuracy.md): that one is outside the actions, this one inside.

The resume cost: an action that starts after its rank idled (blocked in a receive, its core asleep) runs slower
than one right after another: the core wakes up and refills its caches. The profile times units back to back, so
its times are the hot ones; a short stage beside a long one waits before nearly every forward. Measured on the
development machine (2-core VM, CPU clock) after sleeps of 0.5-5 ms: +90-190 us per action whether the action
computes 60 us (a Linear(8, 8)) or 2 ms (six 16-channel convolutions), so it is a cost per action, measured here
on the same Linear after sleeps of RESUME_WAIT_S (scripts/bench_stage_context.py --ways idle shows it on a model's
own stages). The simulator adds it to actions that start after a wait (`StageCost.resume_s`).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from .timing import Budget, Timer

__all__ = ["RuntimeCost", "runtime_cost", "MICROBATCHES", "RESUME_WAIT_S"]

MICROBATCHES = 4
"""Microbatches per timed step of the one-rank pipeline."""
RESUME_WAIT_S = 2e-3
"""How long the rank sleeps before each resumed action: about one wait of a 2-rank CPU pipeline step here."""


@dataclass(frozen=True)
class RuntimeCost:
    """The runtime's own time in each forward action (with the loss call) and each backward action, in seconds."""

    forward_s: float
    backward_s: float
    resume_s: float = 0.0
    """Extra time of an action after a wait of RESUME_WAIT_S, against the same action right after another."""


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
    hot, resumed = _resumed(module, batch, timer, budget)
    return RuntimeCost(forward_s=_excess(actions[0], bare[0]), backward_s=_excess(actions[1], bare[1]),
                       resume_s=_excess(resumed, hot))


def _excess(slow: list[float], fast: list[float]) -> float:
    """Median of `slow` - median of `fast`, at least 0."""
    return max(0.0, statistics.median(slow) - statistics.median(fast))


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


def _resumed(module: nn.Module, batch: torch.Tensor, timer: Timer, budget: Budget
             ) -> tuple[list[float], list[float]]:
    """A forward, loss and backward right after another, and the same after a sleep of RESUME_WAIT_S, MICROBATCHES
    of each per run of `budget`."""
    times: tuple[list[float], list[float]] = ([], [])
    target = torch.zeros(1, 8)
    for run in budget.runs():
        for chunk in batch.tensor_split(MICROBATCHES):
            for after in (0, 1):
                if after:
                    time.sleep(RESUME_WAIT_S)
                _, t = timer.time(lambda: _loss(module(chunk), target).backward())
                if run:
                    times[after].append(t)
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
