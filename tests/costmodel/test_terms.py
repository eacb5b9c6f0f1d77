"""Transfers, message overheads, progress delays, the all-reduce and the optimizer step, with numbers worked by hand."""

from __future__ import annotations

import pytest

from autopp.data.cluster import Cluster, Link, Nodes, hierarchical_cluster
from autopp.data.layout import Layout
from autopp.costmodel import (allreduce_time, comm_times, gradient_allreduce_time, message_overheads, optimizer_time,
                              progress_delays, send_times, step_end_floor, transfer_time)

from .arrays import arrays

LINK = Link(latency_s=0.5, bandwidth_bytes_per_s=100.0)


def _cluster(n: int, overheads: tuple[float, ...] = (), progress: tuple[float, ...] = ()) -> Cluster:
    return Cluster(num_devices=n, memory_bytes=1, links=tuple(
        Link(latency_s=0.0, bandwidth_bytes_per_s=1.0, overhead_s=o, progress_s=p)
        for o, p in zip(overheads or (0.0,) * (n - 1), progress or (0.0,) * (n - 1))))


def test_transfer_is_latency_plus_bytes_over_bandwidth_and_nothing_is_free() -> None:
    assert transfer_time(LINK, 200.0) == 2.5  # 0.5 + 200 / 100
    assert transfer_time(LINK, 0.0) == 0.0


def test_send_times_are_the_same_transfer_per_cut_vectorised() -> None:
    a = arrays([1.0] * 4, cut=[200.0, 0.0, 50.0])
    assert list(send_times(a, LINK)) == [0.0, 2.5, 0.0, 1.0, 0.0]
    assert list(send_times(a, LINK)) == [transfer_time(LINK, float(x)) for x in a.cut]
    assert list(send_times(a, None)) == [0.0] * 5  # stages on one device


def test_comm_times_cross_ranks_only() -> None:
    a = arrays([1.0] * 4, cut=[1.0, 2.0, 3.0])
    cluster = Cluster(num_devices=2, memory_bytes=1, link=LINK)
    # V shape on 2 ranks: stages 1 and 2 share rank 1, so the cut after unit 2 costs nothing.
    assert comm_times(a, cluster, [(0, 1), (1, 2), (2, 3), (3, 4)], [0, 1, 1, 0]) == [0.51, 0.0, 0.53]


def test_message_overheads_ends_pay_once_middles_twice() -> None:
    assert message_overheads(_cluster(3, (1.0, 1.0)), [0, 1, 2]) == [1.0, 2.0, 1.0]
    # Each boundary's own link: rank 0 - 1 costs 1, rank 1 - 2 costs 10.
    assert message_overheads(_cluster(3, (1.0, 10.0)), [0, 1, 2]) == [1.0, 11.0, 10.0]


def test_message_overheads_neighbours_on_the_same_rank_send_nothing() -> None:
    assert message_overheads(_cluster(2, (0.5,)), [0, 1, 1, 0]) == [0.5, 0.5, 0.5, 0.5]
    assert message_overheads(_cluster(1), [0, 0]) == [0.0, 0.0]


def test_progress_delays_per_boundary_on_its_link() -> None:
    assert progress_delays(_cluster(3, progress=(2.0, 3.0)), [0, 1, 2]) == [2.0, 3.0]
    assert progress_delays(_cluster(2, progress=(2.0,)), [0, 1, 1, 0]) == [2.0, 0.0, 2.0]


def test_ring_allreduce() -> None:
    cluster = Cluster(num_devices=4, memory_bytes=1, link=LINK, data_link=Link(latency_s=0.01,
                                                                               bandwidth_bytes_per_s=100.0))
    assert allreduce_time(1000.0, 4, cluster) == pytest.approx(15.06)  # 2 x 3/4 x 1000 / 100 + 2 x 3 x 0.01
    assert allreduce_time(1000.0, 1, cluster) == 0.0 and allreduce_time(0.0, 4, cluster) == 0.0


INTRA, INTER = Link(latency_s=0.01, bandwidth_bytes_per_s=400.0), Link(latency_s=0.1, bandwidth_bytes_per_s=50.0)


def _nodes(count: int, per_node: int) -> Cluster:
    return hierarchical_cluster(Nodes(count=count, devices_per_node=per_node, intra=INTRA, inter=INTER), 1)


