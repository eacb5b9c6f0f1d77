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


In `autopp run` (`SeqChunks`): a model file that declares `SEQUENCE_CHUNKS = True` promises that its attention is
`scaled_dot_product_attention(..., is_causal=True)` without a mask and that token positions reach it only through
its inputs (e.g. position ids given by `sample_batch`), every input and the target having the sequence on dimension
1. Its pieces are exported at s / k tokens (`chunk_example`), the batch becomes units (`unit_rows`), and around each
step a `TorchFunctionMode` (public, as `autopp.run.context` uses it for ring attention) sends every causal SDPA call
of a stage's forward to the `ChunkedAttention` of that call's place in the forward (the i-th attention of the
stage), so the exported graphs need no change. HF causal LMs of `CP_MODEL_TYPES` need no declaration: their rotary
tables, computed inside the model, are baked for positions 0..n-1 into every piece, so each earlier chunk's cached
key is turned to its true position relative to the current chunk (`rotated`) before it is attended.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..data.plan import Plan
from ..errors import RunError
from ..model.hf import CAUSAL_ATTENTION
from ..schedule import ScheduleName
from .context import SdpaMode
from .context_run import CP_MODEL_TYPES, rotary_modules

__all__ = ["ROPE", "ChunkedAttention", "SeqChunks", "check_seq_plan", "chunk_example", "chunked_steps",
           "chunks_supported", "rope_of", "rotated", "unit_rows"]

#: The stage-module attribute `build_stages` sets to the model's rotary frequencies (`rope_of`) for `SeqChunks`.
ROPE = "autopp_rope"


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

    def __init__(self, chunks: int, rope: torch.Tensor | None = None) -> None:
        self.chunks = chunks
        # a rotary embedding's inverse frequencies when every chunk's K and Q arrive rotated for the chunk's own
        # positions 0..n-1 (`rotated`); None: rotated for their true positions, or not at all
        self.rope = rope
        self.calls = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def offset(self) -> int:
        """Tokens of the current sequence before the next chunk (its first position)."""
        return sum(k.shape[-2] for k in self.keys) if self.calls % self.chunks else 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """softmax(q K^T) V over this chunk's and the earlier chunks' K/V, causal; shapes (batch, heads, len, dim)."""
        if not torch.is_grad_enabled() or q.device.type == "meta":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        if self.calls % self.chunks == 0:
            self.keys, self.values = [], []
        self.calls += 1
        prefix = sum(x.shape[-2] for x in self.keys)
        earlier = self.keys if self.rope is None else \
            [rotated(x, -sum(y.shape[-2] for y in self.keys[j:]), self.rope) for j, x in enumerate(self.keys)]
        keys, values = torch.cat([*earlier, k], dim=-2), torch.cat([*self.values, v], dim=-2)
        n = q.shape[-2]
        allowed = torch.ones(n, prefix + n, dtype=torch.bool, device=q.device).tril(prefix)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale)
        leaf_k, leaf_v = k.detach().requires_grad_(), v.detach().requires_grad_()
        self.keys.append(leaf_k)
        self.values.append(leaf_v)
        result: torch.Tensor = _FeedBack.apply(out, k, v, leaf_k, leaf_v)
        return result


