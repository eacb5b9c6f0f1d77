"""One pipeline stage of a plan, the simulator's costs of it, and the least time one microbatch keeps each pipeline
rank busy. No torch here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PlanError
from ..schedule.activation import FIGURED, Activation, Figures, figure_keys
from ..schedule.descriptors import Pairing, ScheduleName, describe, pairing
from ..schedule.effects import StageCost
from ..schedule.sim_state import hidden_s
from .plan_fields import FIGURE_FIELDS, NULLABLE, STAGE_NUMBERS

__all__ = ["StagePlan", "busiest_rank", "figure_fields"]


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage: the units [first, end) of the profile, placed on `rank`."""

    index: int
    rank: int
    units: tuple[int, int]
    """Half-open range of unit indices."""
    unit_names: tuple[str, ...]
    split_point: str | None
    """Module before which this stage begins (None for stage 0)."""
    forward_s: float
    """Predicted forward time of one microbatch."""
    backward_s: float
    """Predicted backward time of one microbatch."""
    memory_bytes: int
    """Predicted peak memory of the rank that runs this stage (all its stages together), from the simulator."""
    activation: Activation = Activation.KEEP
    """What this stage keeps of a microbatch's forward for its backward (autopp.schedule.activation); stored in JSON
    as its name ("keep", "recompute", "selective")."""
    backward_input_s: float | None = None
    """Input-gradient pass (I) of split-backward schedules; None in plans that predate it (then I = W =
    backward_s / 2)."""
    backward_weight_s: float | None = None
    """Weight-gradient pass (W); I + W usually exceeds the full backward. None in plans that predate it (then
    W = backward_s - I)."""
    static_bytes: int = 0
    """Parameters + gradients + optimizer state of this stage."""
    activation_bytes: int = 0
    """Bytes saved for backward by one microbatch's forward."""
    input_bytes: int = 0
    """Bytes of this stage's input per microbatch (kept instead of activations when recomputing)."""
    send_s: float = 0.0
    """Predicted time to send one microbatch's output to the next stage (0 on the same rank or for the last)."""
    progress_s: float = 0.0
    """Longest this stage's output (and the gradient coming back to it) waits for its sender to stop computing
    (the link's `progress_s`; 0 on the same rank or for the last stage)."""
    overhead_s: float = 0.0
    """Time the rank spends on this stage's messages to and from other ranks per F and per B (or I) action, besides
    compute and waiting (the links' `overhead_s`, once per message); the simulator adds it to both."""
    transient_bytes: int = 0
    """Largest working memory of the stage's units (effects.TRANSIENT); 0 and not written without peak data."""
    own: tuple[tuple[Activation, Figures], ...] = ()
    """The own figures of the stage's activation policy (`StageCost.own`, that policy's only: the plan is simulated
    as written); in JSON as three fields (`figure_keys`: "selective_bytes", "selective_redo_s",
    "selective_redone_bytes"), not written when 0."""
    comm_s: float = 0.0
    """Communication in each F and full backward (expert parallelism's all-to-alls, in forward_s and backward_s)
    that an overlapping schedule hides (`StageCost.forward_comm_s`); 0 and not written without it."""
    sync_s: float = 0.0
    """The part of each backward that every rank runs at once as one collective (the vocabulary output pass, in
    backward_s and backward_input_s; `StageCost.sync_s`); 0 and not written without it."""
    resume_s: float = 0.0  #: extra time of an action after its rank waited (`StageCost.resume_s`); 0: not written
    scatter_s: float = 0.0  #: ZeRO 2's first-unit scatter on the rank's stream (`StageCost.scatter_s`); 0: not written
    output_bytes: int = 0
    """Bytes of this stage's outputs per microbatch, which torch's stage keeps from its forward until its backward
    (`StageCost.output_bytes`; the last stage's: the model's output); 0 (plans written before 2026-12-06, profiles
    before the model's output was recorded, and every stage but the last of a plan whose pipeline frees them once
    sent, `Plan.frees_outputs`) and not written."""
    recompute_s: float | None = None
    """The recomputed forward's time where the stage's policy recomputes its forward (`StageCost.recompute_s`: the
    units' `recompute_s`, without ZeRO 3's gather); None (not written) otherwise, and in plans written before
    2026-12-06, whose recomputation took `forward_s`."""

    def cost(self) -> StageCost:
        """The simulator's costs of this stage (I = W = B / 2 for plans written before the split was stored, and
        W = B - I for plans written before W was)."""
        i = self.backward_input_s if self.backward_input_s is not None else self.backward_s / 2
        w = self.backward_weight_s if self.backward_weight_s is not None else self.backward_s - i
        return StageCost(forward_s=self.forward_s, backward_input_s=i, backward_weight_s=w,
                         backward_s=None if self.backward_weight_s is None else self.backward_s,
                         static_bytes=self.static_bytes, activation_bytes=self.activation_bytes,
                         input_bytes=self.input_bytes, overhead_s=self.overhead_s,
                         transient_bytes=self.transient_bytes, own=self.own, forward_comm_s=self.comm_s,
                         backward_comm_s=self.comm_s, sync_s=self.sync_s, resume_s=self.resume_s,
                         scatter_s=self.scatter_s, output_bytes=self.output_bytes, recompute_s=self.recompute_s)

    def __post_init__(self) -> None:
        if not isinstance(self.activation, Activation):  # a programming error: from_json parses the name
            raise TypeError(f"StagePlan.activation must be an Activation, got {self.activation!r}")
        numbers = {**{name: getattr(self, name) for name in STAGE_NUMBERS if name not in FIGURE_FIELDS},
                   **figure_fields(self.own)}
        for name, value in numbers.items():
            if value is None and name in NULLABLE:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise PlanError(f"stage {self.index}: {name} must be a finite number >= 0, got {value!r}")


