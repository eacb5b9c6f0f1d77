"""The torch side of a plan: stage placement, neighbour-only stages for every schedule, and custom orders through
torch's CSV runtime (run in this process on a one-rank gloo group, so no worker start-up is paid)."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from autopp.errors import RunError
from autopp.data.layout import Layout
from autopp.model.contract import load_model_file
from autopp.model.split import split_model
from autopp.run.pipeline import (custom_schedule, last_stage_kwargs, placement, torch_schedule_class,
                                  write_order_csv)
from autopp.schedule import ScheduleName, build_schedule, describe, parse_action

from .conftest import LINRELU, ROOT, pipeline_plan

MASKED = ROOT / "tests" / "models" / "masked.py"


def test_every_simulated_schedule_has_a_torch_class() -> None:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from autopp.schedule import describe
    # Chimera: torch ships no class; autopp's runtime runs it (tests/run/test_bidirectional.py)
    classes = [torch_schedule_class(name) for name in ScheduleName
               if describe(name).runnable and not describe(name).mirrored and not describe(name).sequence_chunks]
    assert all(issubclass(c, _PipelineSchedule) for c in classes) and len(set(classes)) == len(classes)
    assert torch_schedule_class(ScheduleName.ONE_F_ONE_B).__name__ == "Schedule1F1B"


def test_sequence_chunks_run_on_the_csv_runtime() -> None:
    """Seq1F1B's units run in its order through torch's CSV schedule runtime (autopp.run.seq_chunks)."""
    assert torch_schedule_class(ScheduleName.SEQ_1F1B) is torch_schedule_class(ScheduleName.CUSTOM)


def test_placement_follows_the_schedule_layout() -> None:
    assert placement(pipeline_plan(LINRELU, ["1", "2", "4"], "ZBVZeroBubble", Layout(pp=2, v=2))) == [0, 1, 1, 0]
    assert placement(pipeline_plan(LINRELU, ["1", "2", "4"], "Interleaved1F1B", Layout(pp=2, v=2))) == [0, 1, 0, 1]
    looped = pipeline_plan(LINRELU, ["1", "2", "4"], "Interleaved1F1B", Layout(pp=2, v=2), ranks=[0, 1, 1, 0])
    with pytest.raises(RunError, match=r"Interleaved1F1B with pp 2 and 2 stages per rank places stages on ranks "
                                       r"\[0, 1, 0, 1\], but the plan places them on \[0, 1, 1, 0\]"):
        placement(looped)


def test_custom_placement_is_the_plans() -> None:
    plan = pipeline_plan(LINRELU, ["1", "2", "4"], "Interleaved1F1B", Layout(pp=2, v=2), ranks=[0, 1, 1, 0])
    assert placement(replace(plan, schedule=ScheduleName.CUSTOM)) == [0, 1, 1, 0]


def test_order_csv_is_torchs_compute_only_layout(tmp_path: Path) -> None:
    order = build_schedule(ScheduleName.INTERLEAVED_ZERO_BUBBLE, 2, 2, 2)
    path = write_order_csv([order[r] for r in range(2)], tmp_path / "o.csv")
    rows = list(csv.reader(path.open()))
    assert rows == [[str(a) for a in order[r]] for r in range(2)]
    assert rows[1][:3] == ["1F0", "1F1", "3F0"]


@pytest.mark.parametrize("name", [ScheduleName.LOOPED_BFS, ScheduleName.INTERLEAVED_ZERO_BUBBLE])
def test_custom_order_runs_through_torchs_runtime_and_matches_one_process(
        one_rank_group: None, tmp_path: Path, name: ScheduleName) -> None:
    mf = load_model_file(LINRELU)
    torch.manual_seed(0)
    inputs, target = mf.sample_batch(4, seed=1)
    pipe = split_model(mf.build(0), inputs, ["2"])
    stages = [PipelineStage(pipe.get_stage_module(i), i, 2, torch.device("cpu")) for i in range(2)]
    order = build_schedule(name, 1, 2, 2)  # one rank holding both stages, 2 microbatches
    schedule = custom_schedule(stages, [order[0]], 2, mf.loss_fn, tmp_path / "order.csv")
    losses: list[torch.Tensor] = []
    schedule.step(*inputs, target=target, losses=losses)
    reference = mf.build(0)
    mf.loss_fn(reference(*inputs), target).backward()
    expected = dict(reference.named_parameters())
    for stage in stages:
        for pname, p in stage.submod.named_parameters():
            torch.testing.assert_close(p.grad, expected[pname].grad, rtol=1e-5, atol=1e-7)
    assert len(losses) == 2


def test_the_last_stage_keeps_no_outputs(one_rank_group: None, tmp_path: Path) -> None:
    """Issue 29 item 1: by default torch's step keeps every microbatch's output on the last stage and concatenates
    them at the end (gpt's logits: 8 MiB per microbatch of 4), unprofiled and unplanned work the runner never reads;
    the runner's keywords turn it off and still collect the losses."""
    mf = load_model_file(LINRELU)
    inputs, target = mf.sample_batch(4, seed=1)
    pipe = split_model(mf.build(0), inputs, ["2"])
    order = build_schedule(ScheduleName.LOOPED_BFS, 1, 2, 2)
    for keep in (True, False):
        stages = [PipelineStage(pipe.get_stage_module(i), i, 2, torch.device("cpu")) for i in range(2)]
        schedule = custom_schedule(stages, [order[0]], 2, mf.loss_fn, tmp_path / "order.csv")
        losses: list[torch.Tensor] = []
        kwargs = {"target": target, "losses": losses} if keep else last_stage_kwargs(target, losses)
        merged = schedule.step(*inputs, **kwargs)
        assert (merged is not None, len(stages[1].output_chunks)) == ((True, 2) if keep else (False, 0))
        assert len(losses) == 2


def test_a_bad_custom_order_is_a_run_error(one_rank_group: None, tmp_path: Path) -> None:
    mf = load_model_file(LINRELU)
    inputs, _ = mf.sample_batch(4, seed=1)
    pipe = split_model(mf.build(0), inputs, ["2"])
    stages = [PipelineStage(pipe.get_stage_module(i), i, 2, torch.device("cpu")) for i in range(2)]
    with pytest.raises(RunError, match=r"torch refused the custom order in .*order.csv"):
        custom_schedule(stages, [[parse_action(t) for t in ("0F0", "1F0", "1B0", "0B0", "0F1")]], 2, mf.loss_fn,
                        tmp_path / "order.csv")


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.integration
def test_single_stage_schedules_get_neighbour_only_stages(one_rank_group: None, schedule: str) -> None:
    # Regression (issue 13): GPipe and 1F1B used torch's graph-built stage, which sends a value that skips stages
    # straight to each reader; on 4 ranks torch refused it: "PipeliningMetadataError: Backward of skip connections
    # not supported yet (at stage.py:1580)". Every schedule now gets the neighbour-only chain: stage s receives
    # exactly what stage s - 1 passes on, the residual is relayed and the mask held by its readers.
    from autopp.run.chain import ChainPiece
    from autopp.run.pipeline import build_stages

    plan = pipeline_plan(MASKED, ["blocks.1", "blocks.2", "head"], schedule, Layout(pp=4), num_microbatches=4)
    mf = load_model_file(MASKED)
    built = [build_stages(mf, plan, r, torch.device("cpu"), None) for r in range(4)]
    pieces = [b.stages[0].submod for b in built]
    assert all(isinstance(p, ChainPiece) for p in pieces) and [p.index for p in pieces] == [0, 1, 2, 3]
    for before, after in zip(pieces, pieces[1:]):
        assert after.io.inputs == before.io.outputs
    assert set(built[1].relayed) == {1} and pieces[1].io.constants
