"""The torch side of a plan: the stages a rank holds, and the torch schedule that runs them (named or custom CSV)."""

from __future__ import annotations

import contextlib
import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase as Stage
from torch.distributed.tensor.parallel import loss_parallel

from ..errors import RunError
from ..model.contract import ModelFile
from ..model.split import split_model
from ..data.tp_plan import LOSS_PARALLEL
from ..data.plan import Plan
from ..schedule import Action, Kind, StagePlacement, ScheduleName, describe, listed, to_csv_rows
from ..schedule.seqpipe import chunked_order
from .bidirectional import BidirectionalSchedule, mirror_groups, mirror_stage
from .chain import ChainPiece, chain_io, constant_values, example_io
from .context import RingConfig, ring_attention, shard_sequence
from .context_run import own_positions, shard_batch
from .outputs import model_loss
from .parallel import Sharding, shard_stage
from .seq_chunks import ROPE, SeqChunks, chunk_example, chunked_steps, rope_of
from .tensor_parallel import local_shapes, planned_modules, sequence_planned
from .tied import aliases, canonical_names, shared_params

__all__ = ["check_schedule_runs", "torch_schedule_class", "check_split_backward", "placement",
           "RankStages", "build_stages", "contiguous_sends", "make_schedule", "custom_schedule", "write_order_csv",
           "last_stage_kwargs"]

logger = logging.getLogger(__name__)


def check_schedule_runs(name: ScheduleName) -> None:
    """A RunError when the runner cannot run schedule `name` (`Descriptor.runnable`), in one line."""
    if not describe(name).runnable:
        raise RunError(f"{name.value} is planned and simulated only: no torch schedule runs it here; re-plan with "
                       f"--schedule {ScheduleName.ONE_F_ONE_B.value}")


def torch_schedule_class(name: ScheduleName) -> Callable[..., _PipelineSchedule]:
    """The torch.distributed.pipelining class that runs schedule `name` (its descriptor names it). Typed as a
    constructor: a single-stage class takes a stage first, a multi-stage one a list (not _PipelineSchedule's own)."""
    check_schedule_runs(name)
    cls: Callable[..., _PipelineSchedule] = getattr(schedules, describe(name).torch_class)
    return cls


def placement(plan: Plan) -> list[int]:
    """Pipeline rank of every stage: the plan's, checked against the schedule's layout (a given layout: as is)."""
    ranks = [s.rank for s in plan.stages]
    if [s.index for s in plan.stages] != list(range(len(ranks))):
        raise RunError(f"plan stages are numbered {[s.index for s in plan.stages]}, expected 0..{len(ranks) - 1}")
    d = describe(plan.schedule)
    if d.placement is StagePlacement.GIVEN:
        return ranks
    expected = d.stage_to_rank(plan.layout.pp, plan.layout.v)
    if ranks != expected:
        raise RunError(f"{plan.schedule.value} with pp {plan.layout.pp} and {plan.layout.v} stages per rank places "
                       f"stages on ranks {expected}, but the plan places them on {ranks}")
    return ranks


@dataclass
class RankStages:
    """The stages a pipeline rank holds, the loss its last stage computes, and the parameters it shares."""

    stages: list[Stage]
    loss_fn: Any
    """The model file's loss_fn, called with the model's own output structure (see `autopp.run.outputs`)."""
    params: dict[str, list[nn.Parameter]]
    """This rank's parameters by canonical name (the name `named_parameters()` gives a tied weight), each distinct
    tensor once: a tied weight may have several copies on one rank."""
    shared: dict[str, tuple[int, ...]]
    """Canonical name -> pipeline ranks holding a copy, for every parameter held on more than one rank."""
    relayed: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Per stage of this rank, the values it passes on that a later stage reads (see autopp.run.chain)."""
    mirror: Any = None
    """Chimera: this rank's pair group {r, p - 1 - r}, over which its two replicas' gradients are summed
    (autopp.run.bidirectional); None for other schedules."""
    loss_parallel: bool = False
    """This rank computes the loss of a head whose logits stay sharded on the vocabulary (autopp.data.tp_plan.
    LOSS_PARALLEL): its steps run under torch's `loss_parallel()`, whose cross-entropy reads them so."""

    def running(self, ring: RingConfig | None) -> contextlib.ExitStack:
        """What a step of these stages runs under: with a cp `ring`, every attention as torch's ring over the cp group
        (autopp.run.context); with `loss_parallel`, the loss under torch's `loss_parallel()`."""
        stack = contextlib.ExitStack()
        if ring is not None:
            stack.enter_context(ring_attention(ring))
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        return stack


