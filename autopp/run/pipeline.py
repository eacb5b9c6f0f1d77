"""The torch side of a plan: the stages a rank holds, and the torch schedule that runs them (named or custom CSV)."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

from ..errors import RunError
from ..modelfile import ModelFile
from ..plan import Plan
from ..schedule import Action, ScheduleName, stage_to_rank, to_csv_rows
from ..split import live_values, split_model

__all__ = ["CUSTOM", "SCHEDULES", "SINGLE_STAGE", "placement", "check_neighbours", "build_stages", "make_schedule",
           "custom_schedule", "write_order_csv"]

logger = logging.getLogger(__name__)

#: The plan's schedule name for a custom per-rank action order (`plan.custom_order`).
CUSTOM = "Custom"

#: Named schedules and the torch classes that run them.
SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    ScheduleName.GPIPE.value: ScheduleGPipe,
    ScheduleName.ONE_F_ONE_B.value: Schedule1F1B,
    ScheduleName.INTERLEAVED_1F1B.value: ScheduleInterleaved1F1B,
    ScheduleName.LOOPED_BFS.value: ScheduleLoopedBFS,
    ScheduleName.INTERLEAVED_ZERO_BUBBLE.value: ScheduleInterleavedZeroBubble,
    ScheduleName.ZBV_ZERO_BUBBLE.value: ScheduleZBVZeroBubble,
    ScheduleName.DUAL_PIPE_V.value: ScheduleDualPipeV,
}
#: Schedules that take one stage per rank (torch's PipelineScheduleSingle); the others take a list of stages.
SINGLE_STAGE = frozenset({ScheduleName.GPIPE.value, ScheduleName.ONE_F_ONE_B.value})


def placement(plan: Plan) -> list[int]:
    """Pipeline rank of every stage: the plan's, checked against the named schedule's layout."""
    ranks = [s.rank for s in plan.stages]
    if [s.index for s in plan.stages] != list(range(len(ranks))):
        raise RunError(f"plan stages are numbered {[s.index for s in plan.stages]}, expected 0..{len(ranks) - 1}")
    if plan.schedule == CUSTOM:
        return ranks
    if plan.schedule not in SCHEDULES:
        raise RunError(f"schedule {plan.schedule!r} is not supported by the runner; use one of "
                       f"{sorted(SCHEDULES) + [CUSTOM]}")
    expected = stage_to_rank(ScheduleName(plan.schedule), plan.pp, plan.virtual_stages)
    if ranks != expected:
        raise RunError(f"{plan.schedule} with pp {plan.pp} and {plan.virtual_stages} stages per rank places stages "
                       f"on ranks {expected}, but the plan places them on {ranks}")
    return ranks


def check_neighbours(pipe: Any) -> None:
    """Refuse a split whose pieces exchange anything but neighbour tensors (stage s reads only from stage s - 1).

    torch's multi-stage schedules only support adjacent-stage communication; a value computed before the blocks
    and read by every block (a mask, a long residual) would need relaying through the stages in between.
    """
    for value in live_values(pipe):
        far = [d for d in value.dsts if d != value.src + 1]
        if value.src < 0:
            far = [d for d in value.dsts if d != 0]
        if far:
            source = "the model input" if value.src < 0 else f"stage {value.src}"
            raise RunError(f"stage {far[0]} reads {value.name!r} from {source}, which is not its neighbour: this "
                           "schedule exchanges only neighbour tensors; move the split points so the value stays "
                           "inside one stage, or use GPipe/1F1B with one stage per rank")


def build_stages(mf: ModelFile, plan: Plan, pp_rank: int, device: torch.device,
                 group: dist.ProcessGroup | None) -> list[Stage]:
    """The stages placed on pipeline rank `pp_rank`, in stage order, split from a model built with the plan's seed."""
    owner = placement(plan)
    model = mf.build(plan.seed)
    example, _ = mf.sample_batch(plan.microbatch_size, seed=plan.seed)
    pipe = split_model(model, example, plan.split_points)
    if pipe.num_stages != len(plan.stages):
        raise RunError(f"splitting at {plan.split_points} gave {pipe.num_stages} pieces, plan has {len(plan.stages)}")
    if plan.schedule not in SINGLE_STAGE:
        check_neighbours(pipe)
    mine = [i for i, r in enumerate(owner) if r == pp_rank]
    for i in mine:
        pipe.get_stage_module(i).to(device)
    if plan.schedule in SINGLE_STAGE:
        return [pipe.build_stage(i, device, group) for i in mine]
    # Multi-stage schedules get torch's runtime-inferred PipelineStage: the graph-built stage's p2p warm-up sends
    # to itself when two neighbouring stages share a rank (V layouts), which gloo refuses ("Pair is not connected").
    # The pieces form a chain (checked above), so piece s's outputs are exactly piece s + 1's inputs.
    return [PipelineStage(pipe.get_stage_module(i), i, len(owner), device, group=group) for i in mine]


def make_schedule(plan: Plan, stages: Sequence[Stage], loss_fn: Any, csv_path: Path) -> _PipelineSchedule:
    """The torch schedule for the plan, with the default scale_grads=True (gradients of the mean loss)."""
    if plan.schedule == CUSTOM:
        order = getattr(plan, "custom_order", ())
        if not order:
            raise RunError("plan schedule is Custom but it has no custom_order")
        return custom_schedule(stages, [list(row) for row in order], plan.num_microbatches, loss_fn, csv_path)
    cls = SCHEDULES.get(plan.schedule)
    if cls is None:
        raise RunError(f"schedule {plan.schedule!r} is not supported by the runner; use one of "
                       f"{sorted(SCHEDULES) + [CUSTOM]}")
    if plan.schedule in SINGLE_STAGE:
        if len(stages) != 1:
            raise RunError(f"{plan.schedule} runs one stage per rank, this rank holds {len(stages)}")
        return cls(stages[0], plan.num_microbatches, loss_fn=loss_fn)  # type: ignore[call-arg]
    return cls(list(stages), plan.num_microbatches, loss_fn=loss_fn)  # type: ignore[call-arg]


def write_order_csv(order: Sequence[Sequence[str | Action | None]], path: Path) -> Path:
    """Torch's compute_only CSV: row r = pipeline rank r, cells like 0F0 / 1I2 / 1W2 (blank = idle)."""
    rows = to_csv_rows({r: [a if a is None or isinstance(a, Action) else _parse(a) for a in row]
                        for r, row in enumerate(order)})
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def _parse(text: str) -> Action | None:
    from ..schedule import parse_action

    return None if not text.strip() else parse_action(text)


def custom_schedule(stages: Sequence[Stage], order: Sequence[Sequence[str | Action | None]], n_microbatches: int,
                    loss_fn: Any, csv_path: Path) -> _PipelineSchedule:
    """Run a per-rank compute order through torch's private `_PipelineScheduleRuntime` (the one place that uses it).

    The order is written as a compute_only CSV; torch validates it, infers stage -> rank from it, and inserts the
    sends, receives and gradient reductions itself.
    """
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    write_order_csv(order, csv_path)
    schedule = _PipelineScheduleRuntime(list(stages), n_microbatches, loss_fn=loss_fn)
    try:
        schedule._load_csv(str(csv_path), format="compute_only")
    except Exception as exc:  # torch raises ValueError / AssertionError / RuntimeError for a bad order
        raise RunError(f"torch refused the custom order in {csv_path}: {type(exc).__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return schedule
