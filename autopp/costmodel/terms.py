"""Cost terms of messages and of the step's end: point-to-point transfers (scalar and vectorised), per-message
overheads, progress delays, the ring all-reduce of gradients and the optimizer step."""

from __future__ import annotations

from typing import Sequence, TypeVar

import numpy as np

from ..data.cluster import Cluster, Link
from ..data.layout import Layout
from ..data.zero import ZeroStage
from .units import UnitArrays

__all__ = ["transfer_time", "send_times", "comm_times", "message_overheads", "progress_delays", "allreduce_time",
           "allreduce_times", "half_collective", "sync_time", "gradient_allreduce_time", "rank_sync_times",
           "exposed_sync_time", "optimizer_time", "replica_allreduce_time", "step_end_time", "step_end_floor",
           "hsdp_allreduce_time"]

_Bytes = TypeVar("_Bytes", float, np.ndarray)


def _wire(link: Link, nbytes: _Bytes) -> _Bytes:
    """latency + bytes / bandwidth: the one formula of a point-to-point transfer (float or array)."""
    return link.latency_s + nbytes / link.bandwidth_bytes_per_s


def transfer_time(link: Link, nbytes: float) -> float:
    """Time to send `nbytes` over `link` (0 for nothing to send)."""
    return 0.0 if nbytes <= 0 else _wire(link, nbytes)


def send_times(a: UnitArrays, link: Link | None) -> np.ndarray:
    """Per unit boundary j = 0..n, transfer_time of what crosses cut j (the DP's vectorised form; `link` None: the
    two stages share a device, free)."""
    if link is None:
        return np.zeros(a.n + 1)
    return np.where(a.cut > 0, _wire(link, a.cut), 0.0)


def comm_times(a: UnitArrays, cluster: Cluster, bounds: Sequence[tuple[int, int]], owner: Sequence[int]) -> list[float]:
    """Transfer time across each stage boundary (0 between stages on the same rank)."""
    return [0.0 if owner[k] == owner[k + 1] else transfer_time(cluster.link_between(owner[k], owner[k + 1]),
                                                               float(a.cut[j]))
            for k, (_, j) in enumerate(bounds[:-1])]


def message_overheads(cluster: Cluster, owner: Sequence[int]) -> list[float]:
    """Per stage, the links' per-message overhead of its F (receive the input, send the output) and, the same, of its
    B or I (receive the output gradient, send the input gradient): once per neighbour stage on another rank."""
    n = len(owner)
    return [sum(cluster.link_between(owner[s], owner[t]).overhead_s for t in (s - 1, s + 1)
                if 0 <= t < n and owner[t] != owner[s]) for s in range(n)]


def progress_delays(cluster: Cluster, owner: Sequence[int]) -> list[float]:
    """Per stage boundary, the link's progress delay (`Link.progress_s`; 0 between stages on the same rank)."""
    return [0.0 if owner[k] == owner[k + 1] else cluster.link_between(owner[k], owner[k + 1]).progress_s
            for k in range(len(owner) - 1)]


