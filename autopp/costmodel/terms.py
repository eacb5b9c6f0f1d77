"""Cost terms of messages and of the step's end: point-to-point transfers (scalar and vectorised), per-message
overheads, progress delays, the ring all-reduce of gradients and the optimizer step."""

from __future__ import annotations

from typing import Sequence, TypeVar

import numpy as np

from ..data.cluster import Cluster, Link
from .units import UnitArrays

__all__ = ["transfer_time", "send_times", "comm_times", "message_overheads", "progress_delays", "allreduce_time",
           "gradient_allreduce_time", "optimizer_time", "step_end_time", "step_end_floor"]

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


def allreduce_time(grad_bytes: float, dp: int, cluster: Cluster) -> float:
    """Ring all-reduce of `grad_bytes` over `dp` replicas: 2 (dp - 1) / dp x bytes / bandwidth + 2 (dp - 1) latencies."""
    if dp <= 1 or grad_bytes <= 0:
        return 0.0
    link = cluster.dp_link
    return 2 * (dp - 1) / dp * grad_bytes / link.bandwidth_bytes_per_s + 2 * (dp - 1) * link.latency_s


def gradient_allreduce_time(a: UnitArrays, bounds: Sequence[tuple[int, int]], owner: Sequence[int], dp: int,
                            cluster: Cluster) -> float:
    """The slowest pipeline rank's all-reduce of its stages' gradients over `dp` replicas (ranks reduce in
    parallel)."""
    grads = [0.0] * (max(owner) + 1)
    for (i, j), r in zip(bounds, owner):
        grads[r] += float(a.grads[i:j].sum())
    return max(allreduce_time(g, dp, cluster) for g in grads)


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


def step_end_time(a: UnitArrays, cluster: Cluster, bounds: Sequence[tuple[int, int]], owner: Sequence[int], dp: int,
                  speeds: Sequence[float]) -> tuple[float, float]:
    """What a step adds after its pipeline drains, per term: (the slowest rank's gradient all-reduce over `dp`
    replicas, the slowest rank's optimizer step). The judge and the search's estimate add both to the pipeline's
    time; a new per-step term goes here and into `step_end_floor`."""
    return gradient_allreduce_time(a, bounds, owner, dp, cluster), optimizer_time(a, bounds, owner, speeds)


def step_end_floor(a: UnitArrays, cluster: Cluster, pp: int, dp: int) -> float:
    """A lower bound of `sum(step_end_time(...))` valid for every split into stages on `pp` ranks: some rank holds at
    least 1 / pp of the gradients, and the all-reduce grows with bytes (the optimizer step is bounded by 0)."""
    return allreduce_time(float(a.grads.sum()) / pp, dp, cluster)
