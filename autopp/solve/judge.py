"""The judge: a fully specified candidate (schedule, pp, dp, v, microbatches, split, recompute) → simulated figures."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from ..cluster import Cluster
from ..schedule import COMPUTE_KINDS, Action, Kind, ScheduleName, StageCost, build_schedule, simulate, stage_to_rank
from .arrays import UnitArrays
from .dp import Bounds

__all__ = ["Candidate", "Verdict", "stage_costs", "message_overheads", "progress_delays", "comm_times",
           "allreduce_time", "optimizer_time", "order_peaks", "rank_peak", "named_order", "judge"]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """Everything that fixes one training step's layout."""

    schedule: ScheduleName
    pp: int
    """Pipeline ranks per replica."""
    dp: int
    """Data-parallel replicas."""
    v: int
    """Stages per pipeline rank."""
    microbatches: int
    """Microbatches per replica per step."""
    microbatch_size: int
    bounds: Bounds
    recompute: tuple[bool, ...]

    @property
    def owner(self) -> list[int]:
        return stage_to_rank(self.schedule, self.pp, self.v)


@dataclass(frozen=True)
class Verdict:
    """The simulator's figures for a candidate (step time includes the data-parallel gradient all-reduce)."""

    candidate: Candidate
    step_s: float
    pipeline_s: float
    allreduce_s: float
    peak_memory: tuple[int, ...]
    """Per pipeline rank."""
    bubble: float
    """Mean over pipeline ranks of the simulator's idle fraction."""
    fits: bool
    costs: tuple[StageCost, ...]
    optimizer_s: float = 0.0
    """The slowest pipeline rank's optimizer step (included in step_s)."""

    @property
    def key(self) -> tuple[float, int]:
        """Order of preference: faster, then less memory."""
        return (self.step_s, max(self.peak_memory))


def _speeds(cluster: Cluster, owner: Sequence[int]) -> list[float]:
    return [cluster.device(r).speed for r in owner]


def stage_costs(a: UnitArrays, bounds: Bounds, speeds: Sequence[float], overheads: Sequence[float] | None = None
                ) -> list[StageCost]:
    """Simulator costs of each stage: times scaled by its device's speed; a recomputing stage keeps its input;
    `overheads`: per stage, the message overhead of each F and B/I (`message_overheads`; default none). Like
    torch's first stage, stage 0 has no input-gradient pass: its I is 0 and its W one full backward."""
    out = []
    for s, ((i, j), sp) in enumerate(zip(bounds, speeds)):
        full = float(a.backward[i:j].sum()) / sp
        out.append(StageCost(forward_s=float(a.forward[i:j].sum()) / sp,
                             backward_input_s=0.0 if s == 0 else float(a.backward_input[i:j].sum()) / sp,
                             backward_weight_s=full if s == 0 else float(a.backward_weight[i:j].sum()) / sp,
                             backward_s=full,
                             static_bytes=int(a.static[i:j].sum()), activation_bytes=int(a.activation[i:j].sum()),
                             input_bytes=int(a.cut[i]), overhead_s=overheads[s] if overheads else 0.0))
    return out


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


def comm_times(a: UnitArrays, cluster: Cluster, bounds: Bounds, owner: Sequence[int]) -> list[float]:
    """Transfer time across each stage boundary (0 between stages on the same rank)."""
    return [0.0 if owner[k] == owner[k + 1] else cluster.link_between(owner[k], owner[k + 1]).transfer_s(float(a.cut[j]))
            for k, (_, j) in enumerate(bounds[:-1])]


def allreduce_time(grad_bytes: float, dp: int, cluster: Cluster) -> float:
    """Ring all-reduce of `grad_bytes` over `dp` replicas: 2 (dp - 1) / dp x bytes / bandwidth + 2 (dp - 1) latencies."""
    if dp <= 1 or grad_bytes <= 0:
        return 0.0
    link = cluster.dp_link
    return 2 * (dp - 1) / dp * grad_bytes / link.bandwidth_bytes_per_s + 2 * (dp - 1) * link.latency_s