def figure_fields(own: tuple[tuple[Activation, Figures], ...]) -> dict[str, float]:
    """A stage's policy figures as its JSON fields (`figure_keys`), every figured policy's (0 when it has none)."""
    given = dict(own)
    return {k: v for a in FIGURED for k, v in zip(figure_keys(a), given.get(a, Figures()))}


def busiest_rank(stages: Sequence[StagePlan], schedule: ScheduleName, pp: int, v: int = 1,
                 ep_a2a: bool = False) -> tuple[int, float]:
    """The pipeline rank whose stages take longest per microbatch, and that time: each stage's forward and the
    shorter of its full backward and I + W. Where the schedule overlaps F + B pairs (`schedule.pairing`:
    DualPipeV's; with `ep_a2a` and v > 1, Interleaved1F1B's under Megatron-Core's combined 1F1B), a backward run
    right after a forward on its rank (another stage's for DualPipeV) is shortened by what the pair hides (the
    simulator's own `sim_state.hidden_s`: the all-to-alls of one under the other's compute, DeepSeek-V3 s.3.2.1);
    each backward is taken at its most hidden, so the time stays a lower bound. Chimera: half of the microbatches
    through each of a rank's two replicas."""
    costs, ranks, d = [s.cost() for s in stages], [s.rank for s in stages], describe(schedule)
    rule = pairing(schedule, ep_a2a, v)
    work: dict[int, float] = {}
    for s, (c, rank) in enumerate(zip(costs, ranks)):
        split = c.backward_input_s + c.backward_weight_s
        backward = split if c.backward_s is None else min(c.backward_s, split)
        if rule is not None:
            partners = [costs[t] for t, r in enumerate(ranks) if r == rank and (t != s or rule is Pairing.MICROBATCHES)]
            backward = max(0.0, backward - max((hidden_s(f, c) for f in partners), default=0.0))
        work[rank] = work.get(rank, 0.0) + c.forward_s + backward
    if d.mirrored:
        work = {r: (w + work.get(pp - 1 - r, 0.0)) / 2 for r, w in work.items()}
    return max(work.items(), key=lambda kv: kv[1])
