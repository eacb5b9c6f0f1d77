"""One training step with vocabulary parallelism (autopp.run.vocab) on local CPU ranks, and its validation against one
process: the loss and every gradient, each rank's vocabulary shard of the embedding and the head compared with the
matching rows of the single-process gradient (as torch's pipelining tests compare with a deep-copied reference)."""

from __future__ import annotations

import copy
import io
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

from ..data.vocab import VocabVariant
from ..errors import RunError
from ..model.contract import load_model_file
from ..model.split import split_model
from ..schedule import ScheduleName, describe
from ..spawn import spawn_local
from .chain import ChainPiece, chain_io, constant_values, example_io
from .collect import stage_grads
from .pipeline import contiguous_sends, torch_schedule_class
from .validate import grad_atol, tensor_diff, tolerances
from .vocab import (VocabModules, VocabRuntime, VocabShard, body_model, check_cross_entropy, find_vocab_modules,
                    vocab_bounds)

__all__ = ["VocabJob", "VocabResult", "body_stages", "VocabRank", "build_vocab_rank", "vocab_step", "validate_vocab",
           "vocab_diffs", "gradient_diffs", "reference", "unpacked", "packed"]


@dataclass(frozen=True)
class VocabJob:
    """What to run: a model file, its body's split points (one stage per gap), the schedule, the batch and the
    variant (the plan's `vocab`: how the softmax is combined across the ranks)."""

    model_path: str
    split_points: tuple[str, ...]
    schedule: ScheduleName
    pp: int
    num_microbatches: int
    microbatch_size: int
    v: int = 1
    seed: int = 0
    variant: VocabVariant = VocabVariant.VOCAB_2


@dataclass
class VocabResult:
    """One rank's step: the per-microbatch losses and its gradients (body parameters by name; its vocabulary shard
    under `name[lo:hi]`)."""

    losses: list[float]
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def _shard_name(param: str, lo: int, hi: int) -> str:
    return f"{param}[{lo}:{hi}]"


def body_stages(body: nn.Module, example: tuple[torch.Tensor, ...], split_points: Sequence[str], owner: Sequence[int],
                pp_rank: int, group: dist.ProcessGroup | None) -> list[Stage]:
    """torch PipelineStages of the body stages placed on `pp_rank` (`owner[s]`: stage s's rank), as neighbour-only
    `ChainPiece`s (autopp.run.chain)."""
    pipe = split_model(body, example, split_points)
    if pipe.num_stages != len(owner):
        raise RunError(f"splitting the body at {list(split_points)} gave {pipe.num_stages} stages, the schedule "
                       f"places {len(owner)}")
    io, sources = chain_io(pipe)
    consts = constant_values(pipe, sorted({c for s in io for c in s.constants}), example)
    pieces = [ChainPiece(pipe.get_stage_module(i), i, io[i], sources, {c: consts[c] for c in io[i].constants},
                         last=i == len(owner) - 1) for i in range(len(owner))]
    shapes = example_io(pieces, example)
    stages: list[Stage] = []
    for i in (s for s, r in enumerate(owner) if r == pp_rank):
        inputs, outputs = shapes[i]
        stage = PipelineStage(pieces[i], i, len(owner), torch.device("cpu"), input_args=inputs,
                              output_args=outputs, group=group)
        contiguous_sends(stage)
        stages.append(stage)
    return stages


