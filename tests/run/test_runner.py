"""Integration tests of run_plan: real two-process gloo runs, a stale plan, and ranks that raise or die."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from autopp.data.layout import Layout
from autopp.errors import PlanError, RunError
from autopp.run import (GRAD_RTOL, Nodes, RunFailedError, RunOptions, RunReport, format_report, measured_timeline,
                        run_plan)
from autopp.run.runner import _timing, _validation
from autopp.run.validate import Reference

from .conftest import GPT, LINRELU, children_of, pipeline_plan, processes_mentioning, rank_servers, two_stage_plan


@pytest.mark.parametrize("schedule, num_microbatches, microbatch_size", [("1F1B", 2, 2)])
@pytest.mark.integration
def test_gpt_two_ranks_match_reference(tmp_path: Path, schedule: str, num_microbatches: int,
                                       microbatch_size: int) -> None:
    plan = two_stage_plan(GPT, "h.2", schedule, num_microbatches, microbatch_size, predicted_s=0.05)
    messages: list[str] = []
    report = run_plan(plan, RunOptions(steps=2, timeout_s=120), progress=messages.append, plan_path="plan.json")
    assert report.passed and report.complete and report.error is None
    assert report.schedule == schedule and report.backend in ("gloo", "nccl")
    assert len(report.losses) == len(report.reference_losses) == 2
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)
    assert report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL
    names = [d.name for d in report.grad_diffs]
    assert "tok_emb.weight" in names and "head.weight" in names and len(names) == len(set(names))
    assert {d.stage for d in report.grad_diffs} == {0, 1}
    assert len(report.step_times_s) == 2 and report.measured_step_time_s == report.step_times_s[1]
    assert report.step_time_ratio == pytest.approx(report.measured_step_time_s / 0.05)
    assert any("step 2/2" in m for m in messages)
    saved = json.loads(report.save(tmp_path / "report.json").read_text())
    assert saved["passed"] is True and saved["plan_path"] == "plan.json" and len(saved["grad_diffs"]) == len(names)
    assert "PASSED" in format_report(report)


@pytest.mark.parametrize("schedule, kinds", [("Interleaved1F1B", {"F", "B"}), ("ZBVZeroBubble", {"F", "I", "W"})])
@pytest.mark.integration
def test_two_stages_per_rank_match_reference_and_are_timed(schedule: str, kinds: set[str]) -> None:
    plan = pipeline_plan(LINRELU, ["1", "2", "4"], schedule, Layout(pp=2, v=2), num_microbatches=4)
    report = run_plan(plan, RunOptions(steps=2, timeout_s=90))
    assert report.passed and report.complete and report.layout == plan.layout
    assert report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL
    assert [m.stages for m in report.ranks] == [(0, 2), (1, 3)] if schedule == "Interleaved1F1B" else [(0, 3), (1, 2)]
    assert [st.stage for st in report.stage_times] == [0, 1, 2, 3]
    assert all(st.forward_s and st.backward_s and st.forward_error is not None for st in report.stage_times)
    timeline = measured_timeline(report)
    assert {e.action.kind.value for e in timeline.events} == kinds
    assert len(timeline.events) == 4 * 4 * len(kinds) and report.timeline_step == 1
    assert all(0 <= e.start_s <= e.end_s <= timeline.step_time_s + 1e-3 for e in timeline.events)
    assert report.memory_method == "live" and all(m.peak_memory_bytes > 0 for m in report.ranks)
    assert report.ranks[0].memory_error == pytest.approx(report.ranks[0].peak_memory_bytes / 1000 - 1)


def test_stale_fingerprint_is_refused() -> None:
    plan = replace(two_stage_plan(GPT, "h.2"), fingerprint="0123456789abcdef")
    stale = r"made for model fingerprint 0123456789abcdef but .*gpt.py now has \w+: re-plan"
    with pytest.raises(PlanError, match=stale):
        run_plan(plan)


def test_a_plan_whose_fields_disagree_about_the_split_is_refused() -> None:
    """A tester moved stage 1's split_point by hand: the run cut there (and passed) while the export wrote the split
    of `units`. Every stage's units, names and split point must be the model's."""
    plan = two_stage_plan(GPT, "h.2")
    moved = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], split_point="h.1")))
    with pytest.raises(PlanError, match=r"^stage 1: units 3-7, names \['h.2', .*\] and split_point 'h.1' are not "
                                        r"the model's \(8 units; 3-7: \['h.2', .*\] from 'h.2'\): the plan was "
                                        r"edited by hand; re-plan"):
        run_plan(moved)
    short = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], units=(3, 7),
                                                          unit_names=plan.stages[1].unit_names[:-1])))
    with pytest.raises(PlanError, match=r"^the stages end at unit 6, and the model has 8 units \(0 to 7\)"):
        run_plan(short)


@pytest.mark.parametrize("mode, expected", [("raise", r"rank 1 failed: ValueError: injected failure in loss_fn"),
                                            ("die", r"rank 1 died from signal SIGKILL")])
@pytest.mark.integration
def test_failing_rank_raises_quickly_and_leaves_no_process(
        faulty_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, expected: str) -> None:
    # Rank 1 fails inside the schedule's step; rank 0 is then blocked waiting for gradients and must be killed.
    monkeypatch.setenv("AUTOPP_TEST_FAIL_RANK", "1")
    monkeypatch.setenv("AUTOPP_TEST_FAIL_MODE", mode)
    plan = two_stage_plan(faulty_model, "2")
    work = tmp_path / "run"
    before = children_of(os.getpid())
    with pytest.raises(RunFailedError, match=expected) as info:
        run_plan(plan, RunOptions(steps=2, timeout_s=60, work_dir=work))
    # Stopped by the failure, not by the 60 s limit: checked by the message, not by a wall clock (the machine may be
    # loaded); the timeout's message is "ranks [...] had not finished after 60 s (timeout)".
    assert "had not finished" not in str(info.value)
    assert isinstance(info.value, RunError) and info.value.report.complete is False
    assert info.value.report.error == str(info.value)
    assert processes_mentioning(str(work)) == []
    servers = rank_servers(os.getpid())  # the rank server the ranks were forked from, kept for later runs
    assert servers and all(children_of(s) == set() for s in servers)  # ... holds no rank, dead or alive
    assert children_of(os.getpid()) - servers <= before


@pytest.mark.parametrize("where", ["launch", "results"])
def test_a_kept_run_directory_is_always_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    # Review of issue 13.4: the temporary directory was kept on any RunError but named only when a rank failed; a
    # RunError from the launch or from reading the results left /tmp/autopp-run-* behind silently.
    import tempfile

    from autopp.run import runner

    def launch(*_args: object) -> list[object]:
        if where == "launch":
            raise RunError("torchrun could not start")
        return []  # no ranks: they "finish" at once and leave no results.json

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(runner, "_launch", launch)
    with pytest.raises(RunFailedError, match="could not start" if where == "launch" else "no readable results") \
            as info:
        run_plan(two_stage_plan(LINRELU, "2"), RunOptions(steps=1))
    assert info.value.logs is not None and info.value.logs.is_dir() and list(tmp_path.iterdir()) == [info.value.logs]
    assert info.value.report.error == str(info.value)


class _Reference:
    """A ReferenceModel's face with fixed figures: per step, the loss of `losses` and the gradients `grads`."""

    dtype, aliases, names = "float32", {"a": "a", "b": "b"}, ["a", "b"]
    optimizer = None  # no update check (autopp.run.steps)

    def __init__(self, losses: tuple[float, ...], grads: dict[str, torch.Tensor]) -> None:
        self.losses, self.grads = losses, grads

    def step(self, step: int, params: object = None) -> Reference:
        return Reference((self.losses[step],), self.grads, first_step=step + 1)


