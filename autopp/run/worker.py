"""One rank of a pipelined run: `python -m autopp.run.worker`, started by launch.py or by torchrun.

Ranks. The world is the plan's layout, pp x dp x cp x tp processes, numbered by `Layout.rank` (autopp.data.layout,
the numbering the planner costs links with: a tensor-parallel group is consecutive ranks, a stage's replicas are
neighbours; with tp 1, pipeline rank 0 is ranks 0..dp-1, ...; a cp rank holds its head-tail share of each sequence,
autopp.run.context_run). The launcher's RANK is the process's device slot (LOCAL_RANK its CUDA device): with a
plan `device_order` the process on device d runs global rank `device_order.index(d)`, so global rank r runs on
device `device_order[r]` (without one, rank r on device r). Each replica runs the whole pipeline on its contiguous
slice of the global batch (the tp ranks of a replica all read it); the ranks that hold the same stages in
different replicas average their gradients (all-reduce over a process subgroup; ZeRO 1 and 3: FSDP2's reduce-scatter)
before the optimizer step. With tp > 1 or ZeRO 1/3 the groups come from the layout's device mesh and the
stages are tensor-parallel and sharded by autopp.run.parallel (autopp.run.tensor_parallel, .data_parallel). RANK,
WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT come from the environment (launch.py sets them; torchrun sets them the
same way).

The rank builds the model (same seed everywhere), splits it into the plan's stages, builds the stages placed on its
pipeline rank, runs the plan's schedule for a few steps of the plan's optimizer, timing each step, each action and
each wait, and estimating its peak memory. After each step (untimed; not with --no-validate), global rank 0 gathers
  check{K}.pt     {"params": {stage: {name: parameter before step K}}, "grads": {stage: {name: its gradient}}} (after
                  the dp average and the tied sum; whole tensors: a sharded one is gathered with DTensor.full_tensor)
of replica 0, and check{STEPS}.pt, its parameters after the last step (`gather_final`), for the parent's
shared-parameter validation (autopp.run.steps), and at the end every rank's results:
  results.json    one object per global rank: step times, actions, waits, peak memory, losses, parameter names
A rank that fails writes rank{r}.error (one line naming the exception, the model file's own when torch wrapped it,
and where it was raised) into its own run dir before exiting 1.
Progress lines (`[rank R] message`; a step's end `step K/N T s`) are logged to stdout, which the parent reads.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

from ..errors import RunError
from ..measure.allocator import keep_freed_memory
from ..measure.options import make_optimizer
from ..model.contract import ModelFile
from ..model.hf import load_model
from ..data.plan import Plan, load_plan
from ..data.layout import Coords, Layout, uses_mesh
from ..spawn import PACKAGE_ENV, package_problem
from .collect import gather_check, gather_final, gather_results, stage_grads, stage_weights
from .instrument import SavedBytes, StepRecorder, cpu_memory_method, probe_peak, record_waits, static_bytes
from .data_parallel import check_runnable, sync_mesh
from .expert_parallel import average_expert_grads, ep_meshes, expert_params
from .parallel import local, make_mesh
from .context import RingConfig
from .context_run import shard_batch
from .pipeline import RankStages, build_stages, last_stage_kwargs, make_schedule
from .tied import sum_tied_grads, tie_groups

__all__ = ["Ranks", "ranks_of", "check_world_size", "replica_slice", "describe_error", "main"]

logger = logging.getLogger("autopp.run.worker")  # not __name__: this module runs as __main__


@dataclass(frozen=True)
class Ranks:
    """Where a global rank sits (`Layout.coords`), and the global ranks of its pipeline and data-parallel groups."""

    rank: int
    coords: Coords
    pipeline: tuple[int, ...]
    """Global ranks of this replica's pipeline (pipeline rank i is pipeline[i])."""
    data_parallel: tuple[int, ...]
    """Global ranks holding the same stages (and tensor-parallel rank) in every replica."""

    @property
    def replica(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def tp_rank(self) -> int:
        """Tensor-parallel rank within the stage's group of tp processes."""
        return self.coords.tp


def ranks_of(rank: int, layout: Layout) -> Ranks:
    """Global rank `rank`'s place in `layout` and its groups (`Layout.coords`, `Layout.along`)."""
    coords = layout.coords(rank)
    return Ranks(rank, coords, layout.along("pp", coords), layout.along("dp", coords))


def check_world_size(plan: Plan, world_size: int) -> None:
    if world_size != plan.num_ranks:
        raise RunError(f"plan needs {plan.num_ranks} ranks ({plan.layout.describe()}) but WORLD_SIZE is "
                       f"{world_size}")


def replica_slice(value: Any, replica: int, dp: int) -> Any:
    """Replica `replica`'s contiguous share of a batch tensor (dimension 0)."""
    if not isinstance(value, torch.Tensor) or dp == 1:
        return value
    n = value.shape[0] // dp
    return value[replica * n:(replica + 1) * n]


def _groups(plan: Plan, ranks: Ranks, mesh: DeviceMesh | None
            ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's pipeline group and data-parallel group (None: FSDP2 reduces the gradients); every rank creates
    every group, in the same order."""
    if mesh is not None:
        replicas = sync_mesh(mesh, plan.layout).get_group() if plan.layout.zero.replicated and plan.layout.sync > 1 \
            else None
        return mesh["pp"].get_group(), replicas
    layout = plan.layout
    if layout.dp == 1:
        return None, None
    pp_group = dp_group = None
    for replica in range(layout.dp):
        g = dist.new_group(list(layout.along("pp", Coords(pp=0, dp=replica))))
        pp_group = g if replica == ranks.replica else pp_group
    for i in range(layout.pp):
        g = dist.new_group(list(layout.along("dp", Coords(pp=i, dp=0))))
        dp_group = g if i == ranks.pp_rank else dp_group
    return pp_group, dp_group


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _params(stages: Sequence[Stage]) -> list[torch.nn.Parameter]:
    """The rank's parameters, each once (stages on one rank share a tied weight's tensor)."""
    return list({id(p): p for s in stages for p in s.submod.parameters()}.values())


def _average_grads(params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None, ranks: int) -> None:
    """Average gradients over the `ranks` of the synchronisation group (`Layout.sync`; one flat all-reduce; a
    tensor-parallel gradient: of its local shard)."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= ranks
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _check_untied(plan: Plan, built: RankStages) -> None:
    """Tied weights are summed across plain pipeline replicas on whole tensors only: refuse them with tensor or
    context parallelism or ZeRO."""
    tied = sorted(set(built.shared) | {n for n, ps in built.params.items() if len(ps) > 1})
    if tied:
        layout = plan.layout
        raise RunError(f"the model ties {tied[0]!r} between stages, which the runner sums only without tensor or "
                       f"context parallelism and ZeRO (plan has tp {layout.tp}, cp {layout.cp}, zero "
                       f"{layout.zero.stage}): run it with tp 1, cp 1 and zero 0")


@dataclass
class _Run:
    """What this rank measured."""

    step_times: list[float]
    losses: list[list[float]]
    actions: list[list[list[Any]]]
    waits: list[float]
    peak_memory: int
    phases: list[dict[str, float]]
    """Per step: seconds in schedule.step, in the dp gradient all-reduce, and in the optimizer step + zero_grad."""


def _train(args: argparse.Namespace, plan: Plan, mf: ModelFile, ranks: Ranks, device: torch.device, slot: int
           ) -> _Run:
    mesh = make_mesh(plan, device) if uses_mesh(plan.layout) else None
    pp_group, dp_group = _groups(plan, ranks, mesh)
    ring = RingConfig(group=mesh["cp"].get_group()) if mesh is not None and plan.layout.cp > 1 else None
    built = build_stages(mf, plan, ranks.pp_rank, device, pp_group, mesh, ring)
    if mesh is not None:
        _check_untied(plan, built)
    stages, recorder = built.stages, StepRecorder()
    ties = tie_groups(built.shared, plan.layout, ranks.replica, ranks.pp_rank)
    schedule = make_schedule(plan, stages, recorder.timed_loss(built.loss_fn),
                             Path(args.run_dir) / f"order{ranks.rank}.csv", built.mirror)
    params = _params(stages)
    experts = expert_params([s.submod for s in stages])
    optimizer = make_optimizer(args.optimizer, params, lr=args.lr)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    # memory counts the rank's shards; ZeRO: FSDP2's gathered parameters are registered on the stages while used
    sharded = [s.submod for s in stages] if not plan.layout.zero.replicated else []
    saved = SavedBytes(params, sharded)
    recorder.wrap_stages(stages)
    run = _Run([], [], [], [], 0, [])
    checked = args.validate and (mesh is not None or ranks.replica == 0)  # mesh: gathering is collective
    mine = ranks.replica == 0 and ranks.tp_rank == 0 and ranks.coords.cp == 0
    logger.info("stages %s built on pipeline rank %d of replica %d%s, on device %d (%s; %d parameters)",
                [s.stage_index for s in stages], ranks.pp_rank, ranks.replica,
                f" (tp rank {ranks.tp_rank})" if plan.layout.tp > 1 else "", slot, device,
                sum(local(p).numel() for p in params))
    for name, holders in built.shared.items():
        logger.info("%s is held by pipeline ranks %s: their gradients are summed", name, list(holders))
    for stage, names in built.relayed.items():
        logger.info("stage %d relays %s", stage, list(names))
    for step in range(args.steps):
        inputs, target = mf.sample_batch(plan.global_batch, seed=plan.seed + step)
        inputs = tuple(replica_slice(t, ranks.replica, plan.layout.dp) for t in inputs)
        target = replica_slice(target, ranks.replica, plan.layout.dp)
        if ring is not None:  # this cp rank's head-tail share of every sequence (autopp.run.context_run)
            inputs, (target,) = shard_batch(tuple(inputs), ring), shard_batch((target,), ring)
        mb_losses: list[torch.Tensor] = []
        weights = stage_weights(stages) if checked else {}
        step_args = tuple(_to(t, device) for t in inputs) if first else ()
        step_kwargs = last_stage_kwargs(_to(target, device), mb_losses) if last else {}
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        saved.reset_peak()
        recorder.start()
        with record_waits(recorder), built.running(ring):
            schedule.step(*step_args, **step_kwargs)
        t_schedule = recorder.now()
        sum_tied_grads(ties, built.params)
        _average_grads([p for p in params if all(p is not e for e in experts)], dp_group, plan.layout.sync)
        average_expert_grads(experts, plan.layout, ep_meshes(mesh, plan.layout)[1] if experts and mesh else None)
        t_allreduce = t_optimizer = recorder.now()
        optimizer.step()
        if not checked:
            optimizer.zero_grad()
        run.phases.append({"schedule_s": t_schedule, "allreduce_s": t_allreduce - t_schedule,
                           "optimizer_s": recorder.now() - t_optimizer, "origin_s": recorder.t0})
        _sync(device)
        run.step_times.append(recorder.now())
        grads = stage_grads(stages) if checked else {}  # untimed: the step's gradients, which its update kept
        optimizer.zero_grad()
        run.losses.append([float(local(x).detach()) for x in mb_losses])
        run.actions.append([[a.action, a.start_s, a.end_s] for a in recorder.actions])
        run.waits.append(recorder.wait_s)
        static = static_bytes(params, optimizer, plan.layout.zero)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else static + saved.peak
        run.peak_memory = max(run.peak_memory, int(peak))
        logger.info("step %d/%d %.4f s", step + 1, args.steps, run.step_times[-1])
        if step == 0 and device.type != "cuda":
            with built.running(ring):
                run.peak_memory = max(run.peak_memory, _probe_memory(schedule, step_args, last, target, device,
                                                                     saved, params, optimizer, plan.layout))
        if args.validate:
            gather_check(args.run_dir, ranks.rank, step, (weights, grads) if mine else ({}, {}))
    if args.validate:
        gather_final(args.run_dir, ranks.rank, args.steps, stages if checked else (), mine)
    run_result = {"rank": ranks.rank, "replica": ranks.replica, "pp_rank": ranks.pp_rank, "tp_rank": ranks.tp_rank,
                  "device": slot, "stages": [s.stage_index for s in stages], "step_times_s": run.step_times,
                  "losses": run.losses if last else [], "actions": run.actions, "wait_s": run.waits,
                  "phases": run.phases, "peak_memory_bytes": run.peak_memory,
                  "memory_method": "cuda.max_memory_allocated" if device.type == "cuda" else
                  cpu_memory_method(plan.layout),
                  "params": {str(s.stage_index): [n for n, _ in s.submod.named_parameters()] for s in stages}}
    gather_results(args.run_dir, ranks.rank, run_result)
    return run


def _probe_memory(schedule: Any, step_args: tuple[Any, ...], last: bool, target: Any, device: torch.device,
                  saved: SavedBytes, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                  layout: Layout) -> int:
    """CPU peak from one extra, untimed forward and backward of the last step's batch whose gradients are thrown
    away (`probe_peak`): the dispatch mode and the saved-tensor hooks cost time per op and per saved tensor (~9% of
    a GPT step for the hooks), so the timed steps run without them, and the first step is avoided because its
    one-time shape inference allocates and saves tensors too."""
    _sync(device)
    step_kwargs = last_stage_kwargs(_to(target, device), []) if last else {}
    peak = probe_peak(lambda: schedule.step(*step_args, **step_kwargs), cpu_memory_method(layout), saved, params,
                      optimizer, layout.zero)
    optimizer.zero_grad()
    _sync(device)
    return peak


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m autopp.run.worker")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--model", help="model file (default: the plan's model_path)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--no-validate", dest="validate", action="store_false")
    parser.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    return parser.parse_args(argv)


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or while handling (`__cause__`, else `__context__`), outermost
    first."""
    chain = [exc]
    while True:
        inner = chain[-1].__cause__ or (None if chain[-1].__suppress_context__ else chain[-1].__context__)
        if inner is None or inner in chain:
            return chain
        chain.append(inner)


def _frames_in(exc: BaseException, files: Sequence[str]) -> list[traceback.FrameSummary]:
    wanted = {str(Path(f).resolve()) for f in files}
    return [f for f in traceback.extract_tb(exc.__traceback__) if str(Path(f.filename).resolve()) in wanted]


def describe_error(exc: BaseException, user_files: Sequence[str] = ()) -> str:
    """One line for the parent: the innermost exception raised in the user's files (torch wraps a model's error in
    its own, e.g. `[Stage 1] failed to run forward`), else the innermost of the chain, with its place
    (`model.py:23 in forward`, the deepest frame in the user's files, else the innermost frame)."""
    chain = _chain(exc)
    user = [e for e in chain if _frames_in(e, user_files)]
    chosen = user[-1] if user else chain[-1]
    frames = _frames_in(chosen, user_files) or traceback.extract_tb(chosen.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    text = str(chosen).strip().splitlines()
    return f"{type(chosen).__name__}: {text[0] if text else ''}{where}"


def _record_error(run_dir: str, rank: int, exc: BaseException, user_files: Sequence[str] = ()) -> None:
    """One line naming the exception (the user's own, see describe_error), for the parent's RunError."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / f"rank{rank}.error").write_text(describe_error(exc, user_files) + "\n")


def _log_progress_to_stdout(rank: int) -> logging.Handler:
    """autopp's INFO messages (only autopp's, not torch's) go to stdout, one per line prefixed `[rank R] ` (torchrun
    mixes a node's workers in one stream), for the parent."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
    root = logging.getLogger("autopp")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler


def main(argv: list[str] | None = None) -> int:
    """Run this rank; on any exception record it, print the traceback to stderr and return 1."""
    args = _parse(argv)
    slot = int(os.environ["RANK"])  # the device slot the launcher started this process on
    handler = _log_progress_to_stdout(slot)
    torch.set_num_threads(1)
    logger.info("allocator %s", keep_freed_memory())
    user_files: list[str] = [args.model] if args.model else []
    try:
        if why := package_problem(os.environ.get(PACKAGE_ENV)):
            raise RunError(why)
        plan = load_plan(args.plan)
        user_files.append(plan.model_path)
        check_world_size(plan, int(os.environ["WORLD_SIZE"]))
        check_runnable(plan)
        rank = plan.rank_on(slot)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
        mf = load_model(args.model or plan.model_path, plan.hf_config)
        device = _device(args.backend)
        dist.init_process_group(args.backend, rank=rank, world_size=plan.num_ranks,
                                timeout=timedelta(seconds=args.timeout_s))
        _train(args, plan, mf, ranks_of(rank, plan.layout), device, slot)
    except BaseException as exc:  # noqa: BLE001 - the parent needs every failure, KeyboardInterrupt included
        # Record first and skip destroy_process_group: it may wait on peers, and the parent kills them anyway.
        _record_error(args.run_dir, slot, exc, user_files)  # beside the launcher's files of this slot
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
