"""Where a step's time goes (autopp.data.breakdown), from the same per-unit terms the simulator was given: each
stage's compute, tensor-parallel and ZeRO collectives (exposed and hidden, `UnitArrays.tp_seconds`, `zero_seconds`)
and recomputation over its microbatches, and the step's bubble, synchronisation and optimizer step."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..data.breakdown import StageTime, TimeBreakdown
from ..schedule import Activation, StageCost, policy
from .units import UnitArrays

__all__ = ["time_breakdown"]

#: Idle time below this fraction of the pipeline's is rounding in `pipeline_s x bubble`, not a bubble.
_ROUNDING = 1e-9


def _split(pair: tuple[np.ndarray, np.ndarray] | None, i: int, j: int) -> tuple[float, float]:
    """(exposed, hidden) seconds of one microbatch over units [i, j) of a (total, exposed) pair."""
    if pair is None:
        return 0.0, 0.0
    total, exposed = float(pair[0][i:j].sum()), float(pair[1][i:j].sum())
    return exposed, max(0.0, total - exposed)


def time_breakdown(a: UnitArrays, costs: Sequence[StageCost], bounds: Sequence[tuple[int, int]],
                   activations: Sequence[Activation], microbatches: int, speeds: Sequence[float], *,
                   splits_backward: bool, pipeline_s: float, bubble: float, sync_s: float, sync_total_s: float,
                   optimizer_s: float, resumed_s: Sequence[float] = (),
                   overlapped_s: Sequence[float] = (), scatter_tail_s: Sequence[float] = ()) -> TimeBreakdown:
    """Per stage (`costs`: the simulator's, of `bounds` at `speeds`, under `activations`), its time over
    `microbatches`: F and B (I + W where the schedule splits the backward) less the exposed collectives they contain,
    those collectives, and what the policy redoes as the simulator charges it; per step the bubble (`pipeline_s` x
    the ranks' mean idle fraction `bubble`), the synchronisation after the pipeline (`sync_s` exposed of
    `sync_total_s`) and the optimizer step. `resumed_s` (per stage; () for none): the resume time the simulated
    step charged the stage's actions that started after a wait (`StageCost.resume_s`, `schedule.resumed_s`), part
    of their compute as the simulator counts its ranks' busy time. The expert-parallel all-to-alls inside F and B
    (`StageCost.forward_comm_s` / `backward_comm_s`) are their own term: `overlapped_s` (per stage; () for none) of
    them hidden in overlapped F + B pairs (`SimResult.overlapped_s`), the rest exposed. ZeRO 2's first-unit
    scatters on the ranks' reduce-scatter streams (`StageCost.scatter_s`, m per stage): hidden, but for what the
    streams ran past their ranks' last actions (`scatter_tail_s`, per rank; `SimResult.scatter_tail_s`), which is
    exposed ZeRO time in place of bubble, shared among the stages in proportion to their scatters."""
    stages = []
    resumed = list(resumed_s) or [0.0] * len(costs)
    overlapped = list(overlapped_s) or [0.0] * len(costs)
    streamed = [microbatches * c.scatter_s for c in costs]
    tail = sum(scatter_tail_s)
    for cost, (i, j), sp, act, cold, hid, rs in zip(costs, bounds, speeds, activations, resumed, overlapped, streamed):
        back = cost.backward_input_s + cost.backward_weight_s if splits_backward or cost.backward_s is None \
            else cost.backward_s
        tp, tp_hidden = (x / sp for x in _split(a.tp_seconds, i, j))
        zero, zero_hidden = _split(a.zero_seconds, i, j)
        # what a stage starting at i adds to its units' exposed sums (`UnitArrays.stage_start`, <= 0), and the first
        # unit's scatter on the stream (`UnitArrays.stage_scatter`): the rest of its units' scatters hid in-stage
        start, first = a.start_s(i), a.scatter_s(i)
        zero, zero_hidden = (zero + start) / sp, (zero_hidden - start - first) / sp
        busy = cost.forward_s + back + 2 * cost.overhead_s
        m, ep = microbatches, cost.forward_comm_s + cost.backward_comm_s
        shown = tail * rs / sum(streamed) if rs else 0.0
        stages.append(StageTime(compute_s=m * max(0.0, busy - tp - zero - ep) + cold, tp_s=m * tp,
                                tp_hidden_s=m * tp_hidden, zero_s=m * zero + shown,
                                zero_hidden_s=m * max(0.0, zero_hidden) + rs - shown,
                                ep_s=max(0.0, m * ep - hid), ep_hidden_s=hid,
                                recompute_s=m * policy(act).redo_s(cost)))
    waited = tail / len(scatter_tail_s) if scatter_tail_s else 0.0  # the ranks' mean wait for their streams
    idle = pipeline_s * bubble - waited  # a rank never idle leaves float rounding (2e-16 s at pp 1): no bubble
    return TimeBreakdown(stages=tuple(stages), bubble_s=idle if idle > _ROUNDING * pipeline_s else 0.0, sync_s=sync_s,
                         sync_hidden_s=max(0.0, sync_total_s - sync_s), optimizer_s=optimizer_s)
