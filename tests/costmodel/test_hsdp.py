"""HSDP (issue 25 item 3): ZeRO sharded inside a group of dp / dp_replicate ranks, the groups' gradient shards
all-reduced across the replicas (autopp.costmodel.parallel, terms.hsdp_allreduce_time)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel import data_sharded, gradient_allreduce_time, replica_terms, step_end_floor
from autopp.costmodel.terms import hsdp_allreduce_time
from autopp.data.cluster import Cluster, Link, Nodes, hierarchical_cluster
from autopp.data.layout import Layout
from autopp.data.overlap import NO_OVERLAP
from autopp.data.zero import ZERO
from autopp.errors import LayoutError

from .arrays import arrays

INTRA = Link(latency_s=0.0, bandwidth_bytes_per_s=100e9)
INTER = Link(latency_s=0.0, bandwidth_bytes_per_s=1e9)
TWO_NODES = hierarchical_cluster(Nodes(count=2, devices_per_node=4, intra=INTRA, inter=INTER), 2**40)


def test_the_layout_shards_over_dp_over_dp_replicate_and_refuses_what_hsdp_is_not() -> None:
    layout = Layout(dp=8, zero=ZERO[3], dp_replicate=2)
    assert (layout.sync, layout.shard, layout.unit_view().sync, layout.unit_view().replicate) == (8, 4, 4, 2)
    assert layout.describe() == "pp(1) x dp(8)[2x4]"
    with pytest.raises(LayoutError, match=r"`dp_replicate` 3 must divide dp\(8\)"):
        Layout(dp=8, zero=ZERO[3], dp_replicate=3)
    with pytest.raises(LayoutError, match=r"`dp_replicate` 8 must divide dp\(8\) and be below it"):
        Layout(dp=8, zero=ZERO[3], dp_replicate=8)
    with pytest.raises(LayoutError, match="ZeRO 0 shards nothing"):
        Layout(dp=8, dp_replicate=2)


def test_the_replicas_all_reduce_on_the_inter_node_link_when_dp_spans_nodes() -> None:
    # 2 replicas of 1 GB shards: a ring of 2, 2 (2 - 1) / 2 x S / B
    assert hsdp_allreduce_time(1e9, 2, 8, TWO_NODES) == pytest.approx(1e9 / INTER.bandwidth_bytes_per_s)
    assert hsdp_allreduce_time(1e9, 2, 4, TWO_NODES) == pytest.approx(1e9 / INTRA.bandwidth_bytes_per_s)
    flat = Cluster(num_devices=8, memory_bytes=2**30, link=INTER)
    assert hsdp_allreduce_time(1e9, 4, 8, flat) == pytest.approx(1.5 * 1e9 / INTER.bandwidth_bytes_per_s)
    assert hsdp_allreduce_time(1e9, 1, 8, TWO_NODES) == 0.0


def _fsdp(layout: Layout):  # type: ignore[no-untyped-def]
    a = arrays([1.0, 1.0], static=[16e9, 32e9], grads=[4e9, 8e9], optimizer=[0.5, 1.0])
    return a, replica_terms(replace(a, overlap=NO_OVERLAP), layout.unit_view(), TWO_NODES)


def test_fsdp_at_pp_1_shards_inside_the_node_and_all_reduces_each_shard_across_it() -> None:
    a, plain = _fsdp(Layout(dp=8, zero=ZERO[3]))
    _, hsdp = _fsdp(Layout(dp=8, zero=ZERO[3], dp_replicate=2))
    assert np.allclose(plain.static, np.round(a.static / 8)) and np.allclose(hsdp.static, np.round(a.static / 4))
    p, g = a.params, a.grads
    gather = 3 / 4 * p / INTRA.bandwidth_bytes_per_s  # half of ring(S, 4, intra): inside the node only
    scatter = 3 / 4 * g / INTRA.bandwidth_bytes_per_s + g / 4 / INTER.bandwidth_bytes_per_s
    assert np.allclose(hsdp.forward - a.forward, gather)
    assert np.allclose(hsdp.backward - a.backward, gather + scatter)
    # plain FSDP over both nodes gathers across the slow link too (the backward's gather and scatter each pay half
    # of the inter-node all-reduce, HSDP's scatter all of it): its collectives cost more, its shards less
    assert np.all(plain.forward > hsdp.forward) and np.allclose(plain.backward, hsdp.backward)
    assert np.all(plain.zero_seconds[0] > hsdp.zero_seconds[0]) and np.all(plain.static < hsdp.static)


def test_pipelined_zero_all_reduces_the_shards_across_replicas_at_the_steps_end() -> None:
    a = arrays([1.0, 1.0], static=[16e9, 32e9], grads=[4e9, 8e9], optimizer=[0.5, 1.0])
    layout = Layout(pp=2, dp=4, zero=ZERO[1], dp_replicate=2)  # 8 devices: pipeline rank r's dp on node r
    cluster = TWO_NODES.placed(layout)
    out = data_sharded(a, layout.unit_view(), lambda s: s * 0.0)
    plain = Layout(pp=2, dp=4, zero=ZERO[1])
    shard = data_sharded(a, plain.unit_view(), lambda s: s * 0.0)
    g = float(a.grads[1])  # rank 1's stage; its dp group of 4 on one node: the replicas' ring is intra-node
    across = hsdp_allreduce_time(g / 2, 2, 4, cluster, 1)
    assert across == pytest.approx(g / 2 / INTRA.bandwidth_bytes_per_s)
    end = gradient_allreduce_time(out, [(0, 1), (1, 2)], [0, 1], layout, cluster)
    reduce = gradient_allreduce_time(shard, [(0, 1), (1, 2)], [0, 1], Layout(pp=2, dp=2, zero=ZERO[1]), cluster)
    assert end == pytest.approx(reduce + across)
    assert 0 < step_end_floor(out, cluster, layout) <= end