def test_allreduce_inside_one_node_is_the_ring_on_the_intra_node_link() -> None:
    flat = Cluster(num_devices=8, memory_bytes=1, link=INTRA)
    for dp, rank in ((4, 0), (4, 1), (2, 3)):  # pp 2 x dp 4, pp 4 x dp 2 on 2 nodes x 4: each group in one node
        assert allreduce_time(1000.0, dp, _nodes(2, 4), rank) == allreduce_time(1000.0, dp, flat)
    assert allreduce_time(1000.0, 4, _nodes(2, 4)) == pytest.approx(2 * 3 / 4 * 1000 / 400 + 2 * 3 * 0.01)


def test_allreduce_across_nodes_is_the_hierarchical_sum() -> None:
    """dp 8 on 2 nodes x 4: reduce-scatter in the node, all-reduce of the 1/4 each holds across 2 nodes, all-gather
    in the node."""
    in_node = 2 * 3 / 4 * 1000 / 400 + 2 * 3 * 0.01  # reduce-scatter + all-gather: 3/4 x S / B each, 3 steps each
    across = 2 * 1 / 2 * 250 / 50 + 2 * 1 * 0.1  # ring all-reduce of S / 4 over 2 nodes
    assert allreduce_time(1000.0, 8, _nodes(2, 4)) == pytest.approx(in_node + across)
    one_per_node = 2 * 3 / 4 * 1000 / 50 + 2 * 3 * 0.1  # dp 4 on 4 nodes x 1: the ring on the inter-node link
    assert allreduce_time(1000.0, 4, _nodes(4, 1)) == pytest.approx(one_per_node)
    flat_ib = Cluster(num_devices=8, memory_bytes=1, link=INTER)
    assert allreduce_time(1000.0, 8, _nodes(2, 4)) < allreduce_time(1000.0, 8, flat_ib)


def test_allreduce_across_regions_adds_a_level_on_the_wan_link() -> None:
    """dp 8 on 2 regions x 2 nodes x 2: in the node (S), across the region's nodes (S / 2), across regions (S / 4)."""
    wan = Link(latency_s=1.0, bandwidth_bytes_per_s=10.0)
    c = hierarchical_cluster(Nodes(count=4, devices_per_node=2, intra=INTRA, inter=INTER, regions=2, wan=wan), 1)
    expected = (2 * 1 / 2 * 1000 / 400 + 2 * 0.01) + (2 * 1 / 2 * 500 / 50 + 2 * 0.1) + (2 * 1 / 2 * 250 / 10 + 2 * 1.0)
    assert allreduce_time(1000.0, 8, c) == pytest.approx(expected)
    assert allreduce_time(1000.0, 4, c) == allreduce_time(1000.0, 4, _nodes(4, 2))  # one region: as without regions


def test_allreduce_of_a_group_split_unevenly_between_nodes() -> None:
    """dp 3 on 3 nodes x 4, pipeline rank 1: devices 3 | 4, 5 -> the node phases with 2 members, S / 1 across."""
    expected = (2 * 1 / 2 * 1000 / 400 + 2 * 0.01) + (2 * 1 / 2 * 1000 / 50 + 2 * 0.1)
    assert allreduce_time(1000.0, 3, _nodes(3, 4), rank=1) == pytest.approx(expected)
    assert allreduce_time(1000.0, 3, _nodes(3, 4), rank=0) == pytest.approx(2 * 2 / 3 * 1000 / 400 + 4 * 0.01)


def test_gradient_allreduce_is_the_rank_with_most_gradients() -> None:
    cluster = Cluster(num_devices=2, memory_bytes=1, link=Link(latency_s=0.0, bandwidth_bytes_per_s=100.0))
    a = arrays([1.0] * 4, grads=[100.0, 200.0, 300.0, 400.0])
    layout = Layout(pp=2, dp=2)
    assert gradient_allreduce_time(a, [(0, 2), (2, 4)], [0, 1], layout, cluster) == 7.0  # 700 B: 2 x 1/2 x 700 / 100
    assert gradient_allreduce_time(a, [(0, 1), (1, 2), (2, 3), (3, 4)], [0, 1, 1, 0], layout, cluster) == 5.0  # 500


