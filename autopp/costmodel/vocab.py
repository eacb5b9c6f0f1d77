"""Cost terms of vocabulary parallelism (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism",
MLSys 2025): the embedding (the first unit) and the head with its loss (the last unit) split evenly along the
vocabulary over all p pipeline ranks, as passes every rank runs per microbatch (autopp.run.vocab executes them).

Per microbatch and rank:
- compute: (F + B of the embedding) / p and (F + B of the head) / p, the vocabulary layers' FLOPs divided by p;
- communication on the rank's link (synchronous collectives: the rank waits for them, so they count as busy time):
  the input pass reduces the embedded tokens onto rank 0 and broadcasts their gradient back (2 x the bytes across
  the cut after the embedding); the output pass broadcasts the last stage's hidden states and reduces the partial
  dh back (2 x the bytes across the cut before the head); the softmax statistics (three floats per token, against
  4h bytes of hidden state per token) are counted by their latency: one collective per microbatch for Vocab-2,
  two for Vocab-1 (max, then sum of exponentials); each collective spans ceil(log2 p) link latencies (a tree);
- memory: the vocabulary layers' parameters, gradients and optimizer state / p on every rank (a tied embedding and
  head once); the logits shard is
  working memory of the pass (the head's activation bytes / p as a transient); the variant's extra in-flight
  microbatches of hidden states (the paper: Vocab-1 holds activations of p + 2 microbatches, Vocab-2 of p + 1,
  against 1F1B's p), held all step; and the input pass's outputs of every microbatch, held all step as the runner
  runs it (autopp.run.vocab: all m input passes at the step's start, their backward at its end, since torch's
  schedule takes the whole batch at `step`): each rank's m partial embeddings, and on rank 0 also the m summed
  embeddings it feeds stage 0 and their concatenation handed to the schedule (`fed_bytes`), m x the embedded
  tokens' bytes each. (The paper's schedules also run the input layer outside the pipeline's passes; charging
  them 1-2 microbatches of hidden states, as until 2026-12-05, undercounted the runner by m embeddings a rank.)

The passes are placed where the runner runs them: the input pass counted with each forward (the runner runs them
all at the step's start; the same busy time per rank), the output pass at the start of each rank's first backward
of the microbatch (B, or I with a split backward; of the last stage the rank holds): on the last stage's rank inside
its backward, elsewhere just before the receive of that microbatch's gradient. It is one collective: every rank runs
pass k together, once the last of them reaches it (`StageCost.sync_s`). Charged one rank after the other (rank 0's
pass after the last stage's whole backward), a step of m microbatches dominated by the passes took about m + 1
passes instead of m: with examples/gpt_big_vocab.py on 2 ranks, 4 microbatches, the simulator predicted 2.88 s
for vocabulary parallelism where the collective's placement gives 2.35 s (scripts/bench_vocab.py,
docs/vocabulary-parallelism.md). The body's stages keep their own costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from ..data.cluster import Cluster, Link
from ..data.vocab import VocabVariant
from ..schedule import StageCost
from .terms import transfer_time
from .units import UnitArrays

__all__ = ["VocabVariant", "VocabPasses", "vocab_link", "vocab_passes", "body_arrays", "with_vocab_passes"]


@dataclass(frozen=True)
class VocabPasses:
    """What the vocabulary passes add to every pipeline rank, per microbatch (times) and for the step (bytes)."""

    variant: VocabVariant
    input_s: float
    """Embedding F + B / p, plus its reduce and broadcast."""
    output_s: float
    """Head F + B / p, plus the broadcast of h, the statistics' collectives and the reduce of dh."""
    comm_s: float
    """The part of input_s + output_s spent in collectives."""
    link_bytes: int
    """Bytes per microbatch each rank moves on its link (hidden states and their gradients)."""
    static_bytes: int
    """The vocabulary layers' parameters, gradients, optimizer state / p, plus the variant's held hidden states and
    the rank's m partial embeddings (every rank)."""
    fed_bytes: int
    """What rank 0 holds besides: the m summed embeddings it feeds stage 0 and their concatenation."""
    transient_bytes: int
    """The logits shard of one microbatch (the head's activation bytes / p)."""


def _collective(link: Link, nbytes: float, ranks: int) -> float:
    """A broadcast or reduce of `nbytes` over `ranks` ranks: the bytes once (pipelined) and a tree's latencies."""
    return transfer_time(link, nbytes) + link.latency_s * max(0, math.ceil(math.log2(ranks)) - 1)