def rotated(x: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` (..., len, dim) turned by ``delta`` positions of a rotary embedding with ``inv_freq`` (dim / 2), in the
    half-split layout of HF's `rotate_half`. Rotations compose, R(a) R(b) = R(a + b), and a score depends on the
    positions of query and key only through their difference: an earlier chunk's key rotated for its own positions
    0..n-1 and turned by -(tokens from it to the current chunk) scores against the current chunk's query (also
    rotated for 0..n-1) as both would at their true positions."""
    angles = delta * inv_freq.to(torch.float32)
    emb = torch.cat([angles, angles])
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def unit_rows(batch: torch.Tensor, chunks: int, microbatch_size: int = 1) -> torch.Tensor:
    """(m x b, s, ...) -> (m x k x b, s / k, ...): microbatch u of the result (b rows) is microbatch u // k's chunk
    u % k."""
    rows, s, rest = batch.shape[0], batch.shape[1], batch.shape[2:]
    if s % chunks:
        raise ValueError(f"sequence length must divide into equal chunks ({s} % {chunks} = {s % chunks})")
    m, n = rows // microbatch_size, s // chunks
    units = batch.reshape(m, microbatch_size, chunks, n, *rest).transpose(1, 2)
    return units.reshape(m * chunks * microbatch_size, n, *rest).contiguous()


def chunk_example(example: Sequence[Any], chunks: int) -> tuple[Any, ...]:
    """A sample batch's first chunk: every tensor with a sequence dimension (dim >= 2) cut to its first s / k
    positions, the shapes the stages are exported and built with."""
    return tuple(t[:, :t.shape[1] // chunks] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t
                 for t in example)


def check_seq_plan(plan: Plan, declared: bool) -> None:
    """Refuse, in one line, a sequence-chunked plan the runner does not run: a model file that does not declare
    `SEQUENCE_CHUNKS` (`declared`), a layout beyond pipeline and data parallelism, or chunks of a sequence that
    does not split into equal lengths."""
    seq = plan.seq_chunks
    if seq is None:
        return
    k, tokens = len(seq.lengths), sum(seq.lengths)
    name, plain = plan.schedule.value, ScheduleName.ONE_F_ONE_B.value
    if not declared:
        raise RunError(f"{plan.model_path}: {name} runs model files that declare SEQUENCE_CHUNKS = True (causal "
                       f"SDPA attention, positions given as inputs; e.g. tests/models/seqlm.py) and HF causal LMs of "
                       f"{', '.join(CP_MODEL_TYPES)} (docs/sequence-pipelining.md); re-plan with --schedule {plain}")
    layout = plan.layout
    if layout.tp > 1 or layout.cp > 1 or layout.ep > 1 or not layout.zero.replicated or plan.vocab is not None:
        raise RunError(f"{name}: autopp run runs sequence chunks with pipeline and data parallelism only (plan has "
                       f"{layout.describe()}, {layout.zero}); re-plan with `--tp 1 --zero 0`")
    if tokens % k:
        raise RunError(f"{name}: autopp run runs chunks of equal length, and {tokens} tokens do not split into {k} "
                       f"({tokens} % {k} = {tokens % k}); re-plan with --seq-len a multiple of {k}")


def chunks_supported(declared: bool, model: nn.Module) -> bool:
    """Whether the runner may run `model` in sequence chunks: its model file declares SEQUENCE_CHUNKS, or it is an
    HF causal LM whose positions enter through its one rotary embedding (`CP_MODEL_TYPES`, as context parallelism
    checks them), whose chunks are rotated for positions 0..n-1 and turned to their true ones (`rotated`)."""
    if declared:
        return True
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in CP_MODEL_TYPES and \
        getattr(config, "_attn_implementation", None) == CAUSAL_ATTENTION and len(rotary_modules(model)) == 1


def rope_of(model: nn.Module, declared: bool) -> torch.Tensor | None:
    """The inverse frequencies of an HF causal LM's rotary embedding (`chunks_supported`); None for a model file
    that declares SEQUENCE_CHUNKS (its positions are inputs, so every chunk is rotated for its true positions)."""
    if declared:
        return None
    (name,) = rotary_modules(model)
    inv_freq = model.get_submodule(name).inv_freq
    assert isinstance(inv_freq, torch.Tensor)  # rotary_modules: the modules holding an inv_freq buffer
    return inv_freq.detach().clone()


class SeqChunks:
    """The K/V caches of one rank's stages: per stage, one `ChunkedAttention` per causal SDPA call of its forward, in
    call order (a forward pre-hook on each stage module restarts the count)."""

    def __init__(self, modules: Sequence[nn.Module], chunks: int, rope: torch.Tensor | None = None) -> None:
        self.chunks, self.rope = chunks, rope
        self.caches: dict[tuple[int, int], ChunkedAttention] = {}
        self.place: tuple[int, int] | None = None
        for i, module in enumerate(modules):
            module.register_forward_pre_hook(partial(self._enter, i))

    def _enter(self, index: int, module: nn.Module, args: Any) -> None:
        self.place = (index, 0)

    def sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        """scaled_dot_product_attention's arguments; causal attention over the chunks seen so far."""
        if self.place is None or not torch.is_grad_enabled():  # outside a stage's forward: as asked
            return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                  enable_gqa=enable_gqa)
        if not is_causal or attn_mask is not None or dropout_p:
            raise RunError(f"sequence chunks need causal attention without a mask or dropout (is_causal "
                           f"{is_causal}, mask {'given' if attn_mask is not None else 'none'}, dropout {dropout_p})")
        if key.shape[1] != query.shape[1]:  # grouped-query attention: each K/V head serves query heads in turn
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        stage, call = self.place
        self.place = (stage, call + 1)
        cache = self.caches.setdefault((stage, call), ChunkedAttention(self.chunks, self.rope))
        return cache.attend(query, key, value, scale)

    @contextlib.contextmanager
    def attention(self) -> Iterator[None]:
        """Inside, every causal scaled_dot_product_attention call of a stage's forward runs over its chunks."""
        with SdpaMode(self.sdpa):
            yield


def chunked_steps(schedule: Any, chunks: SeqChunks, microbatch_size: int) -> Any:
    """`schedule` (torch's CSV runtime over m x k units) whose `step` takes the step's whole sequences as the
    worker gives them: every input and the target become units (`unit_rows`), and the step runs with the stages'
    causal attention over their chunks (`SeqChunks.attention`)."""
    step = schedule.step

    def chunked(*args: Any, target: Any = None, losses: Any = None, **kwargs: Any) -> Any:
        rows = tuple(unit_rows(t, chunks.chunks, microbatch_size) for t in args)
        if target is not None:
            target = unit_rows(target, chunks.chunks, microbatch_size)
        with chunks.attention():
            return step(*rows, target=target, losses=losses, **kwargs)
    schedule.step = chunked
    return schedule
