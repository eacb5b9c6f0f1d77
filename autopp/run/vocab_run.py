"""`autopp run` of a plan with vocabulary parallelism (`Plan.vocab`; autopp.run.vocab runs the passes beside
torch's schedule): its body split and schedule as the plan gives them, on local gloo ranks, timed per step and
validated against one process like every run (the loss and every gradient, each rank's vocabulary shard of the
embedding and the head against its rows)."""

from __future__ import annotations

import time
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..data.plan import Plan
from ..errors import RunError
from ..spawn import spawn_local
from .options import RunOptions
from .report import ParamDiff, RunFailedError, RunReport, median_step_time, relative_error
from .validate import tolerances
from .vocab_step import (VocabJob, VocabResult, build_vocab_rank, gradient_diffs, packed, reference, unpacked,
                         vocab_diffs)
from .vocab_step import _grads as vocab_grads

__all__ = ["vocab_job", "run_vocab_plan"]

#: What the report says of how a vocabulary-parallel run differs from the others.
STEPS_NOTE = ("vocabulary parallelism: every step from the same parameters (gradients zeroed, no optimizer step "
              "between them); step 1's loss and gradients validated against one process")


def vocab_job(plan: Plan, options: RunOptions) -> VocabJob:
    """The plan as autopp.run.vocab_step runs it; a RunError (one line) for what it does not run."""
    if options.nodes is not None or options.backend == "nccl" or plan.hf_config:
        raise RunError(f"vocabulary parallelism ({plan.vocab.value if plan.vocab else '-'}) runs a model file on "
                       "local gloo ranks only: drop --nnodes and --backend nccl (plans of an HF config: not yet)")
    return VocabJob(plan.model_path, tuple(plan.split_points), plan.schedule, plan.layout.pp, plan.num_microbatches,
                    plan.microbatch_size, v=plan.layout.v, seed=plan.seed)


def _worker(rank: int, world: int, port: int, job: VocabJob, steps: int, queue: Any) -> None:
    """Build this rank's pieces once, run `steps` steps (barriers around each: the slowest rank's time is the
    step's), and put (step 1's losses and gradients, every step's time) on the queue."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        try:
            built = build_vocab_rank(job, rank)
            times, first = [], None
            for _ in range(steps):
                built.zero_grad()
                dist.barrier()
                start = time.perf_counter()
                built.step()
                dist.barrier()
                times.append(time.perf_counter() - start)
                first = first or VocabResult(built.runtime.losses,
                                             vocab_grads(built.stages, built.runtime.shard, built.mods))
        finally:
            dist.destroy_process_group()
        assert first is not None
        queue.put((rank, (packed(first), times), None))
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        where = traceback.extract_tb(exc.__traceback__)[-1]
        queue.put((rank, None, f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})"))


def run_vocab_plan(plan: Plan, options: RunOptions, report: RunReport,
                   say: Callable[[str], None] = lambda _m: None) -> RunReport:
    """Run `options.steps` steps of `plan` (which has `vocab`) on `plan.num_ranks` local ranks and fill `report`:
    step times, losses and, unless `options.validate` is False, the comparison with one process (`passed`; a
    RunFailedError when out of tolerance and `options.check`)."""
    job = vocab_job(plan, options)
    say(f"starting {plan.num_ranks} ranks (gloo; {plan.schedule.value} with vocabulary parallelism "
        f"{plan.vocab.value if plan.vocab else '-'}, {options.steps} steps)")
    try:
        raw = spawn_local(_worker, job.pp, (job, options.steps), options.timeout_s,
                          "running vocabulary parallelism")
    except Exception as exc:  # AutoppError from spawn_local: a rank failed or the run timed out
        raise RunFailedError(str(exc), replace(report, error=str(exc))) from exc
    results = unpacked({r: out[0] for r, out in raw.items()})
    per_step = tuple(max(times) for times in zip(*(out[1] for out in raw.values())))
    measured = median_step_time(per_step)
    ratio, rel = relative_error(measured, report.predicted_step_time_s)
    loss = sum(results[0].losses) / len(results[0].losses)
    report = replace(report, step_times_s=per_step, measured_step_time_s=measured, step_time_ratio=ratio,
                     relative_error=rel, complete=True, losses=(loss,), notes=(*report.notes, STEPS_NOTE))
    if not options.validate:
        return report
    ref_loss, ref = reference(job)
    diffs = vocab_diffs(results, ref_loss, ref)
    owner = [st.rank for st in plan.stages]
    grads = [ParamDiff(name=n, stage=owner.index(rank), max_abs=a, max_rel=r)
             for n, (rank, a, r) in gradient_diffs(results, ref).items()]
    grad_tol, loss_tol = tolerances("float32")
    worst = max(grads, key=lambda d: d.max_rel)
    passed = diffs["loss"] <= loss_tol and worst.max_rel <= grad_tol
    error = None if passed else (f"vocabulary parallelism differs from one process: loss {diffs['loss']:.2e}, "
                                 f"{worst.name} {worst.max_rel:.2e} (tolerances {loss_tol:g}, {grad_tol:g})")
    report = replace(report, reference_losses=(ref_loss,), loss_max_abs_diff=abs(loss - ref_loss),
                     loss_max_rel_diff=diffs["loss"], grad_diffs=tuple(grads), grad_max_rel_diff=worst.max_rel,
                     grad_max_abs_diff=max(d.max_abs for d in grads), worst_param=worst.name, grad_rtol=grad_tol,
                     loss_rtol=loss_tol, passed=passed, error=error)
    if options.check and not passed:
        raise RunFailedError(error or "validation failed", report)
    return report

