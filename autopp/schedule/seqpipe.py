"""Sequence pipelining for causal models: chunk boundaries chosen by equal cost, per-unit costs, and the chunk count.

Seq1F1B (Sun et al., NAACL 2025) and TeraPipe (Li et al., ICML 2021) split each microbatch along the sequence into k
chunks that flow through the pipeline one after another as units; chunk c attends to its own tokens and to the K/V
of chunks 0..c-1, which stay alive until chunk c's backward (after the later chunks', `named.seq_1f1b`).

Where the unit costs come from (COST): a stage's per-microbatch forward (and backward) time is split into a linear
part, proportional to tokens (projections, MLP, norms), and an attention part, the score and value products, which
for token t costs in proportion to the t tokens it attends to. With y the fraction of the sequence before a point,
the cost of the prefix is C(y) = (1 - a) y + a y^2 (C(1) = 1), ``a`` being the attention share of the stage's time.
A chunk [y0, y1) costs C(y1) - C(y0) of the microbatch; equal-cost chunks solve C(y_j) = j / k, so they are shorter
at the end. ``a`` comes from `attention_share`, the FLOP count of a decoder layer (Narayanan et al. 2021, eq. 3,
with GQA and a gated MLP): analytic profiles are FLOP counts, so the share is theirs; for a measured profile it is an
assumption (attention and matmuls at the same efficiency), stated with every table that uses it. The backward is
taken to split the same way. Activation bytes are linear in tokens (flash attention keeps no s x s scores), except
that each chunk saves the K/V of its whole prefix for its backward: a unit holds (1 - kv) l / s + kv (P + l) / s of
the microbatch's bytes, kv being the K/V share (`kv_share`), l its length and P the tokens before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from autopp.errors import ScheduleError
from autopp.schedule.actions import Action, Kind
from autopp.schedule.descriptors import ScheduleName, describe
from autopp.schedule.effects import StageCost, rank_static_bytes
from autopp.schedule.named import seq_1f1b
from autopp.schedule.simulate import SimResult, simulate

__all__ = ["LayerShape", "ChunkCosts", "Candidate", "SeqChoice", "attention_share", "kv_share", "kv_share_of",
           "chunk_lengths", "chunk_costs", "unit_costs", "chunked_order", "chunk_peaks", "simulate_units",
           "simulate_chunks", "choose_chunks"]


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """What the FLOP and byte shares of a causal decoder layer depend on."""

    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    seq_len: int
    gated: bool = True
    """SwiGLU-style MLP (three matrices; Llama) rather than two."""


def attention_share(shape: LayerShape) -> float:
    """Share of a layer's forward FLOPs in the causal score and value products.

    Per token: Q and O projections 4h^2, K and V 4h h_kv (h_kv = h kv_heads / heads), MLP 6hf gated (4hf plain);
    QK^T and AV 4ht over the t tokens it attends, 2hs on average under a causal mask."""
    h, s = shape.hidden, shape.seq_len
    h_kv = h * shape.kv_heads / shape.heads
    linear = 4 * h * h + 4 * h * h_kv + (6 if shape.gated else 4) * h * shape.ffn_hidden
    attention = 2 * h * s
    return attention / (linear + attention)


def kv_share(shape: LayerShape) -> float:
    """Share of a layer's kept activation bytes that are K and V: 4 s b h_kv of the 34 s b h bytes of Korthikanti et
    al. 2022, Table 2 (16-bit values, no s x s scores: flash attention)."""
    return kv_share_of(shape.heads, shape.kv_heads)


def kv_share_of(heads: int, kv_heads: int) -> float:
    """`kv_share` from the head counts alone: 4 h kv_heads / heads of 34 h."""
    return 4 * kv_heads / heads / 34


def _prefix_cost(y: float, share: float) -> float:
    return (1 - share) * y + share * y * y


def _point(target: float, share: float) -> float:
    """y with C(y) = target (COST); the root of share y^2 + (1 - share) y - target in [0, 1]."""
    if share <= 0:
        return target
    return (-(1 - share) + math.sqrt((1 - share) ** 2 + 4 * share * target)) / (2 * share)


def chunk_lengths(seq_len: int, chunks: int, share: float, multiple: int = 1) -> tuple[int, ...]:
    """Lengths of ``chunks`` pieces of a sequence, boundaries at equal cost (COST), each a multiple of ``multiple``."""
    if chunks < 1 or multiple < 1:
        raise ScheduleError(f"sequence pipelining needs `chunks` >= 1 and a multiple >= 1 ({chunks}, {multiple})")
    if not 0 <= share < 1:
        raise ScheduleError(f"the attention share must be in [0, 1) ({share:g})")
    if seq_len % multiple or seq_len < chunks * multiple:
        raise ScheduleError(f"sequence pipelining needs `seq_len` a multiple of {multiple} and >= chunks x {multiple}"
                            f" ({seq_len}, {chunks} chunks)")
    blocks = seq_len // multiple
    cuts = [0]
    for j in range(1, chunks):
        at = round(_point(j / chunks, share) * blocks)
        cuts.append(min(max(at, cuts[-1] + 1), blocks - (chunks - j)))
    cuts.append(blocks)
    return tuple((b - a) * multiple for a, b in zip(cuts, cuts[1:]))


class ChunkCosts(NamedTuple):
    """Per chunk: its length, and the shares of one microbatch's time and kept bytes its unit takes."""

    lengths: tuple[int, ...]
    time: tuple[float, ...]
    memory: tuple[float, ...]


