"""Context parallelism on a rank: each sequence sharded over a cp group, attention as torch's ring attention.

Why not torch's `context_parallel()`. In torch 2.13 it turns SDPA's q/k/v into sequence-sharded DTensors and relies
on DTensor dispatch, whose CP table (`torch/distributed/tensor/experimental/_context_parallel/_attention.py`,
`custom_ops`) has entries for `aten._scaled_dot_product_flash_attention`, `_efficient_attention` and
`_cudnn_attention` (and their backwards) only. On CPU, SDPA runs `aten._scaled_dot_product_flash_attention_for_cpu`,
so under `context_parallel()` on gloo ranks the call fails in sharding propagation: "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered"
(torch/distributed/tensor/_sharding_prop.py). Making that path work would mean writing into torch's module-global
dispatch table and DTensor's sharding-strategy registry.

What this module does instead (docs/parallelism.md, "Context parallelism on CPU ranks"): it calls the same ring
code those DTensor handlers call, torch's `_templated_ring_attention` and `_templated_ring_attention_backward`
(K/V rotation by all-gather or all-to-all, the log-sum-exp merge, the causal-mask skip and head-tail load
balancing), with the CPU per-block ops `aten._scaled_dot_product_flash_attention_for_cpu` and its backward, whose
(output, logsumexp) and (grad_q, grad_k, grad_v) results and argument names are what the templates expect. A
`TorchFunctionMode` (public) routes every `scaled_dot_product_attention` call inside `ring_attention()` to them
through an autograd Function. torch's private pieces are reached through `_torch_ring` only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Literal, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ..errors import ContextParallelError
from ..data.runner_rules import sequence_refusal

__all__ = ["RotateMethod", "RingConfig", "SdpaMode", "check_sequence", "check_attention", "shard_sequence",
           "ring_attention", "context_parallel_backward"]

#: How K/V shards travel: "allgather" (one all-gather per attention, torch's default) or "alltoall" (a ring step).
RotateMethod = Literal["allgather", "alltoall"]
SEQ_DIM = 2  # q, k, v are (batch, heads, seq, head_dim), as SDPA and torch's ring templates take them
_aten = torch.ops.aten
_SDPA_FUNCS = (F.scaled_dot_product_attention, _aten.scaled_dot_product_attention.default)


@dataclass(frozen=True, kw_only=True)
class RingConfig:
    """What the ring attention of one cp group needs to know."""

    group: dist.ProcessGroup
    """The cp ranks holding one sequence's shards, in sequence order."""
    balance: bool = True
    """Head-tail load balancing for causal masks: rank r holds chunks r and 2cp-1-r of 2cp equal chunks."""
    rotate: RotateMethod = "allgather"
    """How K/V shards travel in the forward (torch's backward always rotates gradients all-to-all)."""


@dataclass(frozen=True)
class _TorchRing:
    forward: Callable[..., tuple[torch.Tensor, ...]]
    backward: Callable[..., tuple[torch.Tensor, ...]]
    head_tail: Callable[[int, int], torch.Tensor]


