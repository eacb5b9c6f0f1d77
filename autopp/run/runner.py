"""run_plan: execute a Plan on local ranks, time it, and validate it against a single-process reference."""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..errors import PlanError, RunError
from ..modelfile import ModelFile, discover_units, fingerprint, load_model_file
from ..plan import Plan
from .launch import launch_ranks, wait_ranks
from .report import RunFailedError, RunReport, median_step_time, relative_error
from .validate import GRAD_RTOL, LOSS_RTOL, Reference, check_coverage, compare_grads, compare_losses, reference_run

__all__ = ["run_plan", "check_fingerprint", "choose_backend"]

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]


def check_fingerprint(plan: Plan) -> ModelFile:
    """Load the plan's model file and refuse the plan if the model changed since it was made."""
    mf = load_model_file(plan.model_path)
    model = mf.build(plan.seed)
    now = fingerprint(model, discover_units(mf, model))
    if now != plan.fingerprint:
        raise PlanError(f"plan was made for model fingerprint {plan.fingerprint} but {plan.model_path} now has "
                        f"{now}: re-plan")
    return mf


def choose_backend(num_ranks: int) -> str:
    """NCCL with one CUDA device per rank when there are enough devices, else gloo on CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= num_ranks:
        return "nccl"
    return "gloo"


@contextlib.contextmanager
def _run_dir(work_dir: str | Path | None) -> Iterator[Path]:
    if work_dir is not None:
        path = Path(work_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="autopp-run-") as tmp:
        yield Path(tmp)


def _blank_report(plan: Plan, plan_path: str | None, steps: int, lr: float, backend: str) -> RunReport:
    return RunReport(plan_path=plan_path, model_path=plan.model_path, fingerprint=plan.fingerprint,
                     schedule=plan.schedule, num_ranks=plan.num_ranks, num_microbatches=plan.num_microbatches,
                     microbatch_size=plan.microbatch_size, steps=steps, lr=lr, backend=backend,
                     grad_rtol=GRAD_RTOL, loss_rtol=LOSS_RTOL, predicted_step_time_s=plan.predicted.step_time_s)


def _worker_args(plan: Plan, mf: ModelFile, run_dir: Path, steps: int, lr: float, backend: str,
                 timeout_s: float) -> list[str]:
    return ["--plan", str(plan.save(run_dir / "plan.json")), "--model", str(mf.path), "--run-dir", str(run_dir),
            "--steps", str(steps), "--lr", repr(lr), "--backend", backend, "--timeout-s", repr(timeout_s)]


def _read_results(run_dir: Path, num_ranks: int) -> tuple[list[dict[str, Any]], dict[int, dict[str, torch.Tensor]]]:
    """Each rank's rank{r}.json and its first-step gradients keyed by stage index."""
    results, grads = [], {}
    for rank in range(num_ranks):
        result = json.loads((run_dir / f"rank{rank}.json").read_text())
        results.append(result)
        grads[int(result["stage"])] = torch.load(run_dir / f"grads{rank}.pt", weights_only=True)
    return results, grads


def _timing(report: RunReport, results: list[dict[str, Any]]) -> RunReport:
    """Per step, the slowest rank's wall time (the barriers make them nearly equal); median and prediction error."""
    per_step = tuple(max(times) for times in zip(*(r["step_times_s"] for r in results)))
    measured = median_step_time(per_step)
    ratio, rel = relative_error(measured, report.predicted_step_time_s)
    return replace(report, step_times_s=per_step, measured_step_time_s=measured, step_time_ratio=ratio,
                   relative_error=rel, complete=True)


def _validation(report: RunReport, results: list[dict[str, Any]], grads: dict[int, dict[str, torch.Tensor]],
                ref: Reference) -> RunReport:
    """Compare losses and first-step gradients; the verdict and, on failure, the reason."""
    check_coverage(list(ref.grads), {int(r["stage"]): r["params"] for r in results})
    diffs = compare_grads(ref.grads, grads)
    worst = max(diffs, key=lambda d: d.max_rel)
    last = max(results, key=lambda r: int(r["stage"]))
    losses = tuple(sum(mb) / len(mb) for mb in last["losses"])
    loss_abs, loss_rel = compare_losses(losses, ref.losses)
    error = None
    if worst.max_rel > GRAD_RTOL:
        error = (f"gradient of {worst.name} (stage {worst.stage}) differs from the single-process reference by "
                 f"{worst.max_rel:.2e} relative (max abs {worst.max_abs:.2e}), above the tolerance {GRAD_RTOL:.0e}")
    elif loss_rel > LOSS_RTOL:
        error = (f"losses differ from the single-process reference by {loss_rel:.2e} relative (max abs "
                 f"{loss_abs:.2e}), above the tolerance {LOSS_RTOL:.0e}: pipelined {losses}, reference {ref.losses}")
    return replace(report, losses=losses, reference_losses=ref.losses, loss_max_abs_diff=loss_abs,
                   loss_max_rel_diff=loss_rel, grad_diffs=tuple(diffs),
                   grad_max_abs_diff=max(d.max_abs for d in diffs), grad_max_rel_diff=worst.max_rel,
                   worst_param=worst.name, passed=error is None, error=error)


def run_plan(plan: Plan, steps: int = 3, timeout_s: float = 120.0, lr: float = 0.01,
             progress: Progress | None = None, *, plan_path: str | None = None,
             work_dir: str | Path | None = None, check: bool = True) -> RunReport:
    """Run `steps` SGD steps of `plan` on one local process per rank, then validate and time them.

    Raises PlanError if the model changed since planning, RunFailedError (a RunError carrying the partial report)
    if a rank fails, the ranks do not finish within `timeout_s` or a parameter is not on exactly one stage, and
    when a gradient or loss is out of tolerance unless `check` is False (then `report.passed` is False).
    `work_dir` keeps the ranks' logs and results (default: a temporary directory, removed).
    """
    say = progress or (lambda _msg: None)
    if steps < 1:
        raise RunError(f"steps must be at least 1, got {steps}")
    mf = check_fingerprint(plan)
    backend = choose_backend(plan.num_ranks)
    report = _blank_report(plan, plan_path, steps, lr, backend)
    with _run_dir(work_dir) as run_dir:
        say(f"starting {plan.num_ranks} ranks ({backend}, {plan.schedule}, {steps} steps) in {run_dir}")
        procs = launch_ranks(_worker_args(plan, mf, run_dir, steps, lr, backend, timeout_s), plan.num_ranks, run_dir)
        try:
            wall = wait_ranks(procs, timeout_s, say)
        except RunError as exc:
            raise RunFailedError(str(exc), replace(report, error=str(exc))) from exc
        say(f"ranks finished in {wall:.1f} s; running the single-process reference")
        results, grads = _read_results(run_dir, plan.num_ranks)
    report = _timing(report, results)
    ref = reference_run(mf, plan.seed, plan.global_batch, steps, lr)
    try:
        report = _validation(report, results, grads, ref)
    except RunError as exc:
        raise RunFailedError(str(exc), replace(report, error=str(exc))) from exc
    logger.info("run finished: passed=%s, grad rel diff %.2e", report.passed, report.grad_max_rel_diff or 0.0)
    if check and not report.passed:
        raise RunFailedError(report.error or "validation failed", report)
    return report
