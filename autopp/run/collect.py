"""What the ranks hand to the parent: replica 0's whole parameters and gradients of each step, for the
shared-parameter validation (autopp.run.steps), and every rank's results, gathered on global rank 0 and written into
the run directory (the files are described in autopp.run.worker)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

from .parallel import full

__all__ = ["StageTensors", "stage_grads", "stage_weights", "gather_check", "gather_final", "gather_results"]

StageTensors = dict[int, dict[str, torch.Tensor]]
"""Stage index -> parameter name (the stage's) -> a whole tensor on the CPU."""


def stage_grads(stages: Sequence[Stage]) -> StageTensors:
    """Whole gradients (a DTensor's gathered: every rank of its mesh must call this)."""
    return {s.stage_index: {name: (full(p.grad).detach().cpu().clone() if p.grad is not None
                                   else torch.zeros_like(full(p.detach()).cpu()))
                            for name, p in s.submod.named_parameters()} for s in stages}


def stage_weights(stages: Sequence[Stage]) -> StageTensors:
    """Whole parameters (a DTensor's gathered: every rank of its mesh must call this)."""
    return {s.stage_index: {name: full(p.detach()).cpu().clone() for name, p in s.submod.named_parameters()}
            for s in stages}


def gather_check(run_dir: str, rank: int, step: int, mine: tuple[StageTensors, StageTensors]) -> None:
    """Global rank 0 collects replica 0's parameters before step `step` and gradients of it into check{step}.pt."""
    world = dist.get_world_size()
    everything: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, everything if rank == 0 else None, dst=0)
    if rank == 0:
        torch.save({"params": {s: p for ps, _ in everything for s, p in ps.items()},
                    "grads": {s: g for _, gs in everything for s, g in gs.items()}},
                   Path(run_dir) / f"check{step}.pt")


def gather_final(run_dir: str, rank: int, steps: int, stages: Sequence[Stage], mine: bool) -> None:
    """Global rank 0 collects replica 0's parameters after the last step into check{steps}.pt (no gradients), so that
    the last step's update is checked like every other (autopp.run.steps). `stages`: the rank's stages where it
    gathers them (empty where it takes no part); `mine`: whether it is one of replica 0's ranks that report."""
    final = stage_weights(stages)
    gather_check(run_dir, rank, steps, (final, {}) if mine else ({}, {}))


def gather_results(run_dir: str, rank: int, result: dict[str, Any]) -> None:
    """Global rank 0 collects every rank's result and writes them into its run dir."""
    world = dist.get_world_size()
    everything: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(result, everything if rank == 0 else None, dst=0)
    if rank == 0:
        (Path(run_dir) / "results.json").write_text(json.dumps(everything))
