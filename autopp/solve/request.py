"""What the user asks the planner for, and the configurations that request spans (the outer search space)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..data.cluster import Cluster
from ..errors import ScheduleError
from ..schedule import NAMED, ScheduleName, describe, listed

__all__ = ["RecomputeMode", "PlanRequest", "Config", "replica_counts", "microbatch_counts", "configs"]


class RecomputeMode(enum.Enum):
    """Activation recomputation policy."""

    NONE = "none"
    ALL = "all"
    AUTO = "auto"
    """Recompute only the stages of ranks that would not fit otherwise."""


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What the user asked for; None for a field means "search it"."""

    cluster: Cluster
    global_batch: int
    """Samples per training step over all replicas: dp x microbatches x microbatch size."""
    num_microbatches: int | None = None
    """Microbatches per replica; None: every count that divides global_batch / dp."""
    schedule: ScheduleName | None = ScheduleName.ONE_F_ONE_B
    """None: every named schedule."""
    pp: int | None = None
    """Pipeline ranks; None: devices / dp."""
    dp: int | None = 1
    """Data-parallel replicas; None: every divisor of the devices."""
    virtual_stages: int | None = None
    """Stages per rank for interleaved schedules; None: 2 and 4 (V schedules always use 2)."""
    recompute: RecomputeMode = RecomputeMode.NONE
    recompute_stages: tuple[int, ...] | None = None
    """Stages that recompute, pinned (--recompute-stages; None: chosen by `recompute`)."""
    shortlist: int = 4
    """Configurations the simulator must find fitting before the search stops."""
    synthesize: bool = False
    """Also try a CP-SAT-synthesized order for the best candidate's split (autopp.solve.custom)."""
    synth_time_limit_s: float = 10.0
    """CP-SAT time limit of that synthesis."""
    placement_time_limit_s: float = 10.0
    """CP-SAT time limit for choosing the device order of a heterogeneous cluster (autopp.solve.placement)."""

    def __post_init__(self) -> None:
        d = self.cluster.num_devices
        if self.global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {self.global_batch}")
        if self.pp is not None and self.dp is not None and self.pp * self.dp != d:
            raise ValueError(f"dp({self.dp}) * pp({self.pp}) != devices ({d})")
        for name, value in (("pp", self.pp), ("dp", self.dp)):
            if value is not None and (value < 1 or d % value):
                raise ValueError(f"{name}={value} does not divide the {d} devices")
        if self.num_microbatches is not None and self.global_batch % self.num_microbatches:
            raise ValueError(f"global batch {self.global_batch} is not divisible by {self.num_microbatches} microbatches")
        if self.virtual_stages not in (None, 1) and self.schedule is not None and describe(self.schedule).single_stage:
            raise ValueError(f"{self.schedule.value} runs one stage per rank, so --virtual-stages "
                             f"{self.virtual_stages} does not apply; use "
                             f"{listed(lambda d: d.fixed_v is None and not d.given_order)} or --schedule auto")
        if self.schedule is not None and describe(self.schedule).given_order:
            raise ValueError(f"{self.schedule.value} is a plan's own order, not a schedule to plan for; use one of "
                             f"{listed(lambda d: True)} or --schedule auto")
        self._check_recompute_stages()
        if not self.cluster.homogeneous and self.dp not in (1, None):
            raise ValueError("data parallelism needs identical devices; give --dp 1 with a heterogeneous cluster")


    def pinned_flags(self, num_stages: int) -> tuple[bool, ...] | None:
        """The per-stage recompute flags `recompute_stages` pins for `num_stages` stages (None: not pinned)."""
        if self.recompute_stages is None:
            return None
        return tuple(s in self.recompute_stages for s in range(num_stages))

    def _check_recompute_stages(self) -> None:
        stages = self.recompute_stages
        if stages is None:
            return
        if any(s < 0 for s in stages) or len(set(stages)) != len(stages):
            raise ValueError(f"--recompute-stages {','.join(map(str, stages))}: give distinct stage indices >= 0")
        if self.recompute is not RecomputeMode.NONE:
            raise ValueError(f"--recompute-stages pins each stage's recomputation; drop --recompute "
                             f"{self.recompute.value}")


@dataclass(frozen=True)
class Config:
    """One point of the outer search (the split is chosen inside it)."""

    schedule: ScheduleName
    pp: int
    dp: int
    v: int
    m: int
    b: int


def replica_counts(req: PlanRequest) -> list[int]:
    d = req.cluster.num_devices
    if req.dp is not None:
        return [req.dp]
    if req.pp is not None:
        return [d // req.pp]
    return [x for x in range(1, d + 1) if d % x == 0 and req.cluster.homogeneous or x == 1]


def microbatch_counts(req: PlanRequest, dp: int) -> list[int]:
    """Candidate microbatch counts per replica: divisors of global_batch / dp (or the pinned count)."""
    if req.global_batch % dp:
        return []
    per = req.global_batch // dp
    if req.num_microbatches is not None:
        return [req.num_microbatches] if per % req.num_microbatches == 0 else []
    return [m for m in range(1, per + 1) if per % m == 0]


def configs(req: PlanRequest, n: int) -> list[Config]:
    """Every valid configuration of the request for a model of `n` units."""
    names = [req.schedule] if req.schedule else list(NAMED)
    out = []
    for dp in replica_counts(req):
        pp = req.cluster.num_devices // dp
        for name in names:
            d = describe(name)
            for v in d.v_choices(req.virtual_stages):
                if pp * d.stages_per_rank(v) > n:
                    continue
                for m in microbatch_counts(req, dp):
                    try:
                        d.validate(pp, m, v)
                    except ScheduleError:
                        continue
                    out.append(Config(name, pp, dp, d.stages_per_rank(v), m, req.global_batch // (dp * m)))
    return out
