"""run_plan: execute a Plan on local ranks, time it, and validate it against a single-process reference."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..cores import MESH_ON_CPU, usable_cores
from ..display import format_grid
from ..errors import PlanError, RunError
from ..model.contract import ModelFile
from ..model.hf import load_model
from ..model.meta import build_meta
from ..model.units import discover_units, fingerprint
from ..data.layout import uses_mesh
from ..data.plan import Plan
from ..schedule import Pairing
from ..measure.options import OPTIMIZER_STATES
from .launch import RankProcess, launch_ranks, wait_ranks
from .report import RunFailedError, RunReport, median_step_time, relative_error
from .summary import median_step_index, rank_measures, stage_times
from .tied import canonical_names
from .options import Backend, RunOptions
from .torchrun import check_node_share, launch_torchrun, torchrun_command, worker_errors
from .context_run import check_context_model
from .data_parallel import check_runnable
from .seq_chunks import check_seq_plan, chunks_supported
from .pipeline import check_schedule_runs
from .collect import StageTensors
from .resolve import Chosen, resolve_options
from .steps import Checks, ReferenceModel, batch_norm_refusal, validate_steps
from .vocab_run import VOCAB_NOTE, run_vocab_ranks, vocab_job, vocab_reference
from .validate import GRAD_RTOL, LOSS_RTOL, check_coverage, compare_losses, tolerances

__all__ = ["run_plan", "check_fingerprint", "choose_backend", "read_results", "host_share"]

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]


def check_fingerprint(plan: Plan) -> ModelFile:
    """Load the plan's model (its model file, or its HF config built as the plan says) and refuse the plan if the
    model changed since it was made."""
    return _fingerprinted(plan)[0]


def _fingerprinted(plan: Plan) -> tuple[ModelFile, nn.Module]:
    """`check_fingerprint`, and the model it built on the meta device (large parameters never allocated, as the
    profiler builds it: the fingerprint is the structure's, so a model one process cannot hold is checked too)."""
    mf = load_model(plan.model_path, plan.hf_config)
    model = build_meta(mf, plan.seed).model
    units = discover_units(mf, model)
    now = fingerprint(model, units)
    if now != plan.fingerprint:
        hf = plan.hf_config
        given = f"--hf-config {plan.model_path} --seq-len {hf['seq_len']}" if hf else plan.model_path
        raise PlanError(f"plan was made for model fingerprint {plan.fingerprint} but {plan.model_path} now has "
                        f"{now}: re-plan from a new profile (`autopp plan {given} ...` profiles the changed "
                        f"model; with --profile, run `autopp profile {given}` first: an old profile keeps "
                        "the old fingerprint)")
    _check_units(plan, [(u.name, u.split_point) for u in units])
    return mf, model


def _check_units(plan: Plan, units: list[tuple[str, str | None]]) -> None:
    """A PlanError unless every stage's units, unit names and split point are the model's (name, split point) for
    those units, and the stages end at its last unit: the runner cuts at the split points and the exports count the
    units, so a plan edited in one field ran one split and exported another (a tester's)."""
    for s in plan.stages:
        i, j = s.units
        model = units[i:j]
        if not model or len(model) != j - i or list(s.unit_names) != [n for n, _ in model] \
                or s.split_point != model[0][1]:
            raise PlanError(f"stage {s.index}: units {i}-{j - 1}, names {list(s.unit_names)} and split_point "
                            f"{s.split_point!r} are not the model's ({len(units)} units; {i}-{j - 1}: "
                            f"{[n for n, _ in model]} from {model[0][1] if model else None!r}): the plan "
                            "was edited by hand; re-plan (`autopp plan --split` pins a split)")
    if plan.stages[-1].units[1] != len(units):
        raise PlanError(f"the stages end at unit {plan.stages[-1].units[1] - 1}, and the model has {len(units)} units "
                        f"(0 to {len(units) - 1}): the plan was edited by hand; re-plan")


def choose_backend(num_ranks: int) -> Backend:
    """NCCL with one CUDA device per rank when there are enough devices, else gloo on CPU (for plans that name no
    device kind: autopp.run.resolve)."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= num_ranks else "gloo"


#: The note of a run through the device mesh on CPU ranks (`MESH_ON_CPU`).
MESH_ON_CPU_NOTE = f"{MESH_ON_CPU}: this run checks the layout's gradients, its time says little"


FUSED_NOTE = ("the plan counted fused elementwise kernels (`--kernels fused`); autopp run runs the model's ops eager, "
              "one kernel each, so its measured steps exceed the prediction by the elementwise work fusion saves, "
              "and its activations by what fused kernels recompute instead of keeping: a plan that fits in the "
              "fused count may not fit run eager (docs/analytic.md, \"Fused elementwise kernels\")")


FREED_RUN_NOTE = ("the plan counted each stage's outputs freed once sent (Megatron-LM's pipeline); torch's "
                  "PipelineStage, which autopp run drives, holds each microbatch's until its backward: the ranks may "
                  "use more memory than predicted")

COMBINED_RUN_NOTE = ("the plan hid expert all-to-alls under other microbatches' compute (`overlap` ep_a2a, "
                     "Megatron-Core's EP A2A overlap); torch's schedules, which autopp run drives, run each forward "
                     "and backward on its own: the step may take longer than predicted")


def _chosen(plan: Plan, options: RunOptions, plan_path: str | None) -> Chosen:
    """`options` with the backend and optimizer chosen for this node's ranks (autopp.run.resolve), checked."""
    known = ", ".join(OPTIMIZER_STATES)
    if options.optimizer is not None and options.optimizer not in OPTIMIZER_STATES:
        raise RunError(f"unknown optimizer {options.optimizer!r}; autopp runs {known}")
    if options.optimizer is None and plan.optimizer is not None and plan.optimizer not in OPTIMIZER_STATES:
        raise RunError(f"{plan_path or 'plan'}: field 'optimizer' is {plan.optimizer!r}, which autopp does not run "
                       f"({known}); give --optimizer to run another")
    check_node_share(plan.num_ranks, options.nodes)
    return resolve_options(plan, options, cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0)


@contextlib.contextmanager
def _run_dir(work_dir: str | Path | None) -> Iterator[Path]:
    if work_dir is not None:
        path = Path(work_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="autopp-run-"))
    try:
        yield path
    except RunError:
        raise  # the ranks' logs say why: kept, and the error names the directory
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)


