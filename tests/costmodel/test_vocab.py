"""autopp.costmodel.vocab's own terms: the link the vocabulary passes' collectives run on and what the passes hold
(choosing vocabulary parallelism, and the rest of its costs: tests/solve/test_vocab.py)."""

from __future__ import annotations

from autopp.costmodel.vocab import vocab_link
from autopp.data.cluster import Cluster, Link, Nodes, hierarchical_cluster
from autopp.data.layout import Layout

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