@dataclass
class VocabRank:
    """One rank's pieces, built once: its body stages under torch's schedule, its vocabulary shard and passes, and
    the job's batch (the same on every rank: the tokens feed the input pass, the targets the output pass)."""

    stages: list[Stage]
    schedule: Any
    runtime: VocabRuntime
    mods: VocabModules
    tokens: torch.Tensor
    target: torch.Tensor
    is_last: bool

    def step(self, tokens: torch.Tensor | None = None, target: torch.Tensor | None = None) -> None:
        """One step of `tokens` and `target` (None: the job's batch): the input passes, torch's schedule (with the
        output passes inside it), the input backward."""
        m = self.runtime.m
        tokens = self.tokens if tokens is None else tokens
        target = self.target if target is None else target
        fed = self.runtime.begin(list(tokens.chunk(m)), list(target.chunk(m)))
        kwargs: dict[str, Any] = {"target": target} if self.is_last else {}
        if fed:
            with warnings.catch_warnings():  # torch's stage reads .grad of its inputs, here chunks of the fed leaves
                warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf", UserWarning)
                self.schedule.step(torch.cat(fed), **kwargs)  # the leaves in self.runtime get the gradients
        else:
            self.schedule.step(**kwargs)
        self.runtime.finish()

    def zero_grad(self) -> None:
        for stage in self.stages:
            stage.submod.zero_grad(set_to_none=True)
        self.runtime.shard.zero_grad(set_to_none=True)

    def parameters(self) -> list[nn.Parameter]:
        """The rank's parameters, each once: its body stages' and its vocabulary shard (one when tied)."""
        params = [p for s in self.stages for p in s.submod.parameters()] + list(self.runtime.shard.parameters())
        return list({id(p): p for p in params}.values())

    def shard_tensors(self, grads: bool) -> dict[str, torch.Tensor]:
        """The vocabulary shard's parameters (or their gradients, zeros for none) under `name[lo:hi]` (tied: the
        embedding's name only)."""
        shard, mods = self.runtime.shard, self.mods
        out: dict[str, torch.Tensor] = {}
        for name, p in ((mods.embedding, shard.embedding), (mods.head, shard.head)):
            if mods.tied and name == mods.head:
                continue
            value = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
            out[_shard_name(f"{name}.weight", shard.lo, shard.hi)] = value.detach().clone()
        return out


def build_vocab_rank(job: VocabJob, rank: int) -> VocabRank:
    """Build the model (the job's seed), shard its vocabulary layers and split its body, for this rank of an
    initialised process group of `job.pp` ranks."""
    mf = load_model_file(job.model_path)
    model = mf.build(job.seed)
    inputs, target = mf.sample_batch(job.num_microbatches * job.microbatch_size, job.seed)
    if len(inputs) != 1:
        raise RunError(f"vocabulary parallelism takes one input (the tokens), the model file gives {len(inputs)}")
    mods = find_vocab_modules(model, (inputs[0][:job.microbatch_size],))
    check_cross_entropy(mf.loss_fn, model, mods, inputs[0][:job.microbatch_size], target[:job.microbatch_size])
    lo, hi = vocab_bounds(mods.vocab, job.pp)[rank]
    shard = VocabShard(model, mods, lo, hi)
    d = describe(job.schedule)
    owner = d.stage_to_rank(job.pp, job.v)
    body = body_model(model, mods)
    example = (torch.zeros(job.microbatch_size, *inputs[0].shape[1:], mods.hidden),)
    stages = body_stages(body, example, job.split_points, owner, rank, None)
    group = dist.new_group(list(range(job.pp)), backend="gloo")
    runtime = VocabRuntime(shard, group, rank, job.pp, job.num_microbatches, owner[-1], job.variant)
    if rank != owner[-1]:
        for stage in stages:
            runtime.watch(stage)
    cls = torch_schedule_class(job.schedule)
    schedule = cls(stages[0] if d.single_stage else list(stages), job.num_microbatches, loss_fn=runtime.loss_fn)
    return VocabRank(stages, schedule, runtime, mods, inputs[0], target, owner[-1] == rank)


def vocab_step(job: VocabJob, rank: int) -> VocabResult:
    """Build this rank's pieces and run one step: its losses and gradients."""
    built = build_vocab_rank(job, rank)
    built.step()
    return VocabResult(built.runtime.losses, _grads(built))


def _grads(built: VocabRank) -> dict[str, torch.Tensor]:
    """The rank's gradients: its body stages' by parameter name, its vocabulary shard's as `name[lo:hi]`."""
    body = {n: g for named in stage_grads(built.stages).values() for n, g in named.items()}
    return {**body, **built.shard_tensors(grads=True)}


