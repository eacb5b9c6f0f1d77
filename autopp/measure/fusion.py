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
- **What the backward reads** (`kept_bytes`): a fusing compiler does not keep an elementwise op's output for the
  backward when it can recompute it there from what is kept anyway; torch.compile's partitioner
  (`min_cut_rematerialization_partition`, torch/_functorch/partitioners.py) chooses the least bytes to save from
  which the backward can recompute every fusible op it needs; Transformer Engine's fused norm saves its input and
  1/rms (its LayerNormLinear keeps the norm's output as well, for the projection's weight gradient) and Megatron's
  fused SwiGLU its input. The count takes the same minimum over the pass's storages: a value a
  non-fusible op made (a matmul's, attention's output) or the pass did not make (its input) is kept if the backward
  needs it or anything recomputed from it; a fusible op's output is recomputed from its op's inputs, or kept, which
  ever the minimum cut of bytes chooses (one maximum flow, networkx); parameters and buffers are there for free.
  Hugging Face's RMSNorm in bf16 saves its float32 input, the `rsqrt` and the bf16 result for the backward (three
  times the hidden state's bf16 bytes); fused, it keeps its bf16 input. A value written in place depends on what
  each op that wrote it read (a non-fusible writer makes it kept). The backward's peak is counted from what is kept
  (autopp.measure.counting.count_piece). The recomputation itself is not charged (the backward's fused kernels read
  the kept values in place of the saved intermediates: about the same bytes).
- **What it leaves out:** fusion across a matmul's prologue or epilogue (a bias or a scale fused into the GEMM),
  which moves the elementwise op's bytes only once either way in this count's terms; under sequence parallelism,
  the gathered input that DTensor's (torchtitan's) column-parallel linears save: a TP rank's shard is counted
  without the gather, so a norm's output is recomputed from its (sharded) input, as Megatron-LM's linears, which
  save their input sharded and gather it again in the backward, do; the write of an intermediate the cut keeps
  although eager freed it (a smaller cast in place of what eager saved), which the pass's kernels count on chip.

Sources: PyTorch 2 (Ansel et al., ASPLOS 2024, s.4: TorchInductor's loop-level IR fuses pointwise, reduction and
scatter kernels "vertically" along producer-consumer edges); Transformer Engine's fused RMSNorm / LayerNorm kernels
and Megatron-LM's `--bias-swiglu-fusion`, `--masked-softmax-fusion` (arXiv:2205.05198, s.4.2 on fused kernels)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..costmodel.roofline import OpCounts

__all__ = ["FUSIBLE_PACKETS", "fusible", "OpTouches", "fuse_elementwise", "kept_bytes", "Kept", "kept_of"]


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
    sizes: dict[int, int] = field(default_factory=dict)
    """Storage serial -> its bytes (`kept_bytes`)."""
    rewritten: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Storage serial -> the ops that wrote it in place after the one that made it."""


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


def kept_bytes(t: OpTouches, needed: set[int], free: set[int]) -> set[int]:
    """The storages (serials) holding the fewest bytes (`t.sizes`) that a forward pass must keep for its backward to
    have every storage in `needed` (what autograd saved), fusible ops' outputs recomputed from their inputs where
    that keeps fewer bytes (module docstring, "What the backward reads"); storages in `free` (parameters, buffers)
    cost nothing. A minimum vertex cut between the values nothing cheap recomputes (non-fusible ops' outputs, the
    pass's inputs, anything a non-fusible op wrote in place, anything made from a value overwritten since) and
    `needed`, each storage a node of capacity its bytes; a storage written in place by fusible ops depends on what
    each of them read."""
    import networkx as nx  # the planning core and the ranks do not import it: only a count does

    graph: nx.DiGraph[Any] = nx.DiGraph()
    for serial, size in t.sizes.items():
        if serial in free:
            continue
        graph.add_edge(("in", serial), ("out", serial), capacity=size)
        maker = t.made.get(serial)
        writers = [] if maker is None else [maker, *t.rewritten.get(serial, ())]
        if not writers or not all(t.fusible[w] for w in writers):
            graph.add_edge("source", ("in", serial))  # no capacity: unbounded
            continue
        reads = [read for w in writers for read, _ in t.storages[w]
                 if read != serial and read not in free and t.made.get(read) != w]
        if any(later > min(writers) for read in reads for later in t.rewritten.get(read, ())):
            graph.add_edge("source", ("in", serial))  # what it was made from was overwritten since: kept
            continue
        for read in reads:
            graph.add_edge(("out", read), ("in", serial))
    for serial in needed - free:
        graph.add_edge(("out", serial), "sink")
    if "sink" not in graph or "source" not in graph:
        return set()
    _, (near, _far) = nx.minimum_cut(graph, "source", "sink")
    return {s for s in t.sizes if ("in", s) in near and ("out", s) not in near}


@dataclass(frozen=True)
class Kept:
    """What fused kernels keep of a forward for its backward, against what autograd saved (`kept_of`)."""

    kept: dict[int, int]
    """`storage_key` -> bytes of what they keep."""
    dropped: dict[int, int]
    """`storage_key` -> bytes of what autograd saved, alive at the forward's end, that they do not keep."""


def kept_of(t: OpTouches, saved: dict[int, int], keys: dict[int, int], free: set[int], untracked: dict[int, int]
            ) -> Kept:
    """`kept_bytes` by storage key: `saved` the serials autograd saved (-> bytes), `keys` serial -> `storage_key`,
    `free` the parameters' serials, `untracked` what autograd saved that no counted op touched (kept as it is)."""
    needed = {s for s in saved if s in t.alive}  # one freed before the forward's end is not needed
    chosen = kept_bytes(t, needed, free)
    return Kept({**{keys[s]: t.sizes[s] for s in chosen}, **untracked},
                {keys[s]: t.sizes[s] for s in needed - chosen - free})