def _fabricated(scale: float) -> tuple[list[dict[str, object]], Any, _Reference]:
    """Two stages' results whose stage-1 gradient is the reference's times `scale` at every step."""
    ref = _Reference((2.0, 1.5), {"a": torch.ones(3), "b": torch.full((2,), 4.0)})
    results: list[dict[str, object]] = [
        {"stage": 0, "params": ["a"], "step_times_s": [0.3, 0.1], "losses": []},
        {"stage": 1, "params": ["b"], "step_times_s": [0.2, 0.2], "losses": [[1.9, 2.1], [1.5, 1.5]]},
    ]
    grads = {0: {"a": torch.ones(3)}, 1: {"b": torch.full((2,), 4.0 * scale)}}
    return results, lambda step: ({}, grads), ref


def _blank() -> RunReport:
    return RunReport(plan_path=None, model_path="m.py", fingerprint="f", schedule="1F1B", layout=Layout(pp=2),
                     num_microbatches=2, microbatch_size=1, steps=2, lr=0.01, backend="gloo",
                     grad_rtol=GRAD_RTOL, loss_rtol=1e-5, predicted_step_time_s=0.1)


def test_validation_passes_within_tolerance_and_times_the_slowest_rank() -> None:
    results, grads, ref = _fabricated(1.0 + 1e-6)
    report = _validation(_timing(_blank(), results), results, grads, ref)  # type: ignore[arg-type]
    assert report.passed and report.error is None and report.losses == (2.0, 1.5)
    assert report.step_times_s == (0.3, 0.2) and report.measured_step_time_s == 0.2
    assert report.step_time_ratio == pytest.approx(2.0) and report.relative_error == pytest.approx(1.0)
    assert report.worst_param == "b" and report.grad_max_rel_diff == pytest.approx(1e-6, rel=0.1)