def allreduce_time(grad_bytes: float, n: int, cluster: Cluster, rank: int = 0, per_group: int = 1) -> float:
    """All-reduce of `grad_bytes` over the `n` ranks of pipeline rank `rank`'s synchronisation group (`Layout.sync`),
    on the ring or rings it runs on; `per_group` of them are devices of each pipeline rank's group of devices
    (`Layout.sync_per_group`: context-parallel ranks), so the group spans n / per_group pipeline ranks of `cluster`
    (a `Cluster.tp_groups` view) with per_group members on each one's node.

    The ring of n ranks on a link of bandwidth B and latency a (nccl-tests doc/PERFORMANCE.md, "AllReduce": t =
    S / B x 2 (n - 1) / n, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md) plus a latency per
    step, 2 (n - 1) steps: `ring(S, n, link)`. On a flat cluster it runs on `dp_link`. On a cluster of nodes the
    group is where `Cluster.placed` puts it (`Cluster.dp_group`): inside one node, a ring on the intra-node link;
    across N nodes with k members each, the hierarchical all-reduce: reduce-scatter inside each node ((k - 1) / k
    x S / B_intra), all-reduce across the nodes on the S / k each member holds (2 (N - 1) / N x S / k / B_inter),
    all-gather inside the node ((k - 1) / k x S / B_intra), i.e. ring(S, k, intra) + ring(S / k, N, inter)
    (PERFORMANCE.md's ReduceScatter and AllGather formulas; the order is HCCL's "Hierarchical Communication
    Principles"). Across R regions of N nodes each, one level more: + ring(S / (k N), R, wan). An assumption: NCCL
    itself runs a flat ring or a tree over the node's NICs, which this bounds from above for large groups. A group
    with unequal members per node or nodes per region (n neither a divisor nor a multiple of the devices per node)
    takes its most for each level's ring and its fewest for the bytes it passes up (an upper bound)."""
    if n <= 1 or grad_bytes <= 0:
        return 0.0
    if cluster.nodes is None:
        return _ring(grad_bytes, n, cluster.dp_link)
    regions = cluster.dp_group(rank, n // per_group)
    per_node = [k * per_group for region in regions for k in region]
    if len(per_node) == 1:
        return _ring(grad_bytes, n, cluster.nodes.intra)
    nodes = [len(region) for region in regions]
    across = grad_bytes / min(per_node)
    total = _ring(grad_bytes, max(per_node), cluster.nodes.intra) + _ring(across, max(nodes), cluster.nodes.inter)
    if len(regions) > 1 and cluster.nodes.wan is not None:
        total += _ring(across / min(nodes), len(regions), cluster.nodes.wan)
    return total


def allreduce_times(nbytes: np.ndarray, n: int, cluster: Cluster, rank: int = 0, per_group: int = 1) -> np.ndarray:
    """`allreduce_time` of each entry of `nbytes` (0 for none), vectorised: the time is affine in the bytes."""
    one = allreduce_time(1.0, n, cluster, rank, per_group)
    slope = allreduce_time(2.0, n, cluster, rank, per_group) - one
    return np.where(nbytes > 0, one - slope + slope * nbytes, 0.0)


def half_collective(allreduce_s: _Bytes) -> _Bytes:
    """A reduce-scatter or an all-gather of the bytes of an all-reduce taking `allreduce_s`: half of it (nccl-tests
    doc/PERFORMANCE.md: (n - 1) / n x S / B against 2 (n - 1) / n, and n - 1 latency steps against 2 (n - 1))."""
    return allreduce_s / 2


def sync_time(grad_bytes: float, param_bytes: float, zero: ZeroStage, n: int, cluster: Cluster,
              rank: int = 0, per_group: int = 1) -> float:
    """The collectives over the `n` synchronisation ranks (`allreduce_time`'s) after a step's last backward under
    ZeRO stage `zero` (autopp.costmodel.parallel): replicated, an all-reduce of the gradients; sharded, a
    reduce-scatter of them (unless they were reduce-scattered after each backward already) and an all-gather of the
    parameters (`half_collective` each)."""
    def reduce(nbytes: float) -> float:
        return allreduce_time(nbytes, n, cluster, rank, per_group)
    if zero.replicated:
        return reduce(grad_bytes)
    scatter = 0.0 if zero.scatters_each_microbatch else half_collective(reduce(grad_bytes))
    return scatter + half_collective(reduce(param_bytes))


def hsdp_allreduce_time(shard_bytes: float, replicate: int, dp: int, cluster: Cluster, rank: int = 0) -> float:
    """HSDP's all-reduce of each rank's gradient shard (`shard_bytes`) over the `replicate` shard groups of pipeline
    rank `rank`'s `dp` data-parallel ranks (`Layout.dp_replicate`; each group dp / replicate neighbours, so its
    replicas are that far apart): one ring (`_ring`) on the intra-node link when all dp ranks sit on one node, else
    on the inter-node link (between regions: the WAN link), an upper bound when some replicas share a node; on a
    flat cluster, `dp_link`. As FSDP2 runs HSDP (reduce-scatter in the shard group, then all-reduce of the shard
    across the replicate dimension; torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)."""
    if replicate <= 1 or shard_bytes <= 0:
        return 0.0
    if cluster.nodes is None:
        return _ring(shard_bytes, replicate, cluster.dp_link)
    regions = cluster.dp_group(rank, dp)
    nodes = cluster.nodes
    link = nodes.intra if len(regions) == 1 and len(regions[0]) == 1 else \
        nodes.wan if len(regions) > 1 and nodes.wan is not None else nodes.inter
    return _ring(shard_bytes, replicate, link)


def _ring(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks on `link`: 2 (n - 1) / n x bytes / bandwidth + 2 (n - 1)
    latencies."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth_bytes_per_s + 2 * (n - 1) * link.latency_s


def gradient_allreduce_time(a: UnitArrays, bounds: Sequence[tuple[int, int]], owner: Sequence[int], layout: Layout,
                            cluster: Cluster) -> float:
    """The slowest pipeline rank's synchronisation of its stages' gradients (and, under a sharding ZeRO stage
    `a.zero`, parameters: `sync_time`) over the layout's gradient-synchronisation ranks (`Layout.sync`; ranks
    synchronise in parallel)."""
    return max(rank_sync_times(a, bounds, owner, layout, cluster))


def rank_sync_times(a: UnitArrays, bounds: Sequence[tuple[int, int]], owner: Sequence[int], layout: Layout,
                    cluster: Cluster) -> list[float]:
    """Per pipeline rank, `sync_time` of its stages' gradients and parameters (all 0 when ZeRO runs as FSDP2
    outside a pipeline, `UnitArrays.fsdp`: its collectives are per unit inside F and B)."""
    grads, params = [0.0] * (max(owner) + 1), [0.0] * (max(owner) + 1)
    if a.fsdp:
        return grads
    for (i, j), r in zip(bounds, owner):
        grads[r] += float(a.grads[i:j].sum())
        params[r] += float(a.params[i:j].sum())
    return [sync_time(g, p, a.zero, layout.shard, cluster, r, layout.sync_per_group) + _hsdp(g, layout, a, cluster, r)
            for r, (g, p) in enumerate(zip(grads, params))]


def _hsdp(grad_bytes: float, layout: Layout, a: UnitArrays, cluster: Cluster, rank: int) -> float:
    """The step's end's HSDP all-reduce of pipeline rank `rank`'s gradient shard across the replicas
    (`hsdp_allreduce_time`; 0 without HSDP or sharding)."""
    if a.zero.replicated or layout.dp_replicate == 1:
        return 0.0
    return hsdp_allreduce_time(grad_bytes / layout.shard, layout.dp_replicate, layout.dp, cluster, rank)


def exposed_sync_time(a: UnitArrays, bounds: Sequence[tuple[int, int]], owner: Sequence[int], layout: Layout,
                      cluster: Cluster, speeds: Sequence[float]) -> float:
    """The part of the slowest rank's step-end synchronisation on the critical path. With `a.overlap.grad_reduce`
    (autopp.data.overlap: DDP's and FSDP2's bucketed reduction, Megatron-LM's `--overlap-grad-reduce`) a rank's
    reduction starts while its last microbatch's backward runs (its stages' B, at their speeds) and only what
    exceeds that backward is exposed: max_r max(0, sync_r - B_r). An assumption on the safe side: a rank that
    finishes its pipeline early (its bubble) hides no more than that. Without the overlap, max_r sync_r."""
    syncs = rank_sync_times(a, bounds, owner, layout, cluster)
    if not a.overlap.grad_reduce:
        return max(syncs)
    window = [0.0] * len(syncs)
    for k, ((i, j), r) in enumerate(zip(bounds, owner)):
        window[r] += float(a.backward[i:j].sum()) / speeds[k]
    return max(max(0.0, s - w) for s, w in zip(syncs, window))


def optimizer_time(a: UnitArrays, bounds: Sequence[tuple[int, int]], owner: Sequence[int],
                   speeds: Sequence[float] | None = None) -> float:
    """The slowest rank's optimizer step: the sum of its stages' units' shares / the stage's device speed (ranks
    step in parallel)."""
    if a.optimizer is None:
        return 0.0
    per_rank: dict[int, float] = {}
    for k, ((i, j), r) in enumerate(zip(bounds, owner)):
        per_rank[r] = per_rank.get(r, 0.0) + float(a.optimizer[i:j].sum()) / (speeds[k] if speeds else 1.0)
    return max(per_rank.values(), default=0.0)


def replica_allreduce_time(a: UnitArrays, cluster: Cluster, bounds: Sequence[tuple[int, int]],
                           owner: Sequence[int]) -> float:
    """Chimera's sum of the two replicas' gradients (Li and Hoefler, SC'21, section 3.4): rank r and rank p - 1 - r
    both hold stages owner r and p - 1 - r (one down, one up replica) and all-reduce their gradients, a ring of 2
    on the link between them (`_ring`); the slowest pair."""
    p = max(owner) + 1
    grads = [0.0] * p
    for (i, j), r in zip(bounds, owner):
        grads[r] += float(a.grads[i:j].sum())
    return max((_ring(grads[r] + grads[p - 1 - r], 2, cluster.link_between(r, p - 1 - r))
                for r in range(p) if r != p - 1 - r), default=0.0)


def step_end_time(a: UnitArrays, cluster: Cluster, bounds: Sequence[tuple[int, int]], owner: Sequence[int],
                  layout: Layout, speeds: Sequence[float], mirrored: bool = False) -> tuple[float, float]:
    """What a step adds after its pipeline drains, per term: (the slowest rank's gradient synchronisation over the
    layout's `sync` ranks, the slowest rank's optimizer step). The judge and the search's estimate add both to the
    pipeline's time; a new per-step term goes here and into `step_end_floor`, reading its degrees from `layout`.
    `mirrored` (Chimera: each rank also holds stage s's up replica on rank p - 1 - owner[s]): the replicas' gradients
    are summed first (`replica_allreduce_time`, in the first term), then each rank synchronises and steps both of
    its replicas."""
    if not mirrored:
        return exposed_sync_time(a, bounds, owner, layout, cluster, speeds), optimizer_time(a, bounds, owner, speeds)
    both, p = [*bounds, *bounds], max(owner) + 1
    up = [*owner, *(p - 1 - r for r in owner)]
    return (replica_allreduce_time(a, cluster, bounds, owner) + gradient_allreduce_time(a, both, up, layout, cluster),
            optimizer_time(a, both, up, [*speeds, *speeds]))


def step_end_floor(a: UnitArrays, cluster: Cluster, layout: Layout, mirrored: bool = False) -> float:
    """A lower bound of `sum(step_end_time(...))` valid for every split into stages on the layout's pp ranks: some
    rank holds at least 1 / pp of the gradients, and the all-reduce grows with bytes (the optimizer step is bounded
    by 0); on a cluster of nodes, with the cheapest rank's group. `mirrored` (Chimera) adds the replicas' sum
    (`replica_allreduce_time`): its pp / 2 pairs of ranks hold all the gradients, so some pair holds at least 2 / pp
    of them, summed on the cheapest link a pipeline transfer may take (an odd pp: none, as the middle rank, its own
    pair, may hold them all)."""
    if a.fsdp:
        return 0.0
    floor = _sync_floor(a, cluster, layout)
    if a.overlap.grad_reduce:  # no rank's last backward hides more than one microbatch's whole backward
        floor -= float(a.backward.sum()) / min(cluster.device(r).speed for r in range(layout.pp))
    pairs = 0.0
    if mirrored and layout.pp % 2 == 0:
        pairs = min(_ring(2 * float(a.grads.sum()) / layout.pp, 2, link) for link in cluster.pipeline_links)
    return max(0.0, floor) + pairs


def _sync_floor(a: UnitArrays, cluster: Cluster, layout: Layout) -> float:
    """`step_end_floor` without overlap: the slowest rank's synchronisation over every split."""
    pp = layout.pp
    ranks = range(pp) if cluster.nodes is not None else range(1)
    g, p = float(a.grads.sum()) / pp, float(a.params.sum()) / pp

    def reduce(nbytes: float, r: int) -> float:
        return allreduce_time(nbytes, layout.shard, cluster, r, layout.sync_per_group)
    if a.zero.replicated:
        return min(reduce(g, r) for r in ranks)
    # some rank holds >= 1 / pp of the parameters, some (maybe another) >= 1 / pp of the gradients
    gathered = min(reduce(p, r) for r in ranks)
    scattered = 0.0 if a.zero.scatters_each_microbatch else min(reduce(g, r) for r in ranks)
    across = min(_hsdp(g, layout, a, cluster, r) for r in ranks)  # HSDP: after the scatter, on the same gradients
    return max(half_collective(gathered), half_collective(scattered) + across)