@contextlib.contextmanager
def _torch_ring(config: RingConfig) -> Iterator[_TorchRing]:
    """The one door to torch's private context-parallel code (torch 2.13, `torch.distributed.tensor.experimental.
    _context_parallel`): its templated ring forward/backward, its head-tail load balancer's indices, and the module-
    global `_cp_options` those templates read (load balancing, rotation), set for the call and restored after."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    def head_tail(seq_len: int, cp_size: int) -> torch.Tensor:
        return _HeadTailLoadBalancer(seq_len, cp_size, "cpu")._generate_indices()[0]

    options = cp._cp_options
    saved = (options.enable_load_balance, options.rotate_method)
    options.enable_load_balance = config.balance
    cp.set_rotate_method(config.rotate)
    try:
        yield _TorchRing(cp._templated_ring_attention, cp._templated_ring_attention_backward, head_tail)
    finally:
        options.enable_load_balance, options.rotate_method = saved


def check_sequence(seq_len: int, cp: int, balance: bool) -> None:
    """Raise ContextParallelError unless a sequence of `seq_len` tokens splits evenly over `cp` ranks (into 2·cp
    chunks with causal load balancing, as torch's head-tail balancer and torchtitan require)."""
    if why := sequence_refusal(seq_len, cp, balance):
        raise ContextParallelError(why)


def shard_sequence(tensor: torch.Tensor, seq_dim: int, config: RingConfig) -> torch.Tensor:
    """This rank's shard of `tensor` along `seq_dim` (inputs, labels, positions): a contiguous 1/cp chunk, or with
    load balancing the head-tail pair of chunks torch's ring templates assume."""
    cp, rank = dist.get_world_size(config.group), dist.get_rank(config.group)
    check_sequence(tensor.shape[seq_dim], cp, config.balance)
    if config.balance:
        with _torch_ring(config) as ring:
            order = ring.head_tail(tensor.shape[seq_dim], cp).to(tensor.device, torch.long)
        tensor = tensor.index_select(seq_dim, order)
    return tensor.chunk(cp, dim=seq_dim)[rank].contiguous()


def check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: object, dropout_p: float,
                    is_causal: bool, balance: bool) -> None:
    """Raise ContextParallelError unless torch's ring templates compute this SDPA call (its arguments as SDPA takes
    them) exactly: 4-D q/k/v, no mask, no dropout, causal when load-balanced, equal q/kv lengths when causal."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ContextParallelError(f"ring attention needs 4-D (batch, heads, seq, dim) q/k/v, got {q.dim()}-D, "
                                   f"{k.dim()}-D, {v.dim()}-D")
    if attn_mask is not None:
        shape = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
        raise ContextParallelError(f"ring attention takes no attn_mask (got {shape}); use is_causal=True and no "
                                   "padding mask")
    if dropout_p != 0.0:
        raise ContextParallelError(f"ring attention needs dropout_p == 0 (got {dropout_p:g})")
    if balance and not is_causal:
        raise ContextParallelError("causal load balancing needs is_causal=True attention (got is_causal=False)")
    if is_causal and q.shape[SEQ_DIM] != k.shape[SEQ_DIM]:
        raise ContextParallelError(f"causal ring attention needs equal q and k/v lengths (q {q.shape[SEQ_DIM]}, "
                                   f"k/v {k.shape[SEQ_DIM]})")
    if q.shape[1] % k.shape[1]:
        raise ContextParallelError(f"query heads must be a multiple of key/value heads ({q.shape[1]} vs "
                                   f"{k.shape[1]})")


class _RingAttention(torch.autograd.Function):
    """torch's ring forward and backward around the CPU flash-attention ops, over `config.group`."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float | None, config: RingConfig) -> torch.Tensor:
        with _torch_ring(config) as ring:
            out, lse = ring.forward(config.group, SEQ_DIM, _aten._scaled_dot_product_flash_attention_for_cpu,
                                    q, k, v, is_causal=causal, dropout_p=0.0, scale=scale)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.config = causal, scale, config
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        with _torch_ring(ctx.config) as ring:
            dq, dk, dv = ring.backward(ctx.config.group, SEQ_DIM,
                                       _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                                       grad_out=grad_out.contiguous(), grad_out_name="grad_out", query=q, key=k,
                                       value=v, out=out, logsumexp=lse, is_causal=ctx.causal, dropout_p=0.0,
                                       scale=ctx.scale)[:3]
        return dq, dk, dv, None, None, None


def _ring_sdpa(config: RingConfig, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: object = None, dropout_p: float = 0.0, is_causal: bool = False,
               scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA's signature, computed by ring attention (grouped K/V heads expanded as SDPA's math path does)."""
    check_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    balance=config.balance)
    if query.shape[1] != key.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    out: torch.Tensor = _RingAttention.apply(query, key.contiguous(), value.contiguous(), is_causal, scale, config)
    return out


class SdpaMode(TorchFunctionMode):
    """Sends scaled_dot_product_attention (the Python function or the aten op) to `route`, which takes SDPA's
    arguments: ring attention here, sequence chunks' cache in autopp.run.seq_chunks."""

    def __init__(self, route: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.route = route

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in _SDPA_FUNCS:
            return self.route(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def ring_attention(config: RingConfig) -> Iterator[None]:
    """Inside, every scaled_dot_product_attention call on this thread computes attention of this rank's query shard
    against the whole sequence's K/V over `config.group` (its backward too, whenever it runs). Inputs must already be
    sharded with `shard_sequence` under the same config."""
    with SdpaMode(partial(_ring_sdpa, config)):
        yield


def context_parallel_backward(model: nn.Module, loss_fn: Callable[[Sequence[torch.Tensor]], torch.Tensor],
                              batch: Sequence[torch.Tensor], seq_dims: Sequence[int],
                              config: RingConfig) -> torch.Tensor:
    """One forward and backward of `loss_fn(local batch)` (a mean over this rank's tokens) with `batch` sharded along
    `seq_dims` over the cp group; the gradients of `model` are then averaged over the group, so every rank holds the
    full-sequence gradients, and the full-sequence loss (the mean of the ranks' losses) is returned."""
    if len(batch) != len(seq_dims):
        raise ContextParallelError(f"one sequence dimension per batch tensor ({len(batch)} tensors, "
                                   f"{len(seq_dims)} dims)")
    local = [shard_sequence(t, d, config) for t, d in zip(batch, seq_dims)]
    with ring_attention(config):
        loss = loss_fn(local)
        loss.backward()
    cp = dist.get_world_size(config.group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=config.group)
            p.grad.div_(cp)
    total = loss.detach().clone()
    dist.all_reduce(total, group=config.group)
    return total / cp