def test_validation_names_the_parameter_above_tolerance() -> None:
    results, grads, ref = _fabricated(1.01)
    report = _validation(_blank(), results, grads, ref)  # type: ignore[arg-type]
    assert not report.passed
    assert report.error == ("step 1 of 2: gradient of b (stage 1) differs from the single-process reference by "
                            "1.00e-02 relative (max abs 4.00e-02), above the tolerance 1e-04 (also step 2)")
    assert report.failed_steps == (1, 2)


@pytest.mark.integration
def test_custom_synthesized_order_runs_through_torch_runtime() -> None:
    """A "Custom" plan (as `autopp plan --synthesize` writes): CP-SAT's F/I/W order for uneven stages, executed by
    torch's schedule runtime from the CSV, validated against the single-process run."""
    from autopp.schedule import StageCost
    from autopp.solve.cpsat.synthesis import synthesize

    costs = [StageCost(forward_s=f, backward_input_s=f, backward_weight_s=f, static_bytes=0, activation_bytes=1,
                       input_bytes=1) for f in (1.0, 1.0, 2.0)]
    owner = [0, 1, 1]
    result = synthesize(costs, owner, 4, [0.1, 0.0], [10**9, 10**9], time_limit_s=2.0)
    order = tuple(tuple(result.order[r]) for r in (0, 1))
    plan = pipeline_plan(LINRELU, ["2", "4"], "Custom", num_microbatches=4, ranks=owner, custom_order=order)
    report = run_plan(plan, RunOptions(steps=1, timeout_s=90))
    assert report.passed and report.complete and report.schedule == "Custom"
    assert {e.action.kind.value for e in measured_timeline(report).events} == {"F", "I", "W"}


def test_host_share_counts_this_hosts_gloo_ranks_against_the_injected_cores() -> None:
    """Issue 29, item 3: the report records the ranks on this host and its cores (injected here, not this
    machine's); with torchrun, this node's share; with NCCL, nothing (a GPU per rank)."""
    from autopp.run.runner import host_share
    plan = replace(two_stage_plan(LINRELU, "2"), layout=Layout(pp=2, dp=2))
    assert host_share(plan, RunOptions(backend="gloo"), cores=2) == (4, 2)
    assert host_share(plan, RunOptions(backend="gloo", nodes=Nodes(nnodes=2)), cores=2) == (2, 2)
    assert host_share(plan, RunOptions(backend="nccl"), cores=2) == (None, None)


def test_run_plan_warns_and_records_ranks_that_outnumber_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The warning is logged before any rank starts (ranks stubbed out here: no process is started)."""
    import autopp.run.runner as runner

    def no_ranks(*args: object) -> None:
        raise RunError("ranks stubbed out")
    monkeypatch.setattr(runner, "usable_cores", lambda: 1)
    monkeypatch.setattr(runner, "_ranks", no_ranks)
    with caplog.at_level("WARNING", logger="autopp.run.runner"), pytest.raises(RunFailedError) as failed:
        run_plan(two_stage_plan(LINRELU, "2"), RunOptions(backend="gloo", work_dir=tmp_path))
    assert failed.value.report.ranks_per_host == 2 and failed.value.report.host_cores == 1
    assert [r.getMessage() for r in caplog.records] == [
        "2 ranks share 1 core, 2.0 per core: compute is serialised, which the prediction (a core per rank) does "
        "not model; measured step times will exceed the prediction (docs/accuracy.md)"]
