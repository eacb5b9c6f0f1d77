"""Synthesized schedules in the planner: CP-SAT reorders the best named plan's F/I/W actions for its real stage costs.

The split, placement and microbatches stay those of the best named candidate;
`autopp.solve.cpsat.synthesis.synthesize` searches the order (Zero Bubble's ILP idea, Qi et al. 2023) warm-started
from that candidate's own schedule, and the simulator judges the result. The synthesized order wins only when it
simulates strictly faster and fits every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ...data.cluster import Cluster
from ...costmodel import UnitArrays, comm_times, progress_delays
from ...errors import InfeasibleError
from ...schedule import Action, build_schedule, simulate
from ..cpsat.synthesis import synthesize
from ..search.judge import Verdict, step_time

__all__ = ["CustomOrder", "synthesized"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CustomOrder:
    """A synthesized order and its verdict (the candidate keeps the named schedule whose layout it uses)."""

    verdict: Verdict
    order: dict[int, list[Action]]
    gap: float
    status: str


def synthesized(a: UnitArrays, cluster: Cluster, best: Verdict, time_limit_s: float) -> CustomOrder | None:
    """The synthesized order for `best`'s split if it simulates faster than `best`, else None.

    Recomputing stages and Chimera's two replicas per rank are left to the named schedules (the synthesis model keeps
    activations from F to W and gives each stage one rank), and so is a ZeRO stage with a `split_backward_refusal`
    (the synthesized orders split every backward). The
    synthesis does not model the links' progress delays; its order is re-simulated with them before it is compared."""
    c = best.candidate
    if c.recomputing or c.mirror is not None:  # Chimera: the synthesis gives each stage one rank
        return None
    if c.layout.zero.split_backward_refusal:  # its orders split every backward into I and W
        return None
    owner = c.owner
    cluster = cluster.placed(c.layout)
    limits = [cluster.device(r).memory_bytes for r in range(c.layout.pp)]
    hint = build_schedule(c.schedule, c.layout.pp, c.microbatches, c.layout.v)
    comm = comm_times(a, cluster, c.bounds, owner)
    try:
        result = synthesize(best.costs, owner, c.microbatches, comm, limits, time_limit_s=time_limit_s, hint=hint)
    except InfeasibleError:
        return None
    delays = progress_delays(cluster, owner)
    sim = simulate(result.order, best.costs, owner, comm, None, delays) if any(delays) else result.sim
    step = step_time(sim.step_time_s, best.allreduce_s, best.optimizer_s)
    log.info("synthesized order: %.6g s (%s, gap %.1f%%) vs %s %.6g s", step, result.status.value,
             100 * result.gap, c.schedule.value, best.step_s)
    peaks = tuple(int(x) for x in sim.peak_memory_bytes)
    if step >= best.step_s or any(p > lim for p, lim in zip(peaks, limits)):
        return None
    bubble = sum(sim.bubble_fraction) / len(sim.bubble_fraction)
    verdict = replace(best, step_s=step, pipeline_s=sim.step_time_s, peak_memory=peaks, bubble=bubble)
    return CustomOrder(verdict, result.order, result.gap, result.status.value)