def build_stages(mf: ModelFile, plan: Plan, pp_rank: int, device: torch.device,
                 group: dist.ProcessGroup | None, mesh: DeviceMesh | None = None,
                 context: RingConfig | None = None) -> RankStages:
    """The stages placed on pipeline rank `pp_rank`, in stage order, split from a model built with the plan's seed;
    with a device `mesh` (`uses_mesh`: tensor parallelism or ZeRO), tensor-parallel and ZeRO-sharded
    (autopp.run.parallel: autopp.run.tensor_parallel, autopp.run.data_parallel); with a cp ring `context`, exported
    at this cp rank's share of the sequence with its own rotary positions (autopp.run.context_run)."""
    owner = placement(plan)
    model = mf.build(plan.seed)
    resolved = planned_modules(mf, model, plan) if mesh is not None else {}
    example, _ = mf.sample_batch(plan.microbatch_size, seed=plan.seed)
    if plan.seq_chunks is not None:  # pieces exported and stages built at one chunk's length (autopp.run.seq_chunks)
        example = chunk_example(example, len(plan.seq_chunks.lengths))
    if context is not None:
        seq = example[0].shape[1]
        own_positions(model, shard_sequence(torch.arange(seq), 0, context))
        example = shard_batch(tuple(example), context)
    pipe = split_model(local_shapes(model, resolved, plan.layout.tp) if resolved else model, example, plan.split_points)
    if pipe.num_stages != len(plan.stages):
        raise RunError(f"splitting at {plan.split_points} gave {pipe.num_stages} pieces, plan has {len(plan.stages)}")
    alias = aliases(model)
    names = {i: canonical_names([n for n, _ in pipe.get_stage_module(i).named_parameters(remove_duplicate=False)],
                                alias)
             for i in range(pipe.num_stages)}
    mirrored = describe(plan.schedule).mirrored  # Chimera: also the up replica of stage p - 1 - r
    if mirrored and (mesh is not None or plan.layout.dp > 1):
        raise RunError(f"the runner runs {plan.schedule.value} without data, tensor or ZeRO parallelism "
                       f"({plan.layout.describe()}): plan it with `--dp 1`")
    groups = mirror_groups(len(owner), pp_rank) if mirrored else None
    mine = [i for i, r in enumerate(owner) if r == pp_rank or (mirrored and len(owner) - 1 - r == pp_rank)]
    loss = model_loss(mf.loss_fn, model, tuple(example), pipe) if len(owner) - 1 in mine else mf.loss_fn
    full = model if resolved or plan.layout.ep > 1 else None
    sequence = tuple(sequence_planned(mf, model, plan, resolved, example)) if resolved else ()
    sharding = Sharding(mesh, plan.layout, resolved, full, sequence) if mesh is not None else None
    stages, relayed = _chain_stages(pipe, mine, len(owner), device, group, plan, example, sharding)
    for stage in stages:
        contiguous_sends(stage)
        if groups is not None and stage.stage_index != pp_rank:
            mirror_stage(stage, groups[0])
    params: dict[str, list[nn.Parameter]] = {}
    for stage in stages:
        for n, p in stage.submod.named_parameters(remove_duplicate=False):
            copies = params.setdefault(alias.get(n, n), [])
            if all(p is not q for q in copies):
                copies.append(p)
    shared = shared_params(names, owner)
    if groups is not None and (shared or any(len(ps) > 1 for ps in params.values())):
        raise RunError(f"the model ties {sorted(shared or params)[0]!r} between stages, which the runner does not sum "
                       f"under {plan.schedule.value} (its two replicas hold both copies): untie it or use another "
                       f"schedule")
    if plan.seq_chunks is not None:  # an HF model's rotary frequencies, which its chunks' K/V are turned by
        rope = rope_of(model, mf.sequence_chunks)
        for stage in stages:
            setattr(stage.submod, ROPE, rope)
    return RankStages(stages, loss, params, shared, relayed, groups[1] if groups is not None else None,
                      LOSS_PARALLEL in resolved.values() and len(owner) - 1 in mine)


