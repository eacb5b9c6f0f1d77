"""`autopp run` of a plan with vocabulary parallelism (`Plan.vocab`; autopp.run.vocab runs the passes beside
torch's schedule): its body split and schedule as the plan gives them, on local gloo ranks, each step followed by
the plan's optimizer step on every rank (its body stages and its vocabulary shard), and the same files as the
runner's worker (check{K}.pt, results.json: autopp.run.collect), so that autopp.run.runner times and validates it
like every run (autopp.run.steps: every step from shared parameters, the optimizer's update included; each rank's
shard of the embedding and the head against its rows, as `name[lo:hi]`).

Why its ranks are not autopp.run.worker's: the worker builds its stages from the plan's units with the whole model
(autopp.run.pipeline), for every layout, launcher and backend; a vocabulary-parallel rank builds the body without
its vocabulary layers, a shard of them and the passes' process group (autopp.run.vocab_step), runs local gloo ranks
only, and steps the passes around torch's schedule. What they share is here by import: the optimizer
(autopp.measure.options.make_optimizer), the files the parent reads (autopp.run.collect) and the validation."""

from __future__ import annotations

import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..data.plan import Plan
from ..data.vocab import VocabVariant
from ..errors import AutoppError, RunError
from ..measure.options import make_optimizer
from ..model.contract import ModelFile, load_model_file
from ..spawn import spawn_local
from .collect import StageTensors, gather_check, gather_results, stage_grads, stage_weights
from .options import RunOptions
from .steps import ReferenceModel
from .tied import aliases
from .vocab import find_vocab_modules, vocab_bounds
from .vocab_step import VocabJob, VocabRank, build_vocab_rank

__all__ = ["VOCAB_NOTE", "vocab_job", "run_vocab_ranks", "vocab_reference"]

#: What the report says of how a vocabulary-parallel run differs from the others.
VOCAB_NOTE = ("vocabulary parallelism: the embedding and the head in row shards on every rank (validated as "
              "name[lo:hi]), their passes beside torch's schedule on local gloo ranks; no per-rank actions, waits or "
              "memory measured")


def vocab_job(plan: Plan, options: RunOptions) -> VocabJob:
    """The plan as autopp.run.vocab_step runs it; a RunError (one line) for what it does not run."""
    if options.nodes is not None or options.backend == "nccl" or plan.hf_config:
        raise RunError(f"vocabulary parallelism ({plan.vocab.value if plan.vocab else '-'}) runs a model file on "
                       "local gloo ranks only: drop --nnodes and --backend nccl (plans of an HF config: not yet)")
    return VocabJob(plan.model_path, tuple(plan.split_points), plan.schedule, plan.layout.pp, plan.num_microbatches,
                    plan.microbatch_size, v=plan.layout.v, seed=plan.seed, variant=plan.vocab or VocabVariant.VOCAB_2)


def _tensors(built: VocabRank, grads: bool) -> StageTensors:
    """The rank's body parameters (or gradients) by stage, its vocabulary shard's with its first stage."""
    out = stage_grads(built.stages) if grads else stage_weights(built.stages)
    out[built.stages[0].stage_index].update(built.shard_tensors(grads))
    return out


def _train(job: VocabJob, rank: int, run_dir: str, options: RunOptions) -> None:
    """Build this rank's pieces once and run `options.steps` steps of the optimizer (barriers around each: the
    slowest rank's time is the step's); global rank 0 writes check{K}.pt and results.json into `run_dir`."""
    built = build_vocab_rank(job, rank)
    mf = load_model_file(job.model_path)
    optimizer = make_optimizer(options.optimizer or "sgd", built.parameters(), lr=options.lr)
    times: list[float] = []
    losses: list[list[float]] = []
    for step in range(options.steps):
        inputs, target = mf.sample_batch(job.num_microbatches * job.microbatch_size, seed=job.seed + step)
        weights = _tensors(built, grads=False) if options.validate else {}
        built.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        built.step(inputs[0], target)
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(list(built.runtime.losses))
        if options.validate:  # untimed: the step's gradients, which its update kept
            gather_check(run_dir, rank, step, (weights, _tensors(built, grads=True)))
    if options.validate:  # the parameters after the last step: its update is checked too (autopp.run.steps)
        gather_check(run_dir, rank, options.steps, (_tensors(built, grads=False), {}))
    names = {str(i): list(t) for i, t in _tensors(built, grads=False).items()}
    gather_results(run_dir, rank, {"rank": rank, "replica": 0, "pp_rank": rank, "tp_rank": 0, "device": rank,
                                   "stages": [s.stage_index for s in built.stages], "step_times_s": times,
                                   "losses": losses if built.is_last else [], "params": names})


def _worker(rank: int, world: int, port: int, job: VocabJob, run_dir: str, options: RunOptions, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=options.timeout_s))
        try:
            _train(job, rank, run_dir, options)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, None))
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        where = traceback.extract_tb(exc.__traceback__)[-1]
        queue.put((rank, None, f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})"))


def run_vocab_ranks(plan: Plan, options: RunOptions, run_dir: Path) -> None:
    """Run `options.steps` steps of `plan` (which has `vocab`) on `plan.num_ranks` local ranks, leaving the
    worker's files in `run_dir` (autopp.run.worker describes them); a RunError when a rank fails or the run times
    out."""
    job = vocab_job(plan, options)
    try:
        spawn_local(_worker, job.pp, (job, str(run_dir), options), options.timeout_s, "running vocabulary parallelism")
    except AutoppError as exc:  # a rank failed or the run timed out
        raise RunError(str(exc)) from exc


def vocab_reference(plan: Plan, mf: ModelFile, options: RunOptions) -> ReferenceModel:
    """The single-process reference of a vocabulary-parallel run: the plan's optimizer, and the embedding and head
    compared in the rows each rank holds (`vocab_bounds`)."""
    model = mf.build(plan.seed)
    inputs, _ = mf.sample_batch(plan.microbatch_size, plan.seed)
    mods = find_vocab_modules(model, (inputs[0],))
    bounds = vocab_bounds(mods.vocab, plan.layout.pp)
    alias = aliases(model)
    names = {alias.get(f"{n}.weight", f"{n}.weight") for n in (mods.embedding, mods.head)}
    return ReferenceModel(mf, plan.seed, plan.global_batch, optimizer=options.optimizer or "sgd", lr=options.lr,
                          shards={n: bounds for n in names})
