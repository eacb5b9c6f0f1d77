"""Where a predicted step's time goes: per stage its compute, tensor-parallel collectives, ZeRO collectives inside
the stage and recomputation; per step the pipeline bubble, the data-parallel / ZeRO synchronisation at the step's end
and the optimizer step. Collectives are split into exposed (on the critical path) and hidden (under compute, by the
overlap the plan assumes: autopp.data.overlap).

One value that the plan table, `autopp show` and the plan JSON read (`Plan.time_breakdown`); the planner fills it
from the cost model's terms (autopp.costmodel.breakdown). All figures are seconds over one step of one replica.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .fields import Fields

__all__ = ["StageTime", "TimeBreakdown", "breakdown_of"]


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """One stage's busy time over a step's microbatches, by what it is spent on."""

    compute_s: float
    """Forward and backward compute, without the collectives and recomputation below."""
    tp_s: float = 0.0
    """Tensor- (and sequence-) parallel collectives on the critical path."""
    tp_hidden_s: float = 0.0
    """Tensor-parallel collectives hidden under the matmuls (async TP)."""
    zero_s: float = 0.0
    """ZeRO collectives inside the forward and backward on the critical path (stage 3's all-gathers under a
    pipeline, stage 2's reduce-scatters, FSDP2's per-layer collectives at pp 1)."""
    zero_hidden_s: float = 0.0
    """ZeRO collectives hidden under the neighbouring layers' compute (FSDP2's prefetch)."""
    recompute_s: float = 0.0
    """What the stage's activation policy redoes (the forward again, or the selective part)."""
    ep_s: float = 0.0
    """Expert parallelism's dispatch and combine all-to-alls inside F and B on the critical path."""
    ep_hidden_s: float = 0.0
    """Those hidden under another microbatch's compute (DualPipeV's overlapped forward-backward pairs)."""

    @property
    def busy_s(self) -> float:
        """The stage's time on its rank: everything but the hidden collectives."""
        return self.compute_s + self.tp_s + self.zero_s + self.recompute_s + self.ep_s


@dataclass(frozen=True, kw_only=True)
class TimeBreakdown:
    """A predicted step's time by stage and by step-level term (module docstring)."""

    stages: tuple[StageTime, ...]
    bubble_s: float
    """The pipeline's idle time: the pipeline's time x the ranks' mean idle fraction (the simulator's)."""
    sync_s: float
    """The data-parallel gradient all-reduce or ZeRO's reduce-scatter and all-gather after the pipeline, on the
    critical path (the slowest rank's)."""
    sync_hidden_s: float
    """The part of it hidden under the last backward (`Overlap.grad_reduce`)."""
    optimizer_s: float
    """The slowest rank's optimizer step."""

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "stages"},
                "stages": [asdict(s) for s in self.stages]}

    SYNC = "DP/ZeRO at the step's end"
    """The name of the step's-end term in `rows`."""

    def rows(self, ranks: int = 1) -> list[tuple[str, float, float]]:
        """(term, exposed seconds, hidden seconds): the stages' terms summed and averaged over the `ranks` pipeline
        ranks that run them, then the step's terms; the exposed seconds add up to the predicted step. What the plan
        table and `autopp show` print; the expert-parallel row only where a stage has all-to-alls."""
        total = {f.name: sum(getattr(s, f.name) for s in self.stages) / ranks for f in fields(StageTime)}
        ep = [("EP all-to-alls", total["ep_s"], total["ep_hidden_s"])] if total["ep_s"] + total["ep_hidden_s"] else []
        return [("compute", total["compute_s"], 0.0), ("recomputation", total["recompute_s"], 0.0),
                ("TP/SP collectives", total["tp_s"], total["tp_hidden_s"]),
                ("ZeRO collectives in F/B", total["zero_s"], total["zero_hidden_s"]), *ep,
                ("pipeline bubble", self.bubble_s, 0.0), (self.SYNC, self.sync_s, self.sync_hidden_s),
                ("optimizer step", self.optimizer_s, 0.0)]


def breakdown_of(data: Any, f: Fields) -> TimeBreakdown:
    """The TimeBreakdown of its JSON object (`TimeBreakdown.to_json`), every field a finite number >= 0; a PlanError
    naming the field otherwise (`f`)."""
    f.record(data, TimeBreakdown)
    stages = f.entries(data["stages"], "stages")
    for i, s in enumerate(stages):
        g = f.at(f"stage {i}")
        g.record(s, StageTime)
        for name, value in s.items():
            g.number(value, name)
    for name in ("bubble_s", "sync_s", "sync_hidden_s", "optimizer_s"):
        f.number(data[name], name)
    return TimeBreakdown(stages=tuple(StageTime(**s) for s in stages),
                         **{k: v for k, v in data.items() if k != "stages"})
