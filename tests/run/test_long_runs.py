"""Integration tests of issue 26, points 10 and 11 on two gloo ranks: a long correct run passes, a real error still
fails with its fix switched off, and a measuring run (`--no-validate`) trains with the plan's optimizer and never
passes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autopp.cli import main
from autopp.run import RunOptions, run_plan

from .conftest import ROOT, pipeline_plan

pytestmark = pytest.mark.integration

MODELS = ROOT / "tests" / "models"

#: Loaded by every Python process on PYTHONPATH before anything else: the cross-rank sum of tied copies switched
#: off, as if the runner had never had it (autopp.run.tied), without any switch in the runner itself.
UNTIED = '''
import autopp.run.tied as _tied
_tied.sum_tied_grads = lambda groups, params: None
'''


# Issue 26, point 11: "a GroupNorm CNN with --steps 30 fails at step 7 ('losses differ ... by 1.44e-04 relative ...
# above the tolerance 1e-05') while its gradients agree to 3.7e-6". At lr 2 this CNN's free-running reference drifted
# to 3.55e-2 relative (measured before the change) while every step agrees from shared parameters.
def test_a_long_correct_run_of_a_groupnorm_cnn_passes() -> None:
    plan = pipeline_plan(MODELS / "gncnn.py", ["blocks.2"], num_microbatches=4, microbatch_size=2)
    report = run_plan(plan, RunOptions(steps=30, lr=2.0, timeout_s=600))
    assert report.passed and report.failed_steps == () and len(report.reference_losses) == 30
    assert report.loss_max_rel_diff is not None and report.loss_max_rel_diff < report.loss_rtol
    assert {d.step for d in report.grad_diffs} <= set(range(1, 31))


def test_unsummed_tied_copies_still_fail_on_the_first_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autopp.run import launch, runner
    (tmp_path / "sitecustomize.py").write_text(UNTIED)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT}")
    # Each rank a new interpreter, which loads the sitecustomize above (a rank forked from the rank server has the
    # server's modules, imported before this test).
    monkeypatch.setattr(runner, "launch_ranks", lambda args, n, run_dir, fork: launch.launch_ranks(args, n, run_dir))
    plan = pipeline_plan(MODELS / "tiedlm.py", ["blocks.2"], num_microbatches=2, microbatch_size=2)
    report = run_plan(plan, RunOptions(steps=3, timeout_s=300, check=False))
    assert not report.passed and report.failed_steps == (1, 2, 3)
    assert report.error is not None and report.error.startswith(
        "step 1 of 3: gradient of embed.weight (stage 0) differs from the single-process reference by 1.00e+00")
    assert report.error.endswith("(also steps 2, 3)")


def test_the_same_tied_model_passes_with_its_copies_summed() -> None:
    plan = pipeline_plan(MODELS / "tiedlm.py", ["blocks.2"], num_microbatches=2, microbatch_size=2)
    report = run_plan(plan, RunOptions(steps=3, timeout_s=300))
    assert report.passed and [d.stage for d in report.grad_diffs if d.name == "embed.weight"] == [0, 1]


# Issue 26, point 10: no way to skip the reference; SGD whatever the profile's optimizer.
def test_a_measuring_run_trains_with_the_plans_optimizer_and_is_not_validated(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = pipeline_plan(MODELS / "bncnn.py", ["blocks.2"], num_microbatches=4, microbatch_size=2)
    path = replace(plan, optimizer="adam").save(tmp_path / "p.json")
    assert main(["run", str(path), "--steps", "2", "--no-validate", "--run-dir", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    assert "adam lr 0.01" in out and "NOT VALIDATED" in out and "PASSED" not in out
    assert err.splitlines()[-1] == "autopp: not validated: measured only (--no-validate)"
    report = json.loads((tmp_path / "p.report.json").read_text())
    assert report["validated"] is False and report["passed"] is False and report["optimizer"] == "adam"
    assert len(report["losses"]) == 2 and report["reference_losses"] == [] and report["grad_diffs"] == []
    assert not list((tmp_path / "run").glob("check*.pt"))  # nothing gathered for a reference
    # Adam's two states: parameters + gradients + 2 x parameters of float32, at least, on every rank
    from autopp.model.contract import load_model_file
    model = load_model_file(MODELS / "bncnn.py").build(0)
    names = {int(k): v for r in json.loads((tmp_path / "run" / "results.json").read_text())
             for k, v in r["params"].items()}
    sizes = dict((n, p.numel() * 4) for n, p in model.named_parameters())
    for rank in report["ranks"]:
        held = sum(sizes[n] for s in rank["stages"] for n in names[s])
        assert rank["peak_memory_bytes"] >= 4 * held
