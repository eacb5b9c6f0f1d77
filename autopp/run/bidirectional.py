"""Chimera's two pipelines (Li and Hoefler, SC'21) run on torch's own stage objects by a small runtime of autopp's.

Each pipeline rank r holds two `PipelineStage`s: stage r of the "down" pipeline (on the pipeline group, stage s on
rank s) and stage p - 1 - r of the "up" pipeline (on a second group over the same ranks, stage s on rank p - 1 - s,
its `stage_index_to_group_rank` mirrored). Microbatches 0..m/2-1 go down, m/2..m-1 go up; one per-rank order
(`autopp.schedule.named.chimera`) interleaves the two. After the order, each stage's gradients (accumulated over its
m / 2 microbatches and divided by m, torch's `scale_grads` for the mean loss) are summed with its other replica's on
rank p - 1 - r (an all-reduce over the pair's group), so both replicas hold the whole batch's gradient before the
optimizer steps them alike.

Why not torch's runtime: `_PipelineScheduleRuntime` and every `PipelineScheduleMulti` keep one stage -> rank map
for all stages of a rank and one chain of stage indices 0..n-1 whose last stage computes the loss; Chimera has two
chains with the same indices on mirrored ranks, which no action list of theirs can name. So the runtime here walks
the order and calls what torch's schedules call: each stage's `forward_one_chunk` / `backward_one_chunk` and its
`get_*_recv_ops` / `get_*_send_ops` (through `dist.batch_isend_irecv`), with a `ScheduleGPipe` per pipeline used
only for torch's stage initialisation (`_initialize_stage`: the P2P warm-up and metadata) and its loss call.
Receives are waited for right before the action that reads them and sends are waited for at the end, so the order
runs wherever the simulator runs it (its actions wait only for their inputs).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleGPipe
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

from ..errors import RunError
from ..schedule import Action, Kind

__all__ = ["mirror_groups", "mirror_stage", "BidirectionalSchedule"]


def mirror_groups(pp: int, pp_rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The up pipeline's group (the same ranks as the down one, a separate stream of messages) and this rank's pair
    group {r, pp - 1 - r}; every rank creates every group, in the same order (torch's rule for `new_group`)."""
    up = dist.new_group(list(range(pp)))
    pair: dist.ProcessGroup | None = None
    for r in range(pp // 2):
        g = dist.new_group([r, pp - 1 - r])
        pair = g if pp_rank in (r, pp - 1 - r) else pair
    if pair is None:
        raise RunError(f"pipeline rank {pp_rank} is outside the {pp} ranks of its mirror groups")
    return up, pair


def mirror_stage(stage: Stage, up_group: dist.ProcessGroup) -> None:
    """Make `stage` a stage of the up pipeline: its messages on `up_group`, stage s on group rank p - 1 - s."""
    stage.group = up_group
    stage.stage_index_to_group_rank = {s: stage.num_stages - 1 - s for s in range(stage.num_stages)}


class BidirectionalSchedule:
    """One rank's Chimera step: its down and up stages driven by `order` (global microbatch ids), with torch's
    `step(*args, target=..., losses=...)` signature as the runner calls it."""

    def __init__(self, stages: Sequence[Stage], order: Sequence[Action], n_microbatches: int, loss_fn: Any,
                 pair: dist.ProcessGroup) -> None:
        down = [s for s in stages if s.stage_index_to_group_rank[s.stage_index] == s.stage_index]
        up = [s for s in stages if s not in down]
        if len(down) != 1 or len(up) != 1:
            raise RunError(f"two pipelines need one down and one up stage per rank, got stages "
                           f"{[s.stage_index for s in stages]}")
        self._m, self._half, self._order, self._pair = n_microbatches, n_microbatches // 2, list(order), pair
        self._stages = (down[0], up[0])
        self._chains = tuple(ScheduleGPipe(s, n_microbatches, loss_fn=loss_fn) for s in self._stages)
        self._keep = True

    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None, return_outputs: bool = True
             ) -> None:
        """Run the order over the whole batch `args` (split into m microbatches), then sum the replicas; the last
        stages keep their outputs (`output_chunks`, never merged here) only with `return_outputs`."""
        self._keep = return_outputs
        arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(args, {}, self._m)
        targets = [t[0] for t in split_args_kwargs_into_chunks((target,), {}, self._m)[0]] \
            if target is not None else None
        for chain, stage in zip(self._chains, self._stages):
            stage.has_backward = True
            stage.clear_runtime_states()
        for up, chain in enumerate(self._chains):  # down first on every rank: each pipeline's warm-up in turn
            first = up * self._half
            chain._initialize_stage(arg_mbs[first], kwarg_mbs[first], targets[first] if targets else None)
        mb_losses: dict[int, torch.Tensor] = {}
        sends: list[Any] = []
        for action in self._order:
            sends += self._run(action, arg_mbs, kwarg_mbs, targets, mb_losses)
        for work in sends:
            work.wait()
        for stage in self._stages:
            stage.scale_grads(self._m)  # each replica's sum over its m / 2 microbatches, / m: the mean loss's share
        self._sum_replicas()
        if losses is not None and mb_losses:
            losses.clear()
            losses.extend(mb_losses[k] for k in sorted(mb_losses))

    def _run(self, action: Action, arg_mbs: list[Any], kwarg_mbs: list[Any], targets: list[Any] | None,
             mb_losses: dict[int, torch.Tensor]) -> list[Any]:
        """One action: wait for its inputs, compute, post its sends (returned, waited at the end)."""
        k = action.microbatch
        up = int(k >= self._half)
        stage, chain = self._stages[up], self._chains[up]
        if stage.stage_index != action.stage:
            raise RunError(f"{action} names stage {action.stage}, but this rank's "
                           f"{'up' if up else 'down'} stage is {stage.stage_index}")
        if action.kind is Kind.F:
            _wait(stage.get_fwd_recv_ops(k))
            output = stage.forward_one_chunk(k, arg_mbs[k], kwarg_mbs[k], save_forward_output=self._keep)
            if stage.is_last:
                assert targets is not None  # the runner passes the target to every rank holding a last stage
                mb_losses[k] = chain._compute_loss(output, targets[k])
            return _post(stage.get_fwd_send_ops(k))
        if action.kind is not Kind.B:
            raise RunError(f"the two pipelines run full backwards only, got {action}")
        _wait(stage.get_bwd_recv_ops(k))
        last = k == (self._m - 1 if up else self._half - 1)
        stage.backward_one_chunk(k, loss=mb_losses.get(k) if stage.is_last else None, full_backward=True,
                                 last_backward=last)
        return _post(stage.get_bwd_send_ops(k))

    def _sum_replicas(self) -> None:
        """All-reduce every gradient with the other replica of its stage: the pair lays its two stages out in stage
        order (rank r holds stages r and p - 1 - r as down / up; its mirror the same two as up / down). One
        all-reduce per dtype over the gradients flattened into one buffer, as the cost model charges it (one
        collective of the bytes, as DDP's buckets): one per parameter paid gloo's latency 77 times a step on
        examples/gpt.py (measured 1.94x the predicted step, docs/schedules.md)."""
        grads: dict[torch.dtype, list[torch.Tensor]] = {}
        for stage in sorted(self._stages, key=lambda s: s.stage_index):
            for p in stage.submod.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.setdefault(p.grad.dtype, []).append(p.grad)
        for same in grads.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self._pair)
            for g, part in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(part.view_as(g))


def _wait(ops: list[dist.P2POp]) -> None:
    for work in _post(ops):
        work.wait()


def _post(ops: list[dist.P2POp]) -> list[Any]:
    return list(dist.batch_isend_irecv(ops)) if ops else []
