"""Vocabulary parallelism (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism", MLSys 2025):
the input embedding and the output layer with its softmax cross-entropy split evenly along the vocabulary over all
p pipeline ranks, run as extra passes beside torch's pipeline schedule.

Per microbatch k the ranks run, on a gloo group of their own (never the pipeline's point-to-point group):
- the input pass, at the start of the step: rank r looks the tokens up in its vocabulary slice (zero rows
  elsewhere) and the partial embeddings are summed onto pipeline rank 0 (`reduce`), which feeds them to stage 0;
- the output pass (the paper's S and T passes, fused): the last stage's hidden states are broadcast to every rank;
  rank r computes its logits shard h W_r^T and, per token, its local maximum, sum of exponentials and target logit;
  one all-gather of these three numbers per token gives every rank the log-normaliser (online-softmax rescaling,
  as the paper's Vocab-2 variant: one collective for the softmax; Vocab-1, as the plan says: an all-reduce of the
  maximum, then one of the sums of exponentials relative to it and the target logit); rank r then forms its
  softmax gradient shard, its weight gradient dW_r locally, and a partial dh, summed back onto the last stage
  (`reduce`);
- the input backward, at the end of the step: stage 0's input gradients are broadcast, and each rank scatters them
  into its embedding rows.

Where the output pass runs. On the rank of the last stage it runs inside the backward of that stage's loss (the
loss is a `_VocabLoss` node whose backward is the pass), so B of the last stage for k waits for it. Every other
rank runs it just before posting its receive of the gradient of microbatch k (`get_bwd_recv_ops`, wrapped here):
that receive cannot complete before the last stage's B of k, which needs the pass, and every earlier action of
the rank depends only on forwards and on passes of earlier microbatches, so, passes running in microbatch order
on every rank, the collectives cannot deadlock. This works under torch's own schedule classes and its CSV runtime
alike: `_PipelineScheduleRuntime.register_custom_function` replaces a whole F/B/I/W action (its receive-wait
included), which would make the runner re-implement torch's actions; wrapping the stage's receive keeps torch's.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.stage import _PipelineStageBase as Stage
from torch.nn import functional as F

from ..data.vocab import VocabVariant
from ..errors import RunError
from ..model.vocab import VocabModules, body_model, check_cross_entropy, find_vocab_modules, hidden_states

__all__ = ["VocabModules", "find_vocab_modules", "vocab_bounds", "VocabShard", "body_model", "local_stats",
           "combine_stats", "global_sums", "shard_loss_grad", "hidden_states", "check_cross_entropy", "VocabRuntime"]


def vocab_bounds(vocab: int, ranks: int) -> list[tuple[int, int]]:
    """Rank r's vocabulary rows [lo, hi): an even split (sizes differ by one at most)."""
    if vocab < ranks:
        raise RunError(f"a vocabulary of {vocab} tokens cannot be split over {ranks} pipeline ranks")
    return [(r * vocab // ranks, (r + 1) * vocab // ranks) for r in range(ranks)]


class VocabShard(nn.Module):
    """Rank r's rows [lo, hi) of the embedding and of the head (one parameter when they are tied)."""

    def __init__(self, model: nn.Module, mods: VocabModules, lo: int, hi: int) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi
        pad = mods.padding_idx
        self.padding_idx = pad - lo if pad is not None and lo <= pad < hi else None
        emb, head = (model.get_submodule(n).get_parameter("weight") for n in (mods.embedding, mods.head))
        self.embedding = nn.Parameter(emb.detach()[lo:hi].clone())
        self.head = self.embedding if mods.tied else nn.Parameter(head.detach()[lo:hi].clone())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The partial embedding: the rows of the tokens in [lo, hi), zeros for the others."""
        here = (tokens >= self.lo) & (tokens < self.hi)
        local = torch.where(here, tokens - self.lo, torch.zeros_like(tokens))
        rows = F.embedding(local, self.embedding, padding_idx=self.padding_idx)
        return rows * here.unsqueeze(-1).to(self.embedding.dtype)


def local_stats(logits: torch.Tensor, target: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Per token (rows of `logits`, this rank's vocabulary columns [lo, hi)): its maximum, the sum of
    exponentials relative to it, and the target's logit (0 when the target is another rank's), as (N, 3)."""
    peak = logits.max(dim=1).values
    sum_exp = torch.exp(logits - peak.unsqueeze(1)).sum(dim=1)
    return torch.stack([peak, sum_exp, _picked(logits, target, lo, hi)], dim=1)


def _picked(logits: torch.Tensor, target: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Per token, the target's logit when it is in this rank's columns [lo, hi), else 0."""
    here = (target >= lo) & (target < hi)
    picked = logits.gather(1, torch.where(here, target - lo, torch.zeros_like(target)).unsqueeze(1)).squeeze(1)
    return picked * here.to(logits.dtype)


def global_sums(logits: torch.Tensor, target: torch.Tensor, lo: int, hi: int, peak: torch.Tensor) -> torch.Tensor:
    """Vocab-1's second collective's operand, per token: this rank's sum of exponentials relative to the maximum
    over every rank's logits (`peak`, the first collective's) and its target logit, as (N, 2); summed over the ranks
    they give the log-normaliser peak + log(sum) and the target logit."""
    return torch.stack([torch.exp(logits - peak.unsqueeze(1)).sum(dim=1), _picked(logits, target, lo, hi)], dim=1)


def combine_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From every rank's `local_stats` (p, N, 3): the log-normaliser log sum_v exp(l_v) and the target logit per
    token, rescaling each rank's sum to the common maximum (the online-softmax combination)."""
    peak = stats[:, :, 0].max(dim=0).values
    total = (stats[:, :, 1] * torch.exp(stats[:, :, 0] - peak.unsqueeze(0))).sum(dim=0)
    return peak + torch.log(total), stats[:, :, 2].sum(dim=0)


def shard_loss_grad(logits: torch.Tensor, target: torch.Tensor, lo: int, hi: int, log_z: torch.Tensor,
                    target_logit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy over the tokens and this rank's shard of its gradient with respect to the logits:
    (softmax - one-hot) / N on columns [lo, hi)."""
    n = logits.shape[0]
    grad = torch.exp(logits - log_z.unsqueeze(1))
    here = (target >= lo) & (target < hi)
    rows = torch.arange(n)[here]
    grad[rows, target[here] - lo] -= 1.0
    return (log_z - target_logit).mean(), grad / n


class _VocabLoss(torch.autograd.Function):
    """The last stage's loss for microbatch k: its value is known only after the output pass, which runs in its
    backward and returns dh (the value returned by forward is a placeholder 0; `VocabRuntime.losses` holds the
    losses)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, runtime: VocabRuntime, k: int) -> torch.Tensor:
        ctx.runtime, ctx.k = runtime, k
        ctx.save_for_backward(hidden)
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (hidden,) = ctx.saved_tensors
        dh = ctx.runtime.catch_up(ctx.k, hidden.detach())
        return dh * grad, None, None


class VocabRuntime:
    """One rank's vocabulary passes for one step of `n_microbatches` (call `begin`, run the schedule with
    `loss_fn` on the last stage and every stage `watch`ed, then `finish`)."""

    def __init__(self, shard: VocabShard, group: dist.ProcessGroup, rank: int, ranks: int,
                 n_microbatches: int, last_rank: int, variant: VocabVariant = VocabVariant.VOCAB_2) -> None:
        self.shard, self.group, self.rank, self.ranks = shard, group, rank, ranks
        self.variant = variant
        self.m, self.last_rank = n_microbatches, last_rank
        self.losses: list[float] = []
        self._targets: list[torch.Tensor] = []
        self._partials: list[torch.Tensor] = []
        self._fed: list[torch.Tensor] = []
        self._done = 0
        self._calls = 0
        self._hidden_shape: tuple[int, ...] = ()
        self._head_grad = torch.zeros_like(shard.head)

    def begin(self, tokens: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The input pass for every microbatch: partial embeddings summed onto pipeline rank 0. Returns, on rank 0,
        stage 0's inputs (leaves that collect their gradient); elsewhere an empty list."""
        self.losses, self._done, self._calls = [], 0, 0
        self._targets = [t.reshape(-1) for t in targets]
        self._partials, self._fed = [], []
        for tok in tokens:
            partial = self.shard.embed(tok)
            self._partials.append(partial)
            summed = partial.detach().clone()
            dist.reduce(summed, dst=dist.get_global_rank(self.group, 0), group=self.group)
            self._hidden_shape = tuple(summed.shape)
            if self.rank == 0:
                self._fed.append(summed.requires_grad_(True))
        return list(self._fed)

    def loss_fn(self, output: Any, _target: Any = None) -> torch.Tensor:
        """The last stage's loss for the next microbatch (the schedule calls it in microbatch order); `output` is
        the body's output: the hidden states, alone or as the one floating-point tensor of a structure (an HF
        model's output, whose logits the head-less body leaves as the hidden states)."""
        k, self._calls = self._calls, self._calls + 1
        out: torch.Tensor = _VocabLoss.apply(hidden_states(output), self, k)
        return out

    def watch(self, stage: Stage) -> None:
        """Run the output passes up to microbatch k before `stage` posts its receive of k's gradient."""
        post = stage.get_bwd_recv_ops

        def hooked(bwd_chunk_id: int) -> Any:  # torch's parameter name
            self.catch_up(bwd_chunk_id)
            return post(bwd_chunk_id)
        stage.get_bwd_recv_ops = hooked  # type: ignore[method-assign]

    def catch_up(self, k: int, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run the output passes of microbatches up to k not yet run (the last rank: only k, with its hidden
        states); returns dh of k on the last rank."""
        dh = None
        while self._done <= k:
            if self.rank == self.last_rank and (self._done != k or hidden is None):
                raise RunError(f"output pass of microbatch {self._done} requested out of order (at {k})")
            dh = self._output_pass(self._done, hidden)
            self._done += 1
        return dh

    def _output_pass(self, k: int, hidden: torch.Tensor | None) -> torch.Tensor:
        """Broadcast h, local logits and statistics, one all-gather, loss and gradients, dh reduced to the last."""
        shape = self._hidden_shape
        h = hidden.contiguous() if hidden is not None else torch.empty(shape, dtype=self.shard.head.dtype)
        dist.broadcast(h, src=dist.get_global_rank(self.group, self.last_rank), group=self.group)
        x = h.reshape(-1, shape[-1])
        target = self._targets[k]
        with torch.no_grad():
            logits = x @ self.shard.head.t()
            log_z, target_logit = self._normaliser(logits, target)
            loss, grad = shard_loss_grad(logits, target, self.shard.lo, self.shard.hi, log_z, target_logit)
            self.losses.append(float(loss))
            self._head_grad += grad.t() @ x
            dh = (grad @ self.shard.head).reshape(shape).contiguous()
        dist.reduce(dh, dst=dist.get_global_rank(self.group, self.last_rank), group=self.group)
        return dh

    def _normaliser(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, the log-normaliser over the whole vocabulary and the target logit: Vocab-2 with one
        all-gather of every rank's (max, sum of exponentials, target logit); Vocab-1 with two all-reduces, the
        maximum, then the sums relative to it."""
        lo, hi = self.shard.lo, self.shard.hi
        if self.variant is VocabVariant.VOCAB_1:
            peak = logits.max(dim=1).values
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
            sums = global_sums(logits, target, lo, hi, peak)
            dist.all_reduce(sums, group=self.group)
            return peak + torch.log(sums[:, 0]), sums[:, 1]
        stats = local_stats(logits, target, lo, hi)
        gathered = [torch.empty_like(stats) for _ in range(self.ranks)]
        dist.all_gather(gathered, stats, group=self.group)
        return combine_stats(torch.stack(gathered))

    def finish(self) -> None:
        """The input backward (stage 0's input gradients broadcast, scattered into each rank's rows) and the
        shards' gradients divided by the microbatch count, as torch scales the stages' (scale_grads)."""
        if self._done != self.m:
            raise RunError(f"{self._done} output passes ran for {self.m} microbatches")
        for k, partial in enumerate(self._partials):
            g = self._fed[k].grad if self.rank == 0 else None
            grad = g.contiguous() if g is not None else torch.zeros(self._hidden_shape, dtype=partial.dtype)
            dist.broadcast(grad, src=dist.get_global_rank(self.group, 0), group=self.group)
            partial.backward(grad / self.m)
        head_grad = self._head_grad / self.m
        self.shard.head.grad = head_grad if self.shard.head.grad is None else self.shard.head.grad + head_grad
        self._partials, self._fed = [], []
        self._head_grad = torch.zeros_like(self.shard.head)
