"""Drive torch.distributed.pipelining's schedule classes with fake stages to read the order torch executes."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import schedules as ts

from autopp.schedule.actions import Action, Kind
from autopp.schedule import StagePlacement, ScheduleName, describe

__all__ = ["FakeStage", "TORCH_CLASSES", "to_torch_action", "torch_order"]

TORCH_CLASSES: dict[ScheduleName, Any] = {
    ScheduleName.GPIPE: ts.ScheduleGPipe,
    ScheduleName.ONE_F_ONE_B: ts.Schedule1F1B,
    ScheduleName.INTERLEAVED_1F1B: ts.ScheduleInterleaved1F1B,
    ScheduleName.LOOPED_BFS: ts.ScheduleLoopedBFS,
    ScheduleName.INTERLEAVED_ZERO_BUBBLE: ts.ScheduleInterleavedZeroBubble,
    ScheduleName.ZBV_ZERO_BUBBLE: ts.ScheduleZBVZeroBubble,
    ScheduleName.DUAL_PIPE_V: ts.ScheduleDualPipeV,
}


class FakeStage:
    """Just enough of a PipelineStage for schedule construction and single-stage stepping; records compute calls."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.submod = None
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.calls: list[Action] = []

    def get_fwd_recv_ops(self, i: int) -> list[Any]:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, i: int, *args: Any, **kwargs: Any) -> None:
        self.calls.append(Action(self.stage_index, Kind.F, i))

    def backward_one_chunk(self, i: int, *args: Any, **kwargs: Any) -> None:
        self.calls.append(Action(self.stage_index, Kind.B, i))

    def perform_reduce_grad(self, *args: Any) -> None:
        return None


def to_torch_action(action: Action) -> Any:
    """Our Action as torch's _Action."""
    return ts._Action(action.stage, ts._ComputationType(action.kind.value), action.microbatch)


def _ours(action: Any) -> list[Action]:
    if action is None:
        return []
    if action.sub_actions is not None:
        return [a for sub in action.sub_actions for a in _ours(sub)]
    kind = Kind(action.computation_type.value)
    return [Action(action.stage_index, kind, action.microbatch_index)]


def _executed_single(name: ScheduleName, p: int, m: int) -> dict[int, list[Action]]:
    """Run the single-stage schedule's real _step_microbatches on fake stages and record its compute calls."""
    order = {}
    for rank in range(p):
        stage = FakeStage(rank, p, p, rank)
        sched = TORCH_CLASSES[name](stage, m)
        sched._initialize_stage = lambda *a, **k: None
        sched._step_microbatches()
        order[rank] = stage.calls
    return order


def _compute_only(actions: list[Any]) -> list[Action]:
    compute = {"F", "I", "W", "B", "OVERLAP_F_B"}
    return [a for t in actions if t is not None and t.computation_type.value in compute for a in _ours(t)]


def torch_order(name: ScheduleName, p: int, m: int, v: int) -> dict[int, list[Action]]:
    """The compute actions torch runs per rank (raises whatever torch raises for invalid sizes)."""
    if describe(name).single_stage:
        return _executed_single(name, p, m)
    num_stages = p * v
    style = "v" if describe(name).placement is StagePlacement.V else "loop"
    mapping = ts.generate_stage_to_rank_mapping(p, num_stages, style=style)
    stages = [FakeStage(s, num_stages, p, 0) for s in range(num_stages) if mapping[s] == 0]
    sched = TORCH_CLASSES[name](stages, m)
    return {r: _compute_only(sched.pipeline_order_with_comms[r]) for r in range(p)}