def _chain_stages(pipe: Any, mine: Sequence[int], n_stages: int, device: torch.device,
                  group: dist.ProcessGroup | None, plan: Plan, example: Sequence[Any],
                  sharding: Sharding | None = None) -> tuple[list[Stage], dict[int, tuple[str, ...]]]:
    """torch's PipelineStage around a `ChainPiece` per stage, for every schedule: values that skip stages are
    relayed through the stages between and values made of constants and buffers are held locally, as the profile
    marks them (`relay` / `recompute`), so each stage talks to its neighbours only.

    torch's graph-built stage (`Pipe.build_stage`) cannot serve: it sends a value that skips stages straight to
    each reader, and torch refuses an output with several destinations ("Backward of skip connections not supported
    yet", issue 13: HF decoders' rotary tables, U-Net skips, under 1F1B and GPipe on 4 ranks), its multi-stage
    schedules exchange neighbour tensors only, and its p2p warm-up sends to itself when two neighbouring stages
    share a rank (V layouts), which gloo refuses ("Pair is not connected"). Every stage's input and output shapes
    come from one example forward of the whole chain in this process (`example_io`), before `sharding` (tensor
    parallelism, ZeRO) turns a stage's modules into their shards: what crosses a cut keeps its full shape."""
    io, sources = chain_io(pipe)
    consts = constant_values(pipe, sorted({c for s in io for c in s.constants}), example)
    pieces = [ChainPiece(pipe.get_stage_module(i), i, io[i], sources, {c: consts[c] for c in io[i].constants},
                         last=i == n_stages - 1, activation=plan.stages[i].activation,
                         units=plan.stages[i].unit_names) for i in range(n_stages)]
    shapes = example_io(pieces, example)
    check_split_backward(plan, pieces)
    stages: list[Stage] = []
    for i in mine:
        inputs, outputs = (tuple(_to(t, device) for t in ts) for ts in shapes[i])
        piece = pieces[i].to_device(device)
        if sharding is not None:
            shard_stage(piece, sharding, plan.stages[i].unit_names, device)
        stages.append(PipelineStage(piece, i, n_stages, device, input_args=inputs, output_args=outputs, group=group))
    relayed = {i: tuple(n for n in io[i].outputs if sources[n].piece != i) for i in mine}
    return stages, {i: r for i, r in relayed.items() if r}


def check_split_backward(plan: Plan, pieces: Sequence[ChainPiece]) -> None:
    """Refuse a split-backward schedule when a stage after the first sends on a value that depends on parameters
    only. torch's input pass differentiates the stage outputs with respect to the stage inputs and keeps, for the
    weight pass, the gradients where input-dependent values meet the weights; the gradient arriving for an output
    made of weights alone is in neither, so the weight pass drops it (measured on T5 under ZBVZeroBubble, one
    decoder block per stage: the first decoder block's relative-attention-bias gradient was 88% off), or fails
    ("Trying to backward through the graph a second time", two decoder blocks on a stage)."""
    if not plan.splits_backward:
        return
    for piece in pieces:
        if piece.weight_only:
            names = [piece.io.outputs[i] for i in piece.weight_only] if not piece.last else []
            raise RunError(f"stage {piece.index} sends on {names or 'an output'} made from its parameters only "
                           f"(not from its inputs), whose gradient torch's split I/W backward "
                           f"({plan.schedule.value}) "
                           f"drops: use a schedule with full backwards ({listed(lambda d: not d.splits_backward)}) "
                           "or move the split so that the value is made on the stage that reads it")


def contiguous_sends(stage: Stage) -> None:
    """Make what the stage sends contiguous: gloo refuses other tensors ("input tensor has to be contiguous"), and an
    input gradient can be a strided view (T5: the gradient of a transposed or expanded input)."""
    send_fwd, send_bwd = stage.get_fwd_send_ops, stage.get_bwd_send_ops

    def fwd(fwd_chunk_id: int) -> Any:  # torch's parameter names
        outputs, rest = stage.fwd_cache[fwd_chunk_id]
        stage.fwd_cache[fwd_chunk_id] = (tuple(_contiguous(t) for t in outputs), rest)
        return send_fwd(fwd_chunk_id)

    def bwd(bwd_chunk_id: int) -> Any:
        if bwd_chunk_id in stage.bwd_cache:
            stage.bwd_cache[bwd_chunk_id] = tuple(_contiguous(g) for g in stage.bwd_cache[bwd_chunk_id])
        return send_bwd(bwd_chunk_id)
    stage.get_fwd_send_ops = fwd  # type: ignore[method-assign]
    stage.get_bwd_send_ops = bwd  # type: ignore[method-assign]


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _contiguous(value: Any) -> Any:
    return value.contiguous() if isinstance(value, torch.Tensor) else value