def chunk_costs(lengths: Sequence[int], share: float, kv: float) -> ChunkCosts:
    """Time and memory shares of each chunk of a sequence split into ``lengths`` (COST)."""
    total = sum(lengths)
    starts = [sum(lengths[:c]) for c in range(len(lengths))]
    time = tuple(_prefix_cost((p + n) / total, share) - _prefix_cost(p / total, share)
                 for p, n in zip(starts, lengths))
    memory = tuple(((1 - kv) * n + kv * (p + n)) / total for p, n in zip(starts, lengths))
    return ChunkCosts(tuple(lengths), time, memory)


def unit_costs(cost: StageCost, chunks: ChunkCosts) -> StageCost:
    """One unit's cost on a stage, for the simulator's timing: times x the largest chunk time share (equal-cost
    chunks differ only by rounding, so this is their common time to within one ``multiple`` of tokens); bytes x
    the largest memory share, outputs x the largest chunk's share of the tokens (`chunk_peaks` counts each
    chunk's own). The per-message overhead is per unit, unscaled:
    this is where many short chunks lose. Under keep only: the policies' own figures are dropped. ZeRO 2's streamed
    scatter (`StageCost.scatter_s`) x the share too: the microbatch's one scatter spread over its chunks' backwards."""
    t, b = max(chunks.time), max(chunks.memory)
    scaled = None if cost.backward_s is None else cost.backward_s * t
    return replace(cost, forward_s=cost.forward_s * t, backward_input_s=cost.backward_input_s * t,
                   backward_weight_s=cost.backward_weight_s * t, backward_s=scaled,
                   forward_comm_s=cost.forward_comm_s * t, backward_comm_s=cost.backward_comm_s * t,
                   scatter_s=cost.scatter_s * t,
                   recompute_s=None if cost.recompute_s is None else cost.recompute_s * t,
                   activation_bytes=math.ceil(cost.activation_bytes * b),
                   output_bytes=math.ceil(cost.output_bytes * max(chunks.lengths) / sum(chunks.lengths)),
                   input_bytes=math.ceil(cost.input_bytes * b), transient_bytes=math.ceil(cost.transient_bytes * b),
                   own=())


def chunked_order(num_ranks: int, num_microbatches: int, chunks: int) -> dict[int, list[Action]]:
    """Every rank's Seq1F1B order over ``num_microbatches`` x ``chunks`` units (`named.seq_1f1b`)."""
    describe(ScheduleName.SEQ_1F1B).validate(num_ranks, num_microbatches)
    return {r: seq_1f1b(r, num_ranks, num_microbatches, 1, chunks) for r in range(num_ranks)}


@lru_cache(maxsize=16)
def _order(num_ranks: int, num_microbatches: int, chunks: int) -> dict[int, list[Action]]:
    """`chunked_order`, memoised for the search's many simulations of one configuration (callers do not mutate it)."""
    return chunked_order(num_ranks, num_microbatches, chunks)


