"""Sequence-chunked pipelining on torch's pipelining runtime (Seq1F1B): a K/V cache whose detached leaves collect the
gradient later chunks send to earlier chunks' K/V, fed back at the earlier chunk's own backward.

What torch does not have, and is added here (Seq1F1B, Sun et al., NAACL 2025; TeraPipe, Li et al., ICML 2021):
1. Units: a step of m microbatches of sequence length s becomes m x k rows of length s / k (row u = microbatch
   u // k, chunk u % k; `unit_rows`), run by torch's CSV schedule runtime as m x k microbatches of size 1 in the
   order `autopp.schedule.seqpipe.chunked_order` gives (`custom_schedule`, the runner's one use of that private API).
   torch's stages keep fixed buffers, so chunks here are equal in length (the planner's equal-cost lengths are not
   run).
2. `ChunkedAttention.attend`: each attention layer keeps the K/V of the earlier chunks of the sequence it is in (the
   forwards of a sequence's chunks run in order on every stage, so a counter says which chunk is next). The cache
   holds detached leaves, so a later chunk's backward does not run into the earlier chunk's graph (torch's stage
   backs up one unit at a time); their `.grad` collects what every later chunk's backward sends them.
3. `_FeedBack`: tied to the chunk's attention output; at the chunk's own backward (after the later chunks', the
   reverse chunk order of the schedule) it hands the collected gradient to the chunk's K and V, so the gradient
   reaches the projections that made them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ChunkedAttention", "unit_rows"]


class _FeedBack(torch.autograd.Function):
    """Identity on the attention output; its backward also returns, for the chunk's K and V, the gradient their
    cached leaves collected from later chunks (None when no later chunk read them)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaf_k: torch.Tensor,
                leaf_v: torch.Tensor) -> torch.Tensor:
        ctx.leaves = (leaf_k, leaf_v)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        leaf_k, leaf_v = ctx.leaves
        return grad, leaf_k.grad, leaf_v.grad, None, None


class ChunkedAttention:
    """Causal attention over a sequence that arrives in ``chunks`` pieces, one forward call each (chunks 1: plain
    causal attention). One per attention layer; calls without grad or on the meta device (torch's shape inference)
    neither read nor advance the cache."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.calls = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def offset(self) -> int:
        """Tokens of the current sequence before the next chunk (its first position)."""
        return sum(k.shape[-2] for k in self.keys) if self.calls % self.chunks else 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q K^T) V over this chunk's and the earlier chunks' K/V, causal; shapes (batch, heads, len, dim)."""
        if not torch.is_grad_enabled() or q.device.type == "meta":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.calls % self.chunks == 0:
            self.keys, self.values = [], []
        self.calls += 1
        prefix = sum(x.shape[-2] for x in self.keys)
        keys, values = torch.cat([*self.keys, k], dim=-2), torch.cat([*self.values, v], dim=-2)
        n = q.shape[-2]
        allowed = torch.ones(n, prefix + n, dtype=torch.bool, device=q.device).tril(prefix)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
        leaf_k, leaf_v = k.detach().requires_grad_(), v.detach().requires_grad_()
        self.keys.append(leaf_k)
        self.values.append(leaf_v)
        result: torch.Tensor = _FeedBack.apply(out, k, v, leaf_k, leaf_v)
        return result


def unit_rows(batch: torch.Tensor, chunks: int) -> torch.Tensor:
    """(m, s, ...) -> (m x k, s / k, ...): row u is microbatch u // k's chunk u % k."""
    m, s = batch.shape[0], batch.shape[1]
    if s % chunks:
        raise ValueError(f"sequence length must divide into equal chunks ({s} % {chunks} = {s % chunks})")
    return batch.reshape(m, chunks, s // chunks, *batch.shape[2:]).reshape(m * chunks, s // chunks,
                                                                            *batch.shape[2:])
