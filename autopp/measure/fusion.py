"""Elementwise kernel fusion in the count (`autopp profile --analytic DEVICE --kernels fused`).

Eager PyTorch runs every elementwise op as its own kernel, which reads its inputs from memory and writes its output
there: Hugging Face's RMSNorm is eight kernels (a float32 cast, `pow`, `mean`, `add`, `rsqrt`, `mul`, the cast back,
`mul` by the weight), each moving the whole hidden state. A fusing compiler (torch.compile's Inductor) or a library
of fused kernels (Transformer Engine's RMSNorm, bias-SwiGLU and softmax; Megatron's fused kernels) runs such a chain
as one kernel whose intermediates stay in registers: it reads the chain's inputs and writes what leaves the chain
(this count charges each op's reads from outside the chain, so an input two ops of one chain read counts twice: an
upper bound, 0.5 % of a Llama block's backward).
The trainers autopp plans for run them so (torchtitan with `compile`, Megatron-LM and NeMo on Transformer Engine).

The model, applied to one counted pass (a forward, a backward, a selective recomputation) of one unit:
- **Fusible ops** (`fusible`): those torch tags pointwise (`torch.Tag.pointwise`: arithmetic, activations, casts'
  elementwise kin), casts and copies (`_to_copy`, `clone`, `copy_`), reductions along a dimension (`sum`, `mean`,
  `amax`, `amin`, `var`, `var_mean`) and the softmax / log-softmax / layer-norm kernels and their backwards, which
  Inductor generates fused with their elementwise neighbours (a reduction's producers fused into it, its consumers
  into the next). Matmuls, attention kernels, indexing, gathers and scatters, `cat`, sorting and top-k, embedding
  and the loss are not: they run as they are counted (a conservative choice: Inductor fuses some indexing and `cat`
  into pointwise kernels, DeepEP fuses a mixture of experts' permutation with its dispatch).
- **An intermediate stays on chip** when a fusible op of the pass makes it (a new storage), every op of the pass
  that reads or writes it (through any view) is fusible, no other op runs between its making and its last use (a
  value live across a matmul is written and read back, as a kernel boundary forces), and it is freed before the pass
  ends: not saved for the backward, not the pass's output, not a parameter's gradient. Its bytes are taken off the
  ops that write and read it, and those ops become one kernel (one entry of the counts, one op's overhead:
  `OpCounts.load`).
- **Selective recomputation's rerun** is the forward's kernels less those of the ops whose outputs it keeps
  (`fuse_elementwise(..., drop=...)` on the forward's record): what the forward writes because the backward reads it,
  the rerun writes too. Counted on its own, under no_grad with the kept ops replayed, nothing it recomputes would
  look needed.
- **What it leaves out:** the compiler's recomputation of cheap elementwise ops in the backward instead of saving
  them (torch.compile's min-cut partitioner), so what is saved, and the memory the profile records (activation,
  peak bytes), are eager's, an upper bound; fusion across a matmul's prologue or epilogue (a bias or a scale fused
  into the GEMM), which moves the elementwise op's bytes only once either way in this count's terms.

Sources: PyTorch 2 (Ansel et al., ASPLOS 2024, s.4: TorchInductor's loop-level IR fuses pointwise, reduction and
scatter kernels "vertically" along producer-consumer edges); Transformer Engine's fused RMSNorm / LayerNorm kernels
and Megatron-LM's `--bias-swiglu-fusion`, `--masked-softmax-fusion` (arXiv:2205.05198, s.4.2 on fused kernels)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..costmodel.roofline import OpCounts

__all__ = ["FUSIBLE_PACKETS", "fusible", "OpTouches", "fuse_elementwise"]


aten = torch.ops.aten
#: Ops a fusing compiler puts in one kernel with their elementwise neighbours, beside those torch tags pointwise.
FUSIBLE_PACKETS = frozenset({
    aten._to_copy, aten.clone, aten.copy_, aten.sum, aten.mean, aten.amax, aten.amin, aten.var, aten.var_mean,
    aten._softmax, aten._softmax_backward_data, aten._log_softmax, aten._log_softmax_backward_data,
    aten.native_layer_norm, aten.native_layer_norm_backward})


def fusible(func: Any) -> bool:
    """Whether aten op `func` fuses with its elementwise neighbours (the module's docstring)."""
    return torch.Tag.pointwise in func.tags or func._overloadpacket in FUSIBLE_PACKETS


@dataclass(frozen=True)
class OpTouches:
    """What the ops of one pass touched, as `autopp.measure.counting.OpCounter` records it."""

    storages: tuple[tuple[tuple[int, int], ...], ...]
    """Per op: (storage serial, bytes moved through it) for each tensor it reads or writes, in the order counted."""
    fusible: tuple[bool, ...]
    """Per op: `fusible`."""
    made: dict[int, int]
    """Storage serial -> the op that made it (its first appearance, as an output that is none of the op's inputs)."""
    alive: frozenset[int]
    """The serials whose storage outlived the pass."""


def _on_chip(t: OpTouches) -> set[int]:
    """The intermediates that stay on chip: touched by fusible ops only (its maker among them), no other op between
    its making and its last use, freed."""
    users: dict[int, list[int]] = {}
    for i, touched in enumerate(t.storages):
        for serial, _ in touched:
            users.setdefault(serial, []).append(i)
    others = [0]  # others[i]: the ops before op i that are not fusible
    for fuses in t.fusible:
        others.append(others[-1] + (not fuses))
    return {s for s, maker in t.made.items() if s not in t.alive and all(t.fusible[i] for i in users[s])
            and others[max(users[s])] == others[maker]}


def fuse_elementwise(counts: OpCounts, touches: OpTouches, drop: Sequence[bool] = ()) -> OpCounts:
    """`counts` of one pass as fused kernels run it: the ops joined by intermediates that stay on chip (`_on_chip`)
    are one entry, whose bytes are its ops' less those intermediates', FLOPs summed, named by its ops joined with
    `+`; entries in the order of each kernel's first op. Other ops as counted. `drop`: per op, leave its kernel out
    (selective recomputation's rerun of a forward leaves out the ops whose outputs it keeps)."""
    n = len(counts.flops)
    if len(touches.storages) != n or len(drop) not in (0, n):
        raise ValueError(f"{len(touches.storages)} ops touched storages, {len(drop)} flagged, {n} were counted")
    chip = _on_chip(touches)
    root = list(range(n))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i
    first: dict[int, int] = {}
    for i, touched in enumerate(touches.storages):
        for serial, _ in touched:
            if serial in chip:
                j = first.setdefault(serial, i)
                root[find(i)] = find(j)
    kernels: dict[int, list[int]] = {}
    for i in range(n):
        kernels.setdefault(find(i), []).append(i)
    dropped = drop or (False,) * n
    groups: Sequence[list[int]] = sorted((ops for ops in kernels.values() if not any(dropped[i] for i in ops)),
                                         key=lambda ops: ops[0])
    linear = counts.linear or (False,) * n
    experts = counts.expert_weight or (0,) * n
    names = counts.names or ("",) * n
    kept = [counts.bytes[i] - sum(b for s, b in touches.storages[i] if s in chip) for i in range(n)]
    return OpCounts(tuple(sum(counts.flops[i] for i in g) for g in groups),
                    tuple(sum(kept[i] for i in g) for g in groups),
                    tuple(any(linear[i] for i in g) for g in groups),
                    tuple(sum(experts[i] for i in g) for g in groups),
                    tuple("+".join(names[i] for i in g) for g in groups) if counts.names else ())
