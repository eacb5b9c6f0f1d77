"""A plan simulated as written reproduces the planner's predictions, for named and synthesized schedules."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from autopp.data.cluster import Cluster
from autopp.errors import PlanError
from autopp.data.plan import Plan, load_plan
from autopp.predict import plan_order, simulate_plan
from autopp.data.profile import Profile, load_profile
from autopp.schedule import ScheduleName
from autopp.solve import PlanRequest, make_plan

from .conftest import ONE_PIPELINE, ROOT


@pytest.fixture(scope="module")
def shipped() -> Profile:
    return load_profile(ROOT / "profiles" / "gpt")


@pytest.mark.parametrize("schedule", [ScheduleName.ONE_F_ONE_B, ScheduleName.GPIPE, ScheduleName.ZBV_ZERO_BUBBLE,
                                      ScheduleName.INTERLEAVED_1F1B])
def test_simulating_the_saved_plan_gives_its_prediction(shipped: Profile, schedule: ScheduleName,
                                                        tmp_path: Path) -> None:
    request = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**30), global_batch=8, schedule=schedule)
    plan = load_plan(make_plan(shipped, request).save(tmp_path / "p.json"))
    result = simulate_plan(plan)
    # The prediction adds the all-reduce and the optimizer step after the pipeline.
    pred = plan.predicted
    assert result.step_time_s + pred.allreduce_s + pred.optimizer_s == pytest.approx(pred.step_time_s, rel=1e-9)
    assert pred.optimizer_s > 0
    assert tuple(result.peak_memory_bytes) == plan.predicted.peak_memory_bytes


def test_a_plan_with_the_runtime_costs_simulates_to_its_prediction_and_writes_resume_s(shipped: Profile,
                                                                                      tmp_path: Path) -> None:
    # issue 29: the profile's per-action runtime time and resume cost (autopp.measure.runtime) reach the plan
    costly = replace(shipped, meta=replace(shipped.meta, runtime_forward_s=1e-4, runtime_backward_s=1e-4,
                                           resume_s=2e-3))
    request = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**30), global_batch=8,
                          schedule=ScheduleName.ONE_F_ONE_B, num_microbatches=4)
    path = make_plan(costly, request).save(tmp_path / "p.json")
    plan, plain = load_plan(path), make_plan(shipped, request)
    assert all(s.resume_s == 2e-3 for s in plan.stages) and '"resume_s": 0.002' in path.read_text()
    pred = plan.predicted
    assert simulate_plan(plan).step_time_s + pred.allreduce_s + pred.optimizer_s == pytest.approx(pred.step_time_s,
                                                                                                   rel=1e-9)
    assert pred.step_time_s > plain.predicted.step_time_s  # every candidate's actions only grew
    assert all("resume_s" not in s for s in plain.to_json()["stages"])  # 0: not written (golden plans unchanged)


def test_synthesized_plan_is_custom_and_faster(shipped: Profile) -> None:
    base = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**30), global_batch=8, num_microbatches=4)
    named = make_plan(shipped, base)
    synth = make_plan(shipped, PlanRequest(**{**base.__dict__, "synthesize": True, "synth_time_limit_s": 5.0}))
    if synth.schedule is not ScheduleName.CUSTOM:  # the named schedule was already optimal for these costs
        assert synth.predicted.step_time_s == named.predicted.step_time_s
        return
    assert synth.predicted.step_time_s < named.predicted.step_time_s
    assert len(synth.custom_order) == synth.layout.pp and any("CP-SAT" in n for n in synth.notes)
    pred = synth.predicted
    assert simulate_plan(synth).step_time_s == pytest.approx(pred.step_time_s - pred.allreduce_s - pred.optimizer_s)
    assert Plan.from_json(synth.to_json()) == synth


def test_unknown_schedule_is_refused(shipped: Profile) -> None:
    """A schedule name is parsed at the JSON edge only: an unknown one never makes a Plan."""
    plan = make_plan(shipped, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**30), global_batch=4))
    with pytest.raises(PlanError, match="field 'schedule' is 'Fancy'; expected one of"):
        Plan.from_json({**plan.to_json(), "schedule": "Fancy"})
    with pytest.raises(TypeError, match="Plan.schedule must be a ScheduleName"):
        Plan(**{**plan.__dict__, "schedule": "1F1B"})
    with pytest.raises(PlanError, match="Custom schedule has orders for 0 ranks but pp is 2"):
        plan_order(Plan(**{**plan.__dict__, "schedule": ScheduleName.CUSTOM}))


def test_plan_show_and_json_print_the_same_step_time(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13, point 9: `autopp plan` printed 455 ms where `autopp show` printed 448 ms (the simulated pipeline
    without the optimizer step). Every view shows the plan's stored prediction."""
    import json

    from autopp.cli import main
    from autopp.schedule import draw
    from autopp.sizes import format_time
    titles: list[str] = []
    real = draw.timeline_figure

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        fig = real(*args, **kwargs)
        titles.append(fig.axes[0].get_title().replace("\u00a0", " "))  # no-break spaces: a wrap keeps figures whole
        return fig

    monkeypatch.setattr(draw, "timeline_figure", spy)
    path = tmp_path / "p.json"
    assert main(["plan", "--profile", str(ROOT / "profiles" / "gpt"), "--devices", "2", "--memory", "1GiB",
                 "--global-batch", "8", *ONE_PIPELINE, "-o", str(path)]) == 0
    planned = capsys.readouterr().out
    assert main(["show", str(path), "-o", str(tmp_path / "p.png")]) == 0
    shown = capsys.readouterr().out
    predicted = json.loads(path.read_text())["predicted"]
    step, bubble = format_time(predicted["step_time_s"]), f"{predicted['bubble_fraction']:.1%}"
    (autopp_row,) = [line for line in planned.splitlines() if line.startswith("autopp ")]
    assert step in autopp_row and bubble in autopp_row
    (title,) = titles
    for text in (shown, title):
        assert f"step {step} (pipeline " in text and f"bubble {bubble}" in text
    assert predicted["optimizer_s"] > 0  # the figures differ from the simulated pipeline alone, which is named
    pipeline = format_time(simulate_plan(load_plan(path)).step_time_s)
    assert pipeline != step and f"(pipeline {pipeline} + optimizer " in shown