def vocab_link(cluster: Cluster, pp: int, nbytes: float) -> Link:
    """The link the passes' collectives run on: they span all `pp` pipeline ranks (reduce, broadcast, all-gather),
    so the slowest link between any two of them paces them (`cluster` `placed` for the layout; on a cluster of
    nodes the inter-node or WAN link once the ranks span nodes), the slowest being the one that moves `nbytes` (a
    pass's hidden states) the slowest. Ranks 0 and 1 alone (as until 2026-12-05) saw the intra-node link."""
    links = {cluster.link_between(a, b) for a in range(pp) for b in range(a + 1, pp)}
    return max(links, key=lambda link: (transfer_time(link, nbytes), link.latency_s))


def vocab_passes(a: UnitArrays, pp: int, link: Link, variant: VocabVariant = VocabVariant.VOCAB_2,
                 tied: bool = False, *, microbatches: int) -> VocabPasses:
    """The passes of `a`'s first unit (the embedding) and last unit (the head) split over `pp` ranks joined by
    `link`, for a step of `microbatches` (the input passes' outputs of all of them are held). `tied`: the head is
    the embedding's tensor (autopp.data.vocab.vocab_tied), one shard of rows per rank serves both, so its bytes
    count once: the head unit's (a bias-free linear layer: the tensor, its gradient and
    optimizer state alone; the profile gives every unit using a tied weight a copy)."""
    last = a.n - 1
    embedded, hidden = float(a.cut[1]), float(a.cut[last])
    stats = variant.collectives * link.latency_s * max(1, math.ceil(math.log2(pp)))
    input_comm = 2 * _collective(link, embedded, pp)
    output_comm = 2 * _collective(link, hidden, pp) + stats
    held = variant.extra_inflight * int(hidden) + microbatches * int(embedded)
    return VocabPasses(
        variant=variant,
        input_s=float(a.forward[0] + a.backward[0]) / pp + input_comm,
        output_s=float(a.forward[last] + a.backward[last]) / pp + output_comm,
        comm_s=input_comm + output_comm, link_bytes=int(2 * embedded + 2 * hidden),
        static_bytes=int(math.ceil(((0 if tied else a.static[0]) + a.static[last]) / pp)) + held,
        transient_bytes=int(math.ceil(a.activation[last] / pp)), fed_bytes=2 * microbatches * int(embedded))


def body_arrays(a: UnitArrays) -> UnitArrays:
    """`a` with the embedding and the head costing nothing (their work moves to the passes): what the split of the
    body sees. The first and last stages still hold the (empty) units; the last stage's output, which torch's stage
    holds per in-flight microbatch, is the hidden states it hands the output pass (autopp.run.vocab), not logits."""
    def ends(values: np.ndarray) -> np.ndarray:
        out = values.copy()
        out[[0, a.n - 1]] = 0
        return out

    def zeroed(values: np.ndarray | None) -> np.ndarray | None:
        return None if values is None else ends(values)
    names = ("forward", "backward_input", "backward_weight", "recompute", "static", "activation", "params",
             "grads", "backward", "optimizer", "transient", "ep_time")
    changes: dict[str, Any] = {n: zeroed(getattr(a, n)) for n in names}
    return replace(a, own={p: (ends(kept), ends(redo)) for p, (kept, redo) in a.own.items()},
                   model_output=float(a.cut[a.n - 1]), **changes)


def with_vocab_passes(costs: Sequence[StageCost], owner: Sequence[int], passes: VocabPasses) -> list[StageCost]:
    """The body's stage costs with the passes added where the runner runs them: the input pass to the forward of
    the first stage each rank holds (with its static and transient bytes; stage 0 also `fed_bytes`), the output
    pass to the backward (B and I) of the last stage each rank holds, whose first backward of a microbatch is
    where the runner runs it (inside the last stage's B; elsewhere just before the receive of that microbatch's
    gradient), marked as the collective
    all ranks run together (`StageCost.sync_s`): the simulator starts it when the last rank reaches it, on every
    rank at once, not one rank after another. With several stages per rank it stays charged rank by rank: there
    the runner runs a pass when torch's runtime posts the gradient's receive, ahead of the action (and the
    compute order alone can deadlock: Interleaved1F1B on 4 ranks)."""
    first = {r: owner.index(r) for r in set(owner)}
    last = {r: len(owner) - 1 - owner[::-1].index(r) for r in set(owner)}
    out = list(costs)
    for s in first.values():
        c = out[s]
        held = passes.static_bytes + (passes.fed_bytes if s == 0 else 0)
        out[s] = replace(c, forward_s=c.forward_s + passes.input_s, static_bytes=c.static_bytes + held,
                         recompute_s=None if c.recompute_s is None else c.recompute_s + passes.input_s,
                         transient_bytes=max(c.transient_bytes, passes.transient_bytes))
    for s in last.values():
        c = out[s]
        full = c.backward_s if c.backward_s is not None else c.backward_input_s + c.backward_weight_s
        out[s] = replace(c, backward_s=full + passes.output_s, backward_input_s=c.backward_input_s + passes.output_s,
                         sync_s=passes.output_s if len(owner) == len(first) else 0.0)
    return out