def test_gradients_synchronise_over_the_layouts_sync_ranks() -> None:
    """The group is `Layout.sync` (dp x cp), read from the layout: context-parallel ranks average gradients too."""
    cluster = Cluster(num_devices=8, memory_bytes=1, link=Link(latency_s=0.0, bandwidth_bytes_per_s=100.0))
    a = arrays([1.0] * 2, grads=[400.0, 400.0])
    bounds = [(0, 1), (1, 2)]
    with_cp = gradient_allreduce_time(a, bounds, [0, 1], Layout(pp=2, dp=2, cp=2), cluster)
    assert with_cp == gradient_allreduce_time(a, bounds, [0, 1], Layout(pp=2, dp=4), cluster) == 6.0  # 2 x 3/4 x 4
    assert gradient_allreduce_time(a, bounds, [0, 1], Layout(pp=2, dp=2), cluster) == 4.0  # 2 x 1/2 x 400 / 100
    assert gradient_allreduce_time(a, bounds, [0, 1], Layout(pp=2, tp=2), cluster) == 0.0  # tp shares no gradient


def test_sync_ranks_inside_a_group_sit_on_its_node() -> None:
    """dp 2 x cp 2 on 2 nodes x 4 devices, seen as groups of cp 2 (`tp_groups(2)`: 2 nodes x 2 groups): pipeline
    rank 0's synchronisation group is groups 0 and 1 with 2 ranks in each, i.e. devices 0-3 of node 0: a ring of 4
    on the intra-node link, as dp 4 on the devices, not 4 groups spread over both nodes."""
    nodes = _nodes(2, 4)
    view = nodes.tp_groups(2)
    inside = allreduce_time(1000.0, 4, view, 0, per_group=2)
    assert inside == allreduce_time(1000.0, 4, nodes, 0) == pytest.approx(2 * 3 / 4 * 1000 / 400 + 2 * 3 * 0.01)
    assert allreduce_time(1000.0, 4, view, 0) > inside  # read as 4 groups: hierarchical across the nodes
    layout = Layout(pp=2, dp=2, cp=2)  # pipeline rank 1: groups 2 and 3, node 1
    assert layout.sync_per_group == 2 and Layout(dp=2, tp=2).sync_per_group == 1
    a = arrays([1.0, 1.0], grads=[1000.0, 1000.0])
    assert gradient_allreduce_time(a, [(0, 1), (1, 2)], [0, 1], layout, view.placed(layout)) == inside
    assert step_end_floor(a, view, layout) == inside


def test_optimizer_step_is_the_slowest_ranks_share() -> None:
    a = arrays([1.0] * 4, optimizer=[1.0, 2.0, 3.0, 4.0])
    assert optimizer_time(a, [(0, 2), (2, 4)], [0, 1]) == 7.0
    assert optimizer_time(a, [(0, 1), (1, 2), (2, 3), (3, 4)], [0, 1, 1, 0]) == 5.0  # V shape: ranks hold 1+4, 2+3
    assert optimizer_time(a, [(0, 2), (2, 4)], [0, 1], [1.0, 2.0]) == 3.5  # 3 / 1 vs 7 / 2
    assert optimizer_time(arrays([1.0]), [(0, 1)], [0]) == 0.0  # no optimizer time profiled


