"""One rank of a pipelined run: `python -m autopp.run.worker` with RANK/WORLD_SIZE/MASTER_* set by launch.py.

The rank builds the model (same seed everywhere), splits it, builds its stage, runs the plan's schedule for a few
SGD steps and writes into the run directory:
  rank{r}.json    step times, per-step microbatch losses (last rank), its parameter names
  grads{r}.pt     its parameters' gradients at the first step, by name
  rank{r}.error   one line naming the exception, written before exiting non-zero
Progress lines are logged to stdout, which the parent forwards.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

from ..errors import RunError
from ..modelfile import ModelFile, load_model_file
from ..plan import Plan, StagePlan, load_plan
from ..split import split_model

__all__ = ["SCHEDULES", "make_schedule", "stage_of_rank", "main"]

logger = logging.getLogger("autopp.run.worker")  # not __name__: this module runs as __main__

#: The plan's schedule names and the torch schedules that run them.
SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}


def stage_of_rank(plan: Plan, rank: int) -> StagePlan:
    """The one stage placed on `rank`; single-stage schedules need stage i on rank i."""
    stages = [s for s in plan.stages if s.rank == rank]
    if len(stages) != 1 or stages[0].index != rank:
        placed = [(s.index, s.rank) for s in plan.stages]
        raise RunError(f"rank {rank}: the runner needs exactly stage {rank} on rank {rank}; plan places "
                       f"(stage, rank) as {placed}")
    return stages[0]


def make_schedule(name: str, stage: Stage, n_microbatches: int, loss_fn: Any) -> PipelineScheduleSingle:
    """The torch schedule called `name`, with the default scale_grads=True (gradients of the mean loss)."""
    if name not in SCHEDULES:
        raise RunError(f"schedule {name!r} is not supported by the runner; use one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](stage, n_microbatches, loss_fn=loss_fn)


def _device(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _build_stage(mf: ModelFile, plan: Plan, stage_plan: StagePlan, device: torch.device) -> Stage:
    model = mf.build(plan.seed)
    example, _ = mf.sample_batch(plan.microbatch_size, seed=plan.seed)
    pipe = split_model(model, example, plan.split_points)
    if pipe.num_stages != len(plan.stages):
        raise RunError(f"splitting at {plan.split_points} gave {pipe.num_stages} pieces, plan has {len(plan.stages)}")
    pipe.get_stage_module(stage_plan.index).to(device)
    return pipe.build_stage(stage_plan.index, device)


def _grads(stage: Stage) -> dict[str, torch.Tensor]:
    return {name: (p.grad.detach().cpu().clone() if p.grad is not None else torch.zeros_like(p.detach().cpu()))
            for name, p in stage.submod.named_parameters()}


def _train(args: argparse.Namespace, rank: int, device: torch.device) -> None:
    plan = load_plan(args.plan)
    mf = load_model_file(args.model)
    stage_plan = stage_of_rank(plan, rank)
    stage = _build_stage(mf, plan, stage_plan, device)
    schedule = make_schedule(plan.schedule, stage, plan.num_microbatches, mf.loss_fn)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=args.lr)
    first, last = stage_plan.index == 0, stage_plan.index == len(plan.stages) - 1
    times: list[float] = []
    losses: list[list[float]] = []
    logger.info("stage %d built (%d parameters)", stage_plan.index, sum(p.numel() for p in stage.submod.parameters()))
    for step in range(args.steps):
        inputs, target = mf.sample_batch(plan.global_batch, seed=plan.seed + step)
        mb_losses: list[torch.Tensor] = []
        _sync(device)
        start = time.perf_counter()
        step_args = tuple(_to(t, device) for t in inputs) if first else ()
        step_kwargs: dict[str, Any] = {"target": _to(target, device), "losses": mb_losses} if last else {}
        schedule.step(*step_args, **step_kwargs)
        if step == 0:
            torch.save(_grads(stage), Path(args.run_dir) / f"grads{rank}.pt")
        optimizer.step()
        optimizer.zero_grad()
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append([float(x.detach()) for x in mb_losses])
        logger.info("step %d/%d %.4f s", step + 1, args.steps, times[-1])
    result = {"rank": rank, "stage": stage_plan.index, "step_times_s": times, "losses": losses if last else [],
              "params": [n for n, _ in stage.submod.named_parameters()]}
    (Path(args.run_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m autopp.run.worker")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    return parser.parse_args(argv)


def _record_error(run_dir: str, rank: int, exc: BaseException) -> None:
    """One line naming the exception and the innermost frame, for the parent's RunError."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = str(exc).strip().splitlines()
    (Path(run_dir) / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {text[0] if text else ''}{where}\n")


def _log_progress_to_stdout() -> None:
    """autopp's INFO messages (only autopp's, not torch's) go to stdout, one per line, for the parent."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("autopp")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Run this rank; on any exception record it, print the traceback to stderr and return 1."""
    args = _parse(argv)
    _log_progress_to_stdout()
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    try:
        device = _device(args.backend, rank)
        dist.init_process_group(args.backend, rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=args.timeout_s))
        _train(args, rank, device)
    except BaseException as exc:  # noqa: BLE001 - the parent needs every failure, KeyboardInterrupt included
        # Record first and skip destroy_process_group: it may wait on peers, and the parent kills them anyway.
        _record_error(args.run_dir, rank, exc)
        traceback.print_exc()
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit skips interpreter teardown, where a process group whose peers died can block.
    os._exit(code)
