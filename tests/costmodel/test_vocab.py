"""autopp.costmodel.vocab's own terms: the link the vocabulary passes' collectives run on and what the passes hold
(choosing vocabulary parallelism, and the rest of its costs: tests/solve/test_vocab.py)."""

from __future__ import annotations

import numpy as np

from autopp.costmodel import UnitArrays
from autopp.costmodel.vocab import VocabVariant, vocab_link, vocab_passes, with_vocab_passes
from autopp.data.cluster import Cluster, Link, Nodes, hierarchical_cluster
from autopp.data.layout import Layout
from autopp.schedule import StageCost

INTRA = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e11)
INTER = Link(latency_s=5e-6, bandwidth_bytes_per_s=1e9)


def test_the_collectives_run_on_the_slowest_link_among_the_pipeline_ranks() -> None:
    """Two nodes of two devices, pp 4: ranks 0 and 1 share a node, but the passes' reduce, broadcast and all-gather
    span all four ranks, across the nodes."""
    two_nodes = hierarchical_cluster(Nodes(count=2, devices_per_node=2, intra=INTRA, inter=INTER), 2**34)
    placed = two_nodes.placed(Layout(pp=4))
    assert placed.link_between(0, 1) == INTRA
    assert vocab_link(placed, 4, 1e6) == INTER
    assert vocab_link(two_nodes.placed(Layout(pp=2, dp=2)), 2, 1e6) == INTER  # replicas' ranks 0 and 1 on 2 nodes
    flat = Cluster(num_devices=4, memory_bytes=2**34, link=INTER)
    assert vocab_link(flat, 4, 1e6) == INTER


def test_every_microbatch_s_input_pass_output_is_held() -> None:
    """The runner runs every microbatch's input pass at the step's start and their backward at its end
    (autopp.run.vocab `VocabRuntime.begin`/`finish`): each rank holds m partial embeddings, rank 0 also the m summed
    ones it feeds stage 0 and their concatenation; charged m x the embedded bytes each, on top of the variant's
    held hidden states."""
    a = _lm()
    one, eight = (vocab_passes(a, 4, INTRA, VocabVariant.VOCAB_2, microbatches=m) for m in (1, 8))
    assert eight.static_bytes - one.static_bytes == 7 * 300  # the cut after the embedding: 300 bytes
    assert (one.fed_bytes, eight.fed_bytes) == (2 * 300, 2 * 8 * 300)
    base = StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0, backward_s=2.0, static_bytes=10)
    costs = with_vocab_passes([base] * 4, [0, 1, 2, 3], eight)
    assert [c.static_bytes for c in costs] == [10 + eight.static_bytes + eight.fed_bytes] + \
        [10 + eight.static_bytes] * 3


def _lm() -> UnitArrays:
    """Embedding, four blocks, head: 300 bytes after the embedding, 500 across the other cuts."""
    f = np.array([0.1, 1.0, 1.0, 1.0, 1.0, 4.0])
    st = np.full(6, 100.0)
    return UnitArrays(f, f.copy(), f.copy(), f.copy(), st, 10 * f, st / 4, st / 4,
                      np.array([0.0, 300.0, 500.0, 500.0, 500.0, 500.0, 0.0]), True, 2 * f)
