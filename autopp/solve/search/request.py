"""What the user asks the planner for, and the configurations that request spans (the outer search space)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from ...data.cluster import Cluster
from ...errors import ScheduleError
from ...schedule import NAMED, ScheduleName, describe, listed

__all__ = ["RecomputeMode", "PlanRequest", "Config", "replica_counts", "microbatch_counts", "zero_stages",
           "tp_choices", "configs"]

#: ZeRO stages the search tries when --zero is not pinned: stage 2 cannot run under torch.distributed.pipelining
#: (docs/parallelism.md), so it is costed only when pinned.
SEARCHED_ZERO = (0, 1, 3)


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
    tp: int | None = 1
    """Tensor-parallel degree (devices per pipeline rank); None: 1 and every degree the profile has rows for that
    fits the cluster (`tp_choices`)."""
    zero: int | None = 0
    """ZeRO stage of the data parallelism (autopp.costmodel.parallel); None: 0, 1 and 3 where dp > 1."""
    tp_across_nodes: bool = False
    """Allow a tensor-parallel group to span nodes (its collectives then run on the inter-node link)."""
    virtual_stages: int | None = None
    """Stages per rank for interleaved schedules; None: 2 and 4 (V schedules always use 2)."""
    recompute: RecomputeMode = RecomputeMode.NONE
    recompute_stages: tuple[int, ...] | None = None
    """Stages that recompute, pinned (--recompute-stages; None: chosen by `recompute`)."""
    shortlist: int = 4
    """Configurations the simulator must find fitting before the search stops."""
    synthesize: bool = False
    """Also try a CP-SAT-synthesized order for the best candidate's split (autopp.solve.assemble.reorder)."""
    synth_time_limit_s: float = 10.0
    """CP-SAT time limit of that synthesis."""
    placement_time_limit_s: float = 10.0
    """CP-SAT time limit for choosing the device order of a heterogeneous cluster (autopp.solve.cpsat.placement)."""

    def __post_init__(self) -> None:
        d = self.cluster.num_devices
        if self.global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {self.global_batch}")
        pins = [x for x in (self.pp, self.dp, self.tp) if x is not None]
        if len(pins) == 3 and self.pp * self.dp * self.tp != d:  # type: ignore[operator]
            raise ValueError(f"pp({self.pp}) * dp({self.dp}) * tp({self.tp}) != devices ({d})")
        for name, value in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp)):
            if value is not None and (value < 1 or d % value):
                raise ValueError(f"{name}={value} does not divide the {d} devices")
        if len(pins) == 2 and d % (pins[0] * pins[1]):
            raise ValueError(f"the pinned degrees ({' x '.join(map(str, pins))}) do not divide the {d} devices")
        if self.zero not in (None, 0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {self.zero} does not exist; give 0, 1, 2 or 3")
        if self.zero and self.dp == 1:
            raise ValueError(f"ZeRO stage {self.zero} shards over data-parallel replicas, and dp is 1: give --dp D "
                             f"(or auto) with it, or --zero 0")
        self._check_tp()
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


    def _check_tp(self) -> None:
        if self.tp in (None, 1):
            return
        if not self.cluster.homogeneous:
            raise ValueError("tensor parallelism needs identical devices; give --tp 1 with a heterogeneous cluster")
        nodes = self.cluster.nodes
        if nodes is None or nodes.devices_per_node % self.tp == 0:
            return
        if not self.tp_across_nodes:
            raise ValueError(f"tp={self.tp} does not fit in a node of {nodes.devices_per_node} devices; give a divisor "
                             f"of {nodes.devices_per_node}, or --tp-across-nodes to let tensor-parallel groups span "
                             f"nodes")
        if self.tp % nodes.devices_per_node:
            raise ValueError(f"tp={self.tp} neither fits in a node of {nodes.devices_per_node} devices nor spans whole "
                             f"nodes: give a divisor or a multiple of {nodes.devices_per_node}")

    def view(self, tp: int) -> PlanRequest:
        """The request as tensor-parallel degree `tp` sees it: each group of `tp` devices is one pipeline rank
        (`Cluster.tp_groups`), so the pipeline x data-parallel search runs on the groups unchanged."""
        if tp == 1:
            return replace(self, tp=1)
        return replace(self, cluster=self.cluster.tp_groups(tp), tp=1)

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
    tp: int = 1
    zero: int = 0


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


def zero_stages(req: PlanRequest, dp: int) -> tuple[int, ...]:
    """The ZeRO stages to try with `dp` replicas: 0 without replicas, else the pinned one or SEARCHED_ZERO."""
    if dp == 1:
        return (0,)
    return SEARCHED_ZERO if req.zero is None else (req.zero,)


def tp_choices(req: PlanRequest, profiled: tuple[int, ...]) -> list[int]:
    """Tensor-parallel degrees to search: the pinned one, else 1 and each degree in `profiled` (the profile's
    `tp_degrees`) that divides the devices and, unless `tp_across_nodes`, the devices per node."""
    if req.tp is not None:
        return [req.tp]
    nodes, d = req.cluster.nodes, req.cluster.num_devices
    fits = lambda t: d % ((req.pp or 1) * (req.dp or 1) * t) == 0 and (nodes is None or nodes.devices_per_node % t == 0  # noqa: E731
                                     or req.tp_across_nodes and t % nodes.devices_per_node == 0)
    return [1, *(t for t in sorted(profiled) if t > 1 and fits(t) and req.cluster.homogeneous)]


def configs(req: PlanRequest, n: int, degrees: tuple[int, ...] = (1,)) -> list[Config]:
    """Every valid configuration of the request for a model of `n` units, for each tensor-parallel degree in
    `degrees` (pp and dp count groups of tp devices: `PlanRequest.view`)."""
    return [replace(c, tp=tp, zero=zero) for tp in degrees for c in _pipeline_configs(req.view(tp), n)
            for zero in zero_stages(req, c.dp)]


def _pipeline_configs(req: PlanRequest, n: int) -> list[Config]:
    """The pipeline x data-parallel configurations of a request (tp 1 or a `view`)."""
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