def chunk_peaks(order: dict[int, list[Action]], costs: Sequence[StageCost], chunks: ChunkCosts) -> list[int]:
    """Per rank, the most bytes held running its order: static bytes, plus each unit's own share of its stage's
    activation bytes and its own part of the stage's outputs (a chunk's tokens' share: torch's stage keeps each
    unit's outputs until its backward, `StageCost.output_bytes`) from its F until its B ends (one stage per rank:
    allocations happen in list order), plus the largest transient (`effects.transient_peak`, scaled as
    `unit_costs`)."""
    k, owner = len(chunks.lengths), list(range(len(costs)))
    tokens = sum(chunks.lengths)
    peaks = []
    for r in sorted(order):
        held = peak = rank_static_bytes(costs, owner, r)
        for s, kind, unit in order[r]:
            size = math.ceil(costs[s].activation_bytes * chunks.memory[unit % k]) + \
                math.ceil(costs[s].output_bytes * chunks.lengths[unit % k] / tokens)
            if kind is Kind.F:
                held += size
                peak = max(peak, held)
            elif kind is Kind.B:
                held -= size
        peaks.append(peak + math.ceil(costs[r].transient_bytes * max(chunks.memory)))
    return peaks


class Candidate(NamedTuple):
    """One chunk count, simulated: its lengths, step time and the largest rank peak."""

    chunks: int
    lengths: tuple[int, ...]
    step_time_s: float
    peak_bytes: int


@dataclass(frozen=True)
class SeqChoice:
    """The chunk count chosen and every candidate (chunks 1 is 1F1B itself)."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]


def simulate_units(costs: Sequence[StageCost], comm_s: Sequence[float], num_microbatches: int, chunks: ChunkCosts,
                   progress_s: Sequence[float] | None = None) -> SimResult:
    """Simulate one step of Seq1F1B with one stage per rank (``costs``: each stage's per-microbatch figures): units
    at `unit_costs`, each transfer and progress delay x the longest chunk's token share, every rank's peak from
    `chunk_peaks` (each unit's own bytes) rather than the simulator's (every unit at the largest share). A link's
    progress delay (`simulate`'s ``progress_s``) is its own, whatever the message size."""
    k, longest = len(chunks.lengths), max(chunks.lengths) / sum(chunks.lengths)
    order = _order(len(costs), num_microbatches, k)
    units = [unit_costs(c, chunks) for c in costs]
    result = simulate(order, units, list(range(len(costs))), [c * longest for c in comm_s], None, progress_s)
    return replace(result, peak_memory_bytes=chunk_peaks(order, costs, chunks))


def simulate_chunks(costs: Sequence[StageCost], comm_s: Sequence[float], num_microbatches: int, chunks: ChunkCosts
                    ) -> Candidate:
    """Simulate one step of Seq1F1B with one stage per rank (`simulate_units`): its step time and largest peak."""
    result = simulate_units(costs, comm_s, num_microbatches, chunks)
    return Candidate(len(chunks.lengths), chunks.lengths, result.step_time_s, max(result.peak_memory_bytes))


def choose_chunks(costs: Sequence[StageCost], comm_s: Sequence[float], num_microbatches: int, shape: LayerShape,
                  candidates: Sequence[int] = (1, 2, 4, 8), memory_limit: int | None = None,
                  multiple: int = 1) -> SeqChoice:
    """The chunk count with the shortest simulated step whose peak fits ``memory_limit`` (ties: fewer chunks);
    chunks 1 is plain 1F1B, so sequence pipelining is chosen only where it wins. Raises ScheduleError when none
    fits."""
    share, kv = attention_share(shape), kv_share(shape)
    tried = tuple(simulate_chunks(costs, comm_s, num_microbatches,
                                  chunk_costs(chunk_lengths(shape.seq_len, k, share, multiple), share, kv))
                  for k in candidates)
    fits = [c for c in tried if memory_limit is None or c.peak_bytes <= memory_limit]
    if not fits:
        least = min(c.peak_bytes for c in tried)
        raise ScheduleError(f"no chunk count fits `memory_limit` (least peak {least / 1e9:.2f} GB > "
                            f"{(memory_limit or 0) / 1e9:.2f} GB)")
    return SeqChoice(min(fits, key=lambda c: (c.step_time_s, c.chunks)), tried)