def optimizer_time(a: UnitArrays, bounds: Bounds, owner: Sequence[int], speeds: Sequence[float] | None = None
                   ) -> float:
    """The slowest rank's optimizer step: the sum of its stages' units' shares / the stage's device speed (ranks
    step in parallel)."""
    if a.optimizer is None:
        return 0.0
    per_rank: dict[int, float] = {}
    for k, ((i, j), r) in enumerate(zip(bounds, owner)):
        per_rank[r] = per_rank.get(r, 0.0) + float(a.optimizer[i:j].sum()) / (speeds[k] if speeds else 1.0)
    return max(per_rank.values(), default=0.0)


def _rank_allreduce(a: UnitArrays, c: Candidate, cluster: Cluster) -> float:
    grads = [0.0] * c.pp
    for (i, j), r in zip(c.bounds, c.owner):
        grads[r] += float(a.grads[i:j].sum())
    return max(allreduce_time(g, c.dp, cluster) for g in grads)


def rank_peak(actions: Sequence[Action], costs: Sequence[StageCost], recompute: Sequence[bool], static: int) -> int:
    """Peak memory of one rank running `actions` in list order (one at a time, so its allocations and frees happen
    in that order: the simulator's peak without timing). `static`: the rank's parameter/gradient/optimizer bytes."""
    held = peak = static
    for s, kind, _ in actions:
        c, rc = costs[s], recompute[s]
        if kind is Kind.F:
            held += c.input_bytes if rc else c.activation_bytes
            peak = max(peak, held)
            continue
        if kind is not Kind.W and rc:
            held += c.activation_bytes
        peak = max(peak, held)
        if kind is not Kind.I:  # B or W ends: this microbatch's activations (and kept input) are freed
            held -= (c.input_bytes + c.activation_bytes) if rc else c.activation_bytes
    return peak


def order_peaks(order: dict[int, list[Action]], costs: Sequence[StageCost], owner: Sequence[int],
                recompute: Sequence[bool]) -> list[int]:
    """Per-rank peak memory from the order alone (rank_peak of every rank)."""
    return [rank_peak([a for a in order[r] if a is not None and a.kind in COMPUTE_KINDS], costs, recompute,
                      sum(c.static_bytes for c, o in zip(costs, owner) if o == r)) for r in sorted(order)]


@lru_cache(maxsize=12)
def named_order(name: ScheduleName, pp: int, m: int, v: int) -> dict[int, list[Action]]:
    """build_schedule, memoised: the recompute pass and the simulator of one candidate (and the baselines, which
    share its layout) read the same order, and a large one costs seconds to build. Callers must not mutate it."""
    return build_schedule(name, pp, m, v)


def judge(a: UnitArrays, cluster: Cluster, c: Candidate) -> Verdict:
    """Simulate the candidate's named schedule and add the gradient all-reduce."""
    owner = c.owner
    costs = stage_costs(a, c.bounds, _speeds(cluster, owner), message_overheads(cluster, owner))
    order = named_order(c.schedule, c.pp, c.microbatches, c.v)
    sim = simulate(order, costs, owner, comm_times(a, cluster, c.bounds, owner), c.recompute,
                   progress_delays(cluster, owner))
    ar = _rank_allreduce(a, c, cluster)
    peaks = tuple(int(x) for x in sim.peak_memory_bytes)
    fits = all(p <= cluster.device(r).memory_bytes for r, p in enumerate(peaks))
    opt = optimizer_time(a, c.bounds, owner, _speeds(cluster, owner))
    return Verdict(c, sim.step_time_s + ar + opt, sim.step_time_s, ar, peaks,
                   sum(sim.bubble_fraction) / len(sim.bubble_fraction), fits, tuple(costs), opt)
