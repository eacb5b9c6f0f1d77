"""from_verdict.py: baselines judged with their own activation policies, and those that do not fit marked in the
plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.costmodel import ProfileTable
from autopp.data.cluster import Cluster
from autopp.data.plan import load_plan
from autopp.data.profile import load_profile
from autopp.display import format_plan
from autopp.data.layout import Layout
from autopp.schedule import Activation, ScheduleName
from autopp.solve import PlanRequest, RecomputeMode, make_plan
from autopp.solve.assemble.from_verdict import judge_recompute
from autopp.solve.search.judge import Candidate

GPT = Path(__file__).resolve().parents[2] / "profiles" / "gpt"
MiB = 1 << 20
KEEP, RECOMPUTE = Activation.KEEP, Activation.RECOMPUTE


def _gpipe_even() -> Candidate:
    return Candidate(schedule=ScheduleName.GPIPE, layout=Layout(pp=2), microbatches=8, microbatch_size=1,
                     bounds=((0, 4), (4, 8)), activations=(KEEP, KEEP))


def test_each_mode_judges_its_own_activation_policies() -> None:
    # profiles/gpt, GPipe m8 on 0-3 | 4-7: rank 0 peaks at 25 MiB, rank 1 at 41 MiB without recomputation, 16 MiB
    # with it; on 30 MiB devices only rank 1 must recompute.
    a = ProfileTable(load_profile(GPT)).arrays(1)
    cluster = Cluster(num_devices=2, memory_bytes=30 * MiB)
    none = judge_recompute(a, cluster, _gpipe_even(), (KEEP,))
    every = judge_recompute(a, cluster, _gpipe_even(), (RECOMPUTE,))
    auto = judge_recompute(a, cluster, _gpipe_even(), (KEEP, RECOMPUTE))
    assert none.candidate.activations == (KEEP, KEEP) and not none.fits
    assert every.candidate.activations == (RECOMPUTE, RECOMPUTE) and every.fits
    assert auto.candidate.activations == (KEEP, RECOMPUTE) and auto.fits and auto.step_s < every.step_s


def test_no_fitting_choice_is_judged_without_recomputation_and_marked() -> None:
    a = ProfileTable(load_profile(GPT)).arrays(1)
    cluster = Cluster(num_devices=2, memory_bytes=8 * MiB)  # nothing fits
    auto = judge_recompute(a, cluster, _gpipe_even(), (KEEP, RECOMPUTE))
    assert auto.candidate.activations == (KEEP, KEEP) and not auto.fits


def test_a_baseline_that_does_not_fit_is_marked_in_json_and_table(tmp_path: Path) -> None:
    # 1F1B m8 on 20 MiB devices: the time-balanced split 0-5 | 6-7 needs about 21 MiB on rank 0
    request = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=20 * MiB), global_batch=8, num_microbatches=8)
    plan = make_plan(load_profile(GPT), request)
    assert plan.predicted.fits and plan.baselines["even"].fits
    time = plan.baselines["time"]
    assert not time.fits and max(time.peak_memory_bytes) > 20 * MiB
    again = load_plan(plan.save(tmp_path / "p.json"))
    assert again.baselines["time"].fits is False and again.predicted.fits is True
    rows = {line.split()[0]: line for line in format_plan(plan).splitlines() if line}
    at = rows["split"].index(" fits") + 1
    assert rows["time"][at - 2:at + 4].split() == ["NO"] and rows["even"][at:at + 4].split() == ["yes"]
    assert "does not fit (a rank's simulated peak exceeds its device's memory): time" in format_plan(plan)


def test_a_plan_records_the_nodes_of_its_cluster() -> None:
    from autopp.data.catalog import cluster_from_catalog, load_device
    profile = load_profile(Path(__file__).resolve().parents[2] / "profiles" / "gpt")
    h100 = load_device("h100-sxm")
    for devices, nodes in ((4, (2, 2)), (2, None)):  # 2 per node: a cluster of nodes; all on one: flat
        cluster = cluster_from_catalog(h100, devices, devices_per_node=2, memory_bytes=2**32)
        assert make_plan(profile, PlanRequest(cluster=cluster, global_batch=8)).nodes == nodes


def test_a_warm_start_order_is_said_as_such_not_with_a_gap_of_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new user's plan said "order synthesized by CP-SAT (hint, gap nan%)" when CP-SAT found no order in its time
    limit and its warm start won (SynthStatus.HINT, gap NaN): said in words."""
    from dataclasses import replace

    from autopp.solve.assemble import make

    real = make.synthesized

    def as_hint(*args: object, **kw: object) -> object:
        found = real(*args, **kw)  # type: ignore[arg-type]
        return None if found is None else replace(found, status="hint", gap=float("nan"))
    monkeypatch.setattr(make, "synthesized", as_hint)
    plan = make_plan(load_profile(GPT), PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=2 << 30),
                                                    global_batch=8, schedule=ScheduleName.GPIPE,
                                                    synthesize=True))
    said = [n for n in plan.notes if n.startswith("order synthesized by CP-SAT")]
    assert said and "(its warm start: the solver found no faster order in its time limit)" in said[0]
    assert "nan" not in format_plan(plan)


def test_context_parallelism_beside_tp_is_said_to_be_costed_only() -> None:
    """A tester: a cp 2 x tp 2 plan was made without a word, then `autopp run` refused it (it runs cp with tp 1)."""
    from dataclasses import replace

    from autopp.data.cluster import Cluster
    from autopp.data.layout import LayoutPins
    from autopp.data.synthetic_profile import synthetic_profile
    from autopp.solve import PlanRequest, make_plan
    p = synthetic_profile(6, hidden=512, seq=64, tp_degrees=(2,))
    attention = {"heads": 8, "kv_heads": 8, "head_dim": 64, "causal": True}
    p = replace(p, meta=replace(p.meta, extra={**p.meta.extra, "hf_config": {
        "seq_len": 64, "task": "causal-lm", "model_type": "llama", "attention": attention}}))
    notes = {tp: [n for n in make_plan(p, PlanRequest(cluster=Cluster(num_devices=4 * tp, memory_bytes=2**40),
                                                       global_batch=8, pins=LayoutPins(pp=2, dp=1, cp=2, tp=tp))).notes
                  if n.startswith("context parallelism 2")] for tp in (1, 2)}
    assert notes[2][0].endswith("(costed only beside tp 2: `autopp run` runs context parallelism with tp 1; a "
                                "trainer runs it: `autopp export`)")
    assert "costed only" not in notes[1][0]


def test_a_plan_the_runner_refuses_says_so_through_the_api_too() -> None:
    """ZeRO 1 beside ep is costed and exported, not run (autopp.data.runner_rules): `make_plan` itself notes it, so a
    Python user hears it as the CLI's user does; a plan it runs says nothing."""
    from autopp.data.layout import LayoutPins
    from autopp.data.zero import ZERO
    from tests.costmodel.test_parallel import _moe_profile
    cluster = Cluster(num_devices=4, memory_bytes=2**30)
    refused = make_plan(_moe_profile(), PlanRequest(cluster=cluster, global_batch=8,
                                                    pins=LayoutPins(pp=2, dp=2, ep=2, zero=ZERO[1])))
    assert any(n.startswith("autopp run would refuse this plan (plan field 'ep' is 2 with pp 2, dp 2") and
               n.endswith("; a trainer runs it (autopp export)") for n in refused.notes)
    runs = make_plan(_moe_profile(), PlanRequest(cluster=cluster, global_batch=8, pins=LayoutPins(pp=2, dp=2, ep=2)))
    assert not any(n.startswith("autopp run would refuse") for n in runs.notes)