def host_share(plan: Plan, options: RunOptions, cores: int | None = None) -> tuple[int | None, int | None]:
    """(ranks started on this host, the cores they may run on: `cores`, else autopp.cores.usable_cores()) for a gloo
    run; (None, None) with NCCL, where each rank drives its own GPU."""
    if options.backend == "nccl":
        return None, None
    return plan.num_ranks // (options.nodes.nnodes if options.nodes else 1), cores or usable_cores()


def _blank_report(plan: Plan, plan_path: str | None, options: RunOptions) -> RunReport:
    ranks, cores = host_share(plan, options)
    return RunReport(plan_path=plan_path, model_path=plan.model_path, fingerprint=plan.fingerprint,
                     schedule=plan.schedule.value, layout=plan.layout, num_microbatches=plan.num_microbatches,
                     microbatch_size=plan.microbatch_size, steps=options.steps, lr=options.lr,
                     backend=options.backend or "gloo", optimizer=options.optimizer or "sgd",
                     validated=options.validate,
                     grad_rtol=GRAD_RTOL, loss_rtol=LOSS_RTOL, predicted_step_time_s=plan.predicted.step_time_s,
                     launcher=options.launcher, ranks_per_host=ranks, host_cores=cores)


def read_results(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's result (results.json, written by global rank 0)."""
    try:
        results: list[dict[str, Any]] = json.loads((run_dir / "results.json").read_text())
    except (OSError, ValueError) as exc:
        raise RunError(f"{run_dir}: the ranks finished but left no readable results: {exc}") from exc
    return results


def _checks(run_dir: Path) -> Checks:
    """Step k's (parameters, gradients) of replica 0 by stage (check{k}.pt, written by global rank 0)."""
    def load(step: int) -> tuple[StageTensors, StageTensors]:
        try:
            data = torch.load(run_dir / f"check{step}.pt", weights_only=True)
        except (OSError, RuntimeError, ValueError) as exc:
            raise RunError(f"{run_dir}: the ranks left no readable parameters of step {step + 1}: {exc}") from exc
        return ({int(k): v for k, v in data["params"].items()}, {int(k): v for k, v in data["grads"].items()})
    return load


def _timing(report: RunReport, results: list[dict[str, Any]], plan: Plan | None = None, one_host: bool = False
            ) -> RunReport:
    """Per step, the slowest rank's wall time (the barriers make them nearly equal); median and prediction error;
    per-rank waits, peak memory and the median step's actions; per-stage action times."""
    per_step = tuple(max(times) for times in zip(*(r["step_times_s"] for r in results)))
    measured = median_step_time(per_step)
    ratio, rel = relative_error(measured, report.predicted_step_time_s)
    report = replace(report, step_times_s=per_step, measured_step_time_s=measured, step_time_ratio=ratio,
                     relative_error=rel, complete=True)
    if plan is None or "actions" not in results[0]:
        return report
    step = median_step_index(per_step)
    return replace(report, ranks=rank_measures(plan, results, step, one_host), stage_times=stage_times(plan, results),
                   memory_method=results[0].get("memory_method"), timeline_step=step)


def _stage_params(results: list[dict[str, Any]]) -> dict[int, list[str]]:
    """Stage -> parameter names, from replica 0's ranks (old single-stage results carry `stage` and `params`)."""
    out: dict[int, list[str]] = {}
    for r in results:
        if r.get("replica", 0) != 0:
            continue
        if isinstance(r["params"], dict):
            out.update({int(k): v for k, v in r["params"].items()})
        else:
            out[int(r["stage"])] = r["params"]
    return out


def _losses(results: list[dict[str, Any]]) -> tuple[float, ...]:
    """Per step, the mean of every replica's microbatch losses (equal microbatches: the global-batch loss)."""
    per_rank = [r["losses"] for r in results if r["losses"]]
    return tuple(sum(sum(mb) for mb in step) / sum(len(mb) for mb in step) for step in zip(*per_rank))


def _validation(report: RunReport, results: list[dict[str, Any]], checks: Checks, reference: ReferenceModel
                ) -> RunReport:
    """Compare every step's loss and gradients with the reference's from the same parameters (autopp.run.steps);
    the verdict and, on failure, the reason."""
    grad_rtol, loss_rtol = tolerances(reference.dtype)
    alias = reference.aliases
    check_coverage(reference.names, {s: list(dict.fromkeys(canonical_names(n, alias)))
                                     for s, n in _stage_params(results).items()})
    losses = _losses(results)
    if len(losses) != report.steps:
        raise RunError(f"pipelined run reported {len(losses)} losses for {report.steps} steps")
    v = validate_steps(reference, checks, losses)
    worst = max(v.grad_diffs, key=lambda d: d.max_rel)
    loss_abs, loss_rel = compare_losses(losses, v.reference_losses)
    return replace(report, losses=losses, reference_losses=v.reference_losses, loss_max_abs_diff=loss_abs,
                   loss_max_rel_diff=loss_rel, grad_diffs=v.grad_diffs,
                   grad_max_abs_diff=max(d.max_abs for d in v.grad_diffs), grad_max_rel_diff=worst.max_rel,
                   worst_param=worst.name, grad_rtol=grad_rtol, grad_atol=v.grad_atol, loss_rtol=loss_rtol,
                   failed_steps=v.failed_steps, passed=v.error is None, error=v.error)


def _launch(plan: Plan, plan_path: str | None, mf: ModelFile, run_dir: Path, options: RunOptions
            ) -> list[RankProcess]:
    """Local: one process per rank, gloo's forked from the rank server (autopp.spawn.rank_context: torch imported
    once), NCCL's each a new interpreter (a forked CUDA rank has not been run on a GPU here). With `options.nodes`:
    this node's torchrun (the plan file must be at the same path on every node)."""
    nodes = options.nodes
    if nodes is None:
        plan_file = plan.save(run_dir / "plan.json")
        args = ["--plan", str(plan_file), "--model", str(mf.path), "--run-dir", str(run_dir), *options.worker_args()]
        return launch_ranks(args, plan.num_ranks, run_dir, fork=options.backend == "gloo")
    plan_file = Path(plan_path) if plan_path and nodes.nnodes > 1 else plan.save(run_dir / "plan.json")
    cmd = torchrun_command(plan_file, options, num_ranks=plan.num_ranks, run_dir=run_dir)
    return [launch_torchrun(cmd, run_dir)]


def _ranks(plan: Plan, plan_path: str | None, mf: ModelFile, run_dir: Path, options: RunOptions, say: Progress
           ) -> list[dict[str, Any]] | None:
    """Launch the ranks, wait for them and read their results (None on a node other than 0: node 0 reads them)."""
    procs = _launch(plan, plan_path, mf, run_dir, options)
    wall = wait_ranks(procs, options.timeout_s, say)
    nodes = options.nodes
    if nodes is not None and nodes.node_rank != 0:
        return None
    say(f"ranks finished in {wall:.1f} s" + ("; comparing every step with the single-process reference"
                                             if options.validate else "; measured only, not validated"))
    return read_results(run_dir)


def _vocab_ranks(plan: Plan, run_dir: Path, options: RunOptions, say: Progress) -> list[dict[str, Any]]:
    """A vocabulary-parallel plan's ranks (autopp.run.vocab_run), started here; their results."""
    start = time.perf_counter()
    run_vocab_ranks(plan, options, run_dir)
    say(f"ranks finished in {time.perf_counter() - start:.1f} s" + (
        "; comparing every step with the single-process reference" if options.validate else
        "; measured only, not validated"))
    return read_results(run_dir)


def run_plan(plan: Plan, options: RunOptions = RunOptions(), *, progress: Progress | None = None,
             plan_path: str | None = None) -> RunReport:
    """Run `options.steps` steps of `plan` on one process per rank with the plan's optimizer, then time them and
    validate every step from shared parameters (autopp.run.steps) unless `options.validate` is False.

    Without `options.nodes`, starts the ranks here. With them, runs this node's share through torchrun; node 0 then
    validates and returns the report, other nodes return the blank report (complete when their ranks exited 0).
    The backend follows the plan's device kind unless given (autopp.run.resolve; the report's notes say why).
    Raises PlanError if the model changed since planning, RunError before any rank starts for a plan to validate
    whose model normalizes with BatchNorm over microbatches (`batch_norm_refusal`) or a GPU plan without a CUDA device
    per rank here, RunFailedError (a RunError carrying the partial report) if a rank fails, the ranks do not finish
    within `timeout_s` or a parameter is not on exactly one stage, and when a gradient or loss is out of tolerance
    unless `options.check` is False (then `report.passed` is False).
    `plan_path`: where the plan was read (recorded in the report; with several nodes, the file each node reads).
    """
    say = progress or (lambda _msg: None)
    check_schedule_runs(plan.schedule)  # a schedule no torch class runs: refused in one line before anything starts
    check_runnable(plan)
    mf, model = _fingerprinted(plan)
    check_seq_plan(plan, chunks_supported(mf.sequence_chunks, model))  # sequence chunks: a model that takes them
    check_context_model(model, plan)  # cp > 1: a model whose positions the ranks can place (one line)
    chosen = _chosen(plan, options, plan_path)
    options = chosen.options
    refusal = batch_norm_refusal(model, plan) if options.validate else None
    if refusal:
        raise RunError(refusal)
    del model
    nodes = options.nodes
    report = replace(_blank_report(plan, plan_path, options), backend_reason=chosen.backend_reason)
    if plan.vocab is not None:  # its passes run beside torch's schedule: autopp.run.vocab_run
        vocab_job(plan, options)  # what it does not run: refused in one line before any rank starts
        report = replace(report, notes=(*report.notes, VOCAB_NOTE))
    if plan.kernels == "fused":  # the prediction counted fused elementwise kernels; the ranks run them eager
        report = replace(report, notes=(*report.notes, FUSED_NOTE))
    if plan.frees_outputs:
        report = replace(report, notes=(*report.notes, FREED_RUN_NOTE))
    hid = sum(s.ep_hidden_s for s in plan.time_breakdown.stages) if plan.time_breakdown is not None else 0.0
    if plan.pairing is Pairing.MICROBATCHES and hid > 1e-9:  # what the plan hid, which the ranks will not
        report = replace(report, notes=(*report.notes, COMBINED_RUN_NOTE))
    if uses_mesh(plan.layout) and options.backend == "gloo":
        report = replace(report, notes=(*report.notes, MESH_ON_CPU_NOTE))
    if plan.seq_chunks is not None and len(set(plan.seq_chunks.lengths)) > 1:  # a tester: said only in the plan
        k, tokens = len(plan.seq_chunks.lengths), sum(plan.seq_chunks.lengths)
        report = replace(report, notes=(*report.notes, (
            f"sequence pipelining: the plan's chunks are {', '.join(map(str, plan.seq_chunks.lengths))} tokens "
            f"(equal cost); autopp run ran {k} of {tokens // k} tokens each (torch's stages keep fixed buffers): "
            "each stage's chunk times are compared with 1/k of its planned microbatch (docs/sequence-pipelining.md)")))
    if report.oversubscribed:  # one line on stderr through the CLI's logging; the report keeps the figures
        logger.warning("%s; measured step times will exceed the prediction (docs/accuracy.md)",
                       report.oversubscribed)
    with _run_dir(options.work_dir) as run_dir:
        say(f"starting {plan.num_ranks} ranks ({chosen.backend_reason}; {plan.schedule.value}, "
            f"{format_grid(plan.layout)}{f', {plan.vocab.value}' if plan.vocab else ''}, {options.steps} steps of "
            f"{options.optimizer}) in {run_dir}")
        try:
            results = _ranks(plan, plan_path, mf, run_dir, options, say) if plan.vocab is None else \
                _vocab_ranks(plan, run_dir, options, say)
        except RunError as exc:  # _run_dir keeps the directory: the error names it (the CLI prints it)
            message = (worker_errors(run_dir) or str(exc)) if nodes is not None else str(exc)
            raise RunFailedError(message, replace(report, error=message), logs=run_dir) from exc
        if results is None:
            return replace(report, complete=True)
        report = _timing(report, results, plan, one_host=options.nodes is None or options.nodes.nnodes == 1)
        if not options.validate:
            return replace(report, losses=_losses(results))
        broken: RunFailedError | None = None
        try:
            reference = ReferenceModel(mf, plan.seed, plan.global_batch, optimizer=options.optimizer or "sgd",
                                       lr=options.lr) if plan.vocab is None else vocab_reference(plan, mf, options)
            report = _validation(report, results, _checks(run_dir), reference)
        except RunError as exc:  # raised once the run directory is gone, as a failed validation
            broken = RunFailedError(str(exc), replace(report, error=str(exc)))
    if broken is not None:
        raise broken
    logger.info("run finished: passed=%s, grad rel diff %.2e", report.passed, report.grad_max_rel_diff or 0.0)
    if options.check and not report.passed:
        raise RunFailedError(report.error or "validation failed", report)
    return report