def _worker(rank: int, world: int, port: int, job: VocabJob, timeout_s: float, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        # The collectives' timeout is the run's (it was a fixed 120 s: on a loaded machine one rank can still be
        # building the model or tracing the body when the other's first collective gives up).
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        try:
            result = vocab_step(job, rank)
        finally:
            dist.destroy_process_group()
        queue.put((rank, packed(result), None))
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        where = traceback.extract_tb(exc.__traceback__)[-1]
        queue.put((rank, None, f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})"))


def packed(result: VocabResult) -> tuple[list[float], dict[str, bytes]]:
    """A rank's result as the queue carries it: tensors as bytes (torch pickles them into shared memory, which a
    finished worker frees)."""
    def raw(t: torch.Tensor) -> bytes:
        buf = io.BytesIO()
        torch.save(t, buf)
        return buf.getvalue()
    return result.losses, {n: raw(g) for n, g in result.grads.items()}


def reference(job: VocabJob) -> tuple[float, dict[str, torch.Tensor]]:
    """The single-process loss of the whole batch and every gradient by parameter name (tied: the first name)."""
    mf = load_model_file(job.model_path)
    model = mf.build(job.seed)
    inputs, target = mf.sample_batch(job.num_microbatches * job.microbatch_size, job.seed)
    loss = mf.loss_fn(model(*inputs), target)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def vocab_diffs(results: dict[int, VocabResult], ref_loss: float, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """The relative difference from one process (`reference`) of the ranks' mean loss (`loss`) and of every
    gradient (`gradient_diffs`)."""
    first = min(results)
    losses = results[first].losses
    for rank in sorted(results):
        other = results[rank].losses
        if other != losses:
            k = next((i for i, (a, b) in enumerate(zip(losses, other)) if a != b), min(len(losses), len(other)))
            mine, theirs = (_loss_at(x, k) for x in (losses, other))
            raise RunError(f"vocabulary parallelism: rank {rank} disagrees with rank {first} on the loss of "
                           f"microbatch {k}: {theirs} against {mine} ({len(other)} and {len(losses)} losses)")
    diffs = {"loss": abs(sum(losses) / len(losses) - ref_loss) / max(abs(ref_loss), 1e-12)}
    return {**diffs, **{n: rel for n, (_, _, rel) in gradient_diffs(results, ref).items()}}


def _loss_at(losses: list[float], k: int) -> str:
    """Loss k in full precision, or `none` when the rank reported fewer."""
    return repr(losses[k]) if k < len(losses) else "none"


def gradient_diffs(results: dict[int, VocabResult], ref: dict[str, torch.Tensor]
                   ) -> dict[str, tuple[int, float, float]]:
    """Per gradient, (the rank that reported it, its max absolute and relative difference from one process), each
    rank's vocabulary shard against its rows; a RunError when a gradient is missing."""
    # The absolute floor of autopp.run.validate: eps(float32) x the largest reference gradient G, as a share of rtol
    # (1.2e-3 G), where it was 1e-6 G, 1200x tighter: a gradient that is zero in exact arithmetic (an attention key
    # bias) would then compare noise with noise. The test models' smallest gradient is 2.5e-3 G (HF Llama's q_proj),
    # above either floor, so it decides nothing there.
    rtol, _ = tolerances("float32")
    floor = grad_atol(ref, "float32") / rtol
    out: dict[str, tuple[int, float, float]] = {}
    seen: set[str] = set()
    for rank, result in results.items():
        for name, grad in result.grads.items():
            base, _, rows = name.partition("[")
            want = ref[base]
            if rows:
                lo, hi = (int(x) for x in rows.rstrip("]").split(":"))
                want = want[lo:hi]
            out[name] = (rank, *tensor_diff(grad, want, floor))
            seen.add(base)
    missing = sorted(set(ref) - seen)
    if missing:
        raise RunError(f"vocabulary parallelism: no rank reported the gradient of {missing[0]} "
                       f"({len(missing)} missing)")
    return out


def validate_vocab(job: VocabJob, timeout_s: float = 300.0) -> dict[str, float]:
    """Run `job` on `job.pp` local ranks and compare with one process; returns the relative difference per
    gradient (and `loss`), a RunError naming the worst one past float32's tolerance."""
    ref_loss, ref = reference(copy.deepcopy(job))
    raw = spawn_local(_worker, job.pp, (job, timeout_s), timeout_s, "running vocabulary parallelism")
    diffs = vocab_diffs(unpacked(raw), ref_loss, ref)
    grad_tol, loss_tol = tolerances("float32")
    worst = max((n for n in diffs if n != "loss"), key=lambda n: diffs[n])
    if diffs["loss"] > loss_tol or diffs[worst] > grad_tol:
        raise RunError(f"vocabulary parallelism differs from one process: loss {diffs['loss']:.2e}, "
                       f"{worst} {diffs[worst]:.2e} (tolerances {loss_tol:g}, {grad_tol:g})")
    return diffs


def unpacked(raw: dict[int, Any]) -> dict[int, VocabResult]:
    """The workers' (losses, gradients as bytes) by rank, as VocabResults."""
    return {r: VocabResult(losses, {n: torch.load(io.BytesIO(b)) for n, b in grads.items()})
            for r, (losses, grads) in raw.items()}