def make_schedule(plan: Plan, stages: Sequence[Stage], loss_fn: Any, csv_path: Path, mirror: Any = None
                  ) -> _PipelineSchedule | BidirectionalSchedule:
    """The torch schedule for the plan, with the default scale_grads=True (gradients of the mean loss); Chimera's
    is autopp's (`BidirectionalSchedule`, over the `mirror` pair group of `RankStages`)."""
    d = describe(plan.schedule)
    if d.mirrored:
        rank = min(s.stage_index for s in stages if s.stage_index_to_group_rank[s.stage_index] == s.stage_index)
        order = d.build(plan.layout.pp, plan.num_microbatches)[rank]
        return BidirectionalSchedule(stages, order, plan.num_microbatches, loss_fn, mirror)
    if plan.seq_chunks is not None:  # m x k units in the chunked 1F1B order, on torch's CSV runtime
        k = len(plan.seq_chunks.lengths)
        units = chunked_order(plan.layout.pp, plan.num_microbatches, k)
        schedule = custom_schedule(stages, [units[r] for r in sorted(units)], plan.num_microbatches * k, loss_fn,
                                   csv_path)
        caches = SeqChunks([s.submod for s in stages], k, getattr(stages[0].submod, ROPE, None))
        return chunked_steps(schedule, caches, plan.microbatch_size)
    if d.given_order:
        if not plan.custom_order:
            raise RunError(f"plan schedule is {plan.schedule.value} but it has no custom_order")
        return custom_schedule(stages, plan.custom_order, plan.num_microbatches, loss_fn, csv_path)
    cls = torch_schedule_class(plan.schedule)
    if d.single_stage:
        if len(stages) != 1:
            raise RunError(f"{plan.schedule.value} runs one stage per rank, this rank holds {len(stages)}")
        return cls(stages[0], plan.num_microbatches, loss_fn=loss_fn)
    return cls(list(stages), plan.num_microbatches, loss_fn=loss_fn)


def last_stage_kwargs(target: Any, losses: list[Any]) -> dict[str, Any]:
    """`step`'s keywords on a rank holding the last stage: the target, the list that receives the microbatches'
    losses, and no merged output. torch's default (`return_outputs=True`) keeps every microbatch's output (gpt's
    logits: 8 MiB per microbatch of 4) and concatenates them after the last backward (10 ms for two of them on this
    host, loaded), work and memory that no profile or plan counts and the runner never reads."""
    return {"target": target, "losses": losses, "return_outputs": False}


def write_order_csv(order: Sequence[Sequence[Action | None]], path: Path) -> Path:
    """Torch's compute_only CSV: row r = pipeline rank r, cells like 0F0 / 1I2 / 1W2 (blank = idle)."""
    rows = to_csv_rows(dict(enumerate(order)))
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def custom_schedule(stages: Sequence[Stage], order: Sequence[Sequence[Action | None]], n_microbatches: int,
                    loss_fn: Any, csv_path: Path) -> _PipelineSchedule:
    """Run a per-rank compute order through torch's private `_PipelineScheduleRuntime` (the one place that uses it).

    The order is written as a compute_only CSV; torch validates it, infers stage -> rank from it, and inserts the
    sends, receives and gradient reductions itself.
    """
    write_order_csv(order, csv_path)
    schedule = torch_schedule_class(ScheduleName.CUSTOM)(list(stages), n_microbatches, loss_fn=loss_fn)
    try:
        schedule._load_csv(str(csv_path), format="compute_only")  # type: ignore[attr-defined]
    except Exception as exc:  # torch raises ValueError / AssertionError / RuntimeError for a bad order
        raise RunError(f"torch refused the custom order in {csv_path}: {type(exc).__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return schedule
