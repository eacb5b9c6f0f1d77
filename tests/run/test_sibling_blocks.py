"""A model whose blocks unit discovery finds in a ModuleDict (called out of insertion order), planned by hand at a
discovered unit and run on two gloo ranks: loss and every gradient match the single-process reference."""

from __future__ import annotations

import pytest

from autopp.run import GRAD_RTOL, RunOptions, run_plan

from .conftest import ROOT, two_stage_plan

pytestmark = pytest.mark.integration

DICTBLOCKS = ROOT / "tests" / "models" / "dictblocks.py"


def test_moduledict_blocks_run_validated_on_two_ranks() -> None:
    plan = two_stage_plan(DICTBLOCKS, "blocks.b3")
    assert plan.stages[0].unit_names == ("stem", "blocks.b2", "blocks.b0")
    report = run_plan(plan, RunOptions(steps=2, timeout_s=120))
    assert report.passed and report.complete and report.error is None
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)
    assert report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL
    assert {d.stage for d in report.grad_diffs} == {0, 1} and len(report.grad_diffs) == 22
