"""The outer search: over microbatch counts (divisors of the global batch), run the exact DP and build the Plan."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..cluster import Cluster
from ..costmodel import Schedule
from ..errors import InfeasibleError
from ..plan import Plan, Prediction, StagePlan
from ..profile import Profile
from ..sizes import format_size
from .dp import Split, best_split, even_bounds, evaluate_split, min_peak_memory

__all__ = ["PlanRequest", "make_plan", "microbatch_counts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What the user asked for."""

    cluster: Cluster
    global_batch: int
    """Samples per training step, split into num_microbatches equal microbatches."""
    num_microbatches: int | None = None
    """Pin the microbatch count; None lets the planner pick among the divisors of global_batch."""
    schedule: Schedule = Schedule.ONE_F_ONE_B

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {self.global_batch}")
        if self.num_microbatches is not None and self.global_batch % self.num_microbatches:
            raise ValueError(f"global batch {self.global_batch} is not divisible by {self.num_microbatches} microbatches")


def microbatch_counts(request: PlanRequest) -> list[int]:
    """Candidate microbatch counts: divisors m of the global batch with m >= devices (1F1B needs m >= stages)."""
    if request.num_microbatches is not None:
        candidates = [request.num_microbatches]
    else:
        candidates = [m for m in range(1, request.global_batch + 1) if request.global_batch % m == 0]
    p = request.cluster.num_devices
    usable = [m for m in candidates if m >= p]
    if not usable:
        raise InfeasibleError(f"1F1B needs microbatches >= stages ({max(candidates)} < {p}): use a global batch "
                              f"of at least {p} (it is {request.global_batch}) or fewer devices")
    return usable


def make_plan(profile: Profile, request: PlanRequest) -> Plan:
    """The fastest predicted plan for `request` (ties: least peak memory), with an even split as baseline."""
    n, p, limit = profile.num_units, request.cluster.num_devices, request.cluster.memory_bytes
    if p > n:
        raise InfeasibleError(f"cannot split {n} units into {p} stages: use at most {n} devices "
                              f"(or add SPLIT_POINTS for finer units)")
    link = request.cluster.link
    best: tuple[Split, int] | None = None
    for m in microbatch_counts(request):
        b = request.global_batch // m
        units, cuts = profile.costs(b), profile.cut_bytes(b)
        split = best_split(units, cuts, link, p, m, limit)
        log.info("m=%d: %s", m, "infeasible" if split is None else f"{split.step_s:.6f} s")
        if split is not None and (best is None or (split.step_s, max(split.peak_memory)) < (best[0].step_s, max(best[0].peak_memory))):
            best = (split, m)
    if best is None:
        raise _infeasible(profile, request)
    split, m = best
    b = request.global_batch // m
    even = evaluate_split(profile.costs(b), profile.cut_bytes(b), link, even_bounds(n, p), m)
    return _build_plan(profile, request, split, m, {"even": _prediction(even)})


def _infeasible(profile: Profile, request: PlanRequest) -> InfeasibleError:
    p, link = request.cluster.num_devices, request.cluster.link
    needs = []
    for m in microbatch_counts(request):
        b = request.global_batch // m
        needs.append((min_peak_memory(profile.costs(b), profile.cut_bytes(b), link, p, m), m))
    need, m = min(needs)
    return InfeasibleError(
        f"no split of {profile.num_units} units into {p} stages fits in {format_size(request.cluster.memory_bytes)} "
        f"per device; the smallest that works is {format_size(need)} ({m} microbatches of "
        f"{request.global_batch // m}); use --memory {need} or more, or more devices")


def _prediction(split: Split) -> Prediction:
    return Prediction(step_time_s=split.step_s, peak_memory_bytes=split.peak_memory, bubble_fraction=split.bubble,
                      stage_units=split.bounds)


def _build_plan(profile: Profile, request: PlanRequest, split: Split, m: int, baselines: dict[str, Prediction]) -> Plan:
    names = profile.meta.unit_names
    stages = tuple(
        StagePlan(index=s, rank=s, units=(a, b), unit_names=tuple(names[a:b]),
                  split_point=profile.meta.split_points[a - 1] if a else None,
                  forward_s=c.forward_s, backward_s=c.backward_s, memory_bytes=split.peak_memory[s])
        for s, ((a, b), c) in enumerate(zip(split.bounds, split.stages)))
    return Plan(model_path=profile.meta.model_path, fingerprint=profile.meta.fingerprint,
                schedule=request.schedule.value, num_ranks=len(stages), num_microbatches=m,
                microbatch_size=request.global_batch // m, memory_limit_bytes=request.cluster.memory_bytes,
                stages=stages, predicted=_prediction(split), baselines=baselines)