@pytest.mark.parametrize("seed", range(6))
def test_step_end_floor_bounds_step_end_time_for_every_split(seed: int) -> None:
    import itertools
    import random

    from autopp.costmodel import step_end_floor, step_end_time
    rng = random.Random(seed)
    n, pp, dp = 7, 3, rng.choice([2, 4])
    a = arrays([1.0] * n, grads=[float(rng.randint(0, 1000)) for _ in range(n)],
               optimizer=[rng.uniform(0.0, 0.1) for _ in range(n)])
    cluster = Cluster(num_devices=pp * dp, memory_bytes=1, link=LINK) if seed < 3 else \
        _nodes(pp * dp // 2, 2) if dp == 4 else _nodes(2, 3)  # nodes: groups over 2 nodes x 2, or 1 | 1 (rank 1)
    layout = Layout(pp=pp, dp=dp)
    floor = step_end_floor(a, cluster, layout)
    for cuts in itertools.combinations(range(1, n), pp - 1):
        ends = (0, *cuts, n)
        bounds = tuple(zip(ends, ends[1:]))
        allreduce, optimizer = step_end_time(a, cluster, bounds, list(range(pp)), layout, [1.0] * pp)
        assert floor <= allreduce + optimizer, (bounds, floor, allreduce, optimizer)
        assert allreduce == gradient_allreduce_time(a, bounds, list(range(pp)), layout, cluster)


@pytest.mark.parametrize("seed", range(4))
def test_step_end_floor_bounds_chimeras_step_end_with_its_replicas_sum(seed: int) -> None:
    # Chimera (mirrored): each rank r also holds the up replica of rank p - 1 - r's stages; the pairs sum their
    # gradients first. The floor with `mirrored` holds for every split and exceeds the one without (grads > 0).
    import itertools
    import random

    from autopp.costmodel import step_end_floor, step_end_time
    rng = random.Random(seed)
    n, pp, dp = 7, 4, rng.choice([1, 2])
    a = arrays([1.0] * n, grads=[float(rng.randint(1, 1000)) for _ in range(n)])
    cluster = Cluster(num_devices=pp * dp, memory_bytes=1, link=LINK)
    layout = Layout(pp=pp, dp=dp)
    floor = step_end_floor(a, cluster, layout, mirrored=True)
    assert floor > step_end_floor(a, cluster, layout)
    for cuts in itertools.combinations(range(1, n), pp - 1):
        ends = (0, *cuts, n)
        bounds = tuple(zip(ends, ends[1:]))
        assert floor <= sum(step_end_time(a, cluster, bounds, list(range(pp)), layout, [1.0] * pp, mirrored=True))


def test_overlapped_gradient_reduction_exposes_only_what_outlasts_the_ranks_last_backward() -> None:
    """Issue 25 item 4: with `grad_reduce` a rank's reduction runs under its last microbatch's backward (its stages'
    B); the step's end is what exceeds it, never below 0, and `step_end_floor` stays a bound."""
    from dataclasses import replace as _replace

    from autopp.costmodel import exposed_sync_time, gradient_allreduce_time, step_end_floor
    from autopp.data.cluster import Cluster, Link
    from autopp.data.layout import Layout
    from autopp.data.overlap import Overlap
    from .arrays import arrays as _arrays
    cluster = Cluster(num_devices=4, memory_bytes=2**30, link=Link(latency_s=1e-5, bandwidth_bytes_per_s=1e8))
    layout = Layout(pp=2, dp=2)
    a = _arrays([1e-3, 1e-3, 1e-3, 1e-3], static=[4e6] * 4, grads=[4e6] * 4)
    bounds, owner = [(0, 2), (2, 4)], [0, 1]
    full = gradient_allreduce_time(a, bounds, owner, layout, cluster)
    assert exposed_sync_time(a, bounds, owner, layout, cluster, [1.0, 1.0]) == pytest.approx(full)
    on = _replace(a, overlap=Overlap(grad_reduce=True))
    window = float(a.backward[0:2].sum())  # each rank's stage: 2 units of B = 2 ms
    assert exposed_sync_time(on, bounds, owner, layout, cluster, [1.0, 1.0]) == pytest.approx(full - window)
    slow = _replace(on, backward=on.backward * 1e3)
    assert exposed_sync_time(slow, bounds, owner, layout, cluster, [1.0, 1.0]) == 0.0
    assert step_end_floor(on, cluster, layout) <= exposed_sync_time(on, bounds, owner, layout, cluster, [1.0, 1.0])


def test_chimera_sums_each_replica_pair_on_its_link_then_syncs_and_steps_both() -> None:
    from autopp.costmodel.terms import replica_allreduce_time, step_end_time
    a = arrays([1.0] * 4, grads=[100.0, 200.0, 300.0, 400.0], optimizer=[1.0, 2.0, 3.0, 4.0])
    links = (Link(latency_s=0.0, bandwidth_bytes_per_s=100.0), Link(latency_s=0.0, bandwidth_bytes_per_s=10.0),
             Link(latency_s=0.0, bandwidth_bytes_per_s=100.0))
    cluster = Cluster(num_devices=4, memory_bytes=1, links=links)
    bounds, owner = [(0, 1), (1, 2), (2, 3), (3, 4)], [0, 1, 2, 3]
    # ranks 0 and 3 hold stages 0 and 3 (500 bytes) across links 100, 10, 100 B/s (the slowest carries it): a ring
    # of 2 moves the bytes once, 500 / 10; ranks 1 and 2: stages 1 and 2 (500 bytes) on the 10 B/s link
    assert replica_allreduce_time(a, cluster, bounds, owner) == pytest.approx(500 / 10)
    layout = Layout(pp=4)
    plain_ar, plain_opt = step_end_time(a, cluster, bounds, owner, layout, [1.0] * 4)
    ar, opt = step_end_time(a, cluster, bounds, owner, layout, [1.0] * 4, mirrored=True)
    assert (plain_ar, plain_opt) == (0.0, 4.0)  # no data parallelism; the slowest rank's optimizer step
    assert ar == pytest.approx(500 / 10) and opt == 5.0  # each rank steps both replicas: 1 + 4 or 2 + 3
