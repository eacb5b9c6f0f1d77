"""Plan JSON: round trip, atomic save, and clear refusals of bad files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from autopp.data.layout import Layout, LayoutPins
from autopp.data.overlap import Overlap
from autopp.data.plan import PLAN_VERSION, Plan, Prediction, StagePlan, load_plan
from autopp.data.vocab import VocabVariant
from autopp.data.zero import ZERO
from autopp.errors import PlanError
from autopp.schedule import Action, Activation, Kind, ScheduleName, parse_action


def _plan() -> Plan:
    stages = tuple(StagePlan(index=i, rank=i, units=(a, b), unit_names=("x",) * (b - a), split_point="h.2" if i else None,
                             forward_s=1.0, backward_s=2.0, memory_bytes=10) for i, (a, b) in enumerate([(0, 2), (2, 5)]))
    pred = Prediction(step_time_s=3.0, peak_memory_bytes=(10, 10), bubble_fraction=0.25, stage_units=((0, 2), (2, 5)))
    return Plan(model_path="/models/m.py", fingerprint="abc", schedule=ScheduleName.ONE_F_ONE_B,
                layout=Layout(pp=2), num_microbatches=4, microbatch_size=2, memory_limit_bytes=100, stages=stages,
                predicted=pred, baselines={"even": pred})


def test_a_stages_outputs_and_recomputed_forward_round_trip_into_its_costs(tmp_path: Path) -> None:
    """`output_bytes` and `recompute_s` (2026-12-06) are written where they are not 0 and come back into the
    simulator's costs (`StagePlan.cost`); a plan written before them reads as 0 and None (`forward_s` redone)."""
    plan = _plan()
    first = replace(plan.stages[0], activation=Activation.RECOMPUTE, output_bytes=64, recompute_s=0.75)
    plan = replace(plan, stages=(first, plan.stages[1]))
    data = json.loads(plan.save(tmp_path / "p.json").read_text())
    assert (data["stages"][0]["output_bytes"], data["stages"][0]["recompute_s"]) == (64, 0.75)
    assert "output_bytes" not in data["stages"][1] and "recompute_s" not in data["stages"][1]
    cost = load_plan(tmp_path / "p.json").stages[0].cost()
    assert (cost.output_bytes, cost.recompute_s, cost.redo_forward_s) == (64, 0.75, 0.75)
    assert _plan().stages[0].cost().redo_forward_s == 1.0
    none = replace(plan, stages=(replace(first, recompute_s=0.0), plan.stages[1]))  # a reviewer: 0 read back as None
    assert load_plan(none.save(tmp_path / "zero.json")).stages[0].recompute_s == 0.0
    data["stages"][0]["output_bytes"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="output_bytes"):
        load_plan(tmp_path / "bad.json")


def test_round_trip(tmp_path: Path) -> None:
    plan = _plan()
    path = plan.save(tmp_path / "p.json")
    assert load_plan(path) == plan
    data = json.loads(path.read_text())
    assert data["version"] == PLAN_VERSION == 2 and data["stages"][1]["units"] == [2, 5]
    assert (data["num_ranks"], data["pp"], data["dp"], data["virtual_stages"]) == (2, 2, 1, 1)
    assert data["stages"][0]["activation"] == "keep" and "recompute" not in data["stages"][0]
    assert plan.global_batch == 8 and plan.split_points == ["h.2"]


def test_bad_version(tmp_path: Path) -> None:
    data = _plan().to_json() | {"version": 99}
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="plan version 99 is not supported"):
        load_plan(tmp_path / "p.json")


@pytest.mark.parametrize("data, why", [
    ({"version": 1, "measured_step_time_s": 0.1, "passed": True}, r"not a plan \(a run report, which `autopp run`"),
    ({"architectures": ["LlamaForCausalLM"]}, r"not a plan \(no field 'stages'\)"),
    ([1, 2], r"not a plan \(no field 'stages'\)")])
def test_a_file_that_is_not_a_plan_is_said_to_be_none(tmp_path: Path, data: object, why: str) -> None:
    """A run report or an HF config.json given where a plan goes: one line that says what it is, not a field of a
    plan it lacks."""
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match=rf"p\.json: {why}.*give the plan JSON that `autopp plan` wrote"):
        load_plan(tmp_path / "p.json")


def test_not_json(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text("{\n oops")
    with pytest.raises(PlanError, match=r"p\.json:2: not valid JSON"):
        load_plan(tmp_path / "p.json")


def test_malformed(tmp_path: Path) -> None:
    data = _plan().to_json()
    del data["stages"][0]["rank"]
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"p\.json: stage 0: missing field .rank."):
        load_plan(tmp_path / "p.json")


@pytest.mark.parametrize("value", ["x", None, -1.0, True])
def test_bad_stage_time_names_file_stage_and_field(tmp_path: Path, value: object) -> None:
    data = _plan().to_json()
    data["stages"][1]["progress_s"] = value
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"p\.json: stage 1: field 'progress_s' must be a finite number >= 0, got "):
        load_plan(tmp_path / "p.json")


def test_gapped_stages_rejected() -> None:
    plan = _plan()
    bad = (plan.stages[0], StagePlan(**{**plan.stages[1].__dict__, "units": (3, 5)}))
    with pytest.raises(PlanError, match="not contiguous"):
        Plan(**{**plan.__dict__, "stages": bad})


def test_new_fields_round_trip_and_old_files_still_load(tmp_path: Path) -> None:
    plan = _plan()
    data = plan.to_json()
    assert (data["pp"], data["dp"], data["virtual_stages"]) == (2, 1, 1)
    for key in ("pp", "dp", "virtual_stages", "ideal_step_time_s", "notes"):
        del data[key]
    for s in data["stages"]:
        del s["activation"]
    (tmp_path / "old.json").write_text(json.dumps(data | {"version": 1}))
    assert load_plan(tmp_path / "old.json") == plan


def test_version_1_recompute_flags_load_as_activation_policies(tmp_path: Path) -> None:
    """Version 1 wrote each stage's `recompute` flag; it loads as the stage's activation policy, and a bad flag is
    refused by name."""
    data = _plan().to_json() | {"version": 1}
    data["stages"] = [{k: v for k, v in s.items() if k != "activation"} | {"recompute": flag}
                      for s, flag in zip(data["stages"], (False, True))]
    loaded = load_plan(_write(tmp_path, data))
    assert [s.activation for s in loaded.stages] == [Activation.KEEP, Activation.RECOMPUTE]
    assert loaded.version == PLAN_VERSION and loaded.to_json()["stages"][1]["activation"] == "recompute"
    data["stages"][1]["recompute"] = "yes"
    with pytest.raises(PlanError, match=r"p\.json: stage 1: field 'recompute' must be true or false, got 'yes'"):
        load_plan(_write(tmp_path, data))
    with pytest.raises(PlanError, match=r"p\.json: stage 0: field 'activation' must be an activation policy, one "
                                        r"of \['keep', 'recompute', 'selective', 'offload', 'recompute-units', "
                                        r"'selective-units'\], got 'full'"):
        load_plan(_write(tmp_path, _plan().to_json() | {"stages": [
            {**_plan().to_json()["stages"][0], "activation": "full"}, _plan().to_json()["stages"][1]]}))


def test_world_size_is_pp_times_dp_times_tp(tmp_path: Path) -> None:
    plan = _plan()
    dp2 = replace(plan, layout=Layout(pp=2, dp=2))
    assert dp2.global_batch == 16 and dp2.num_ranks == 4
    with pytest.raises(PlanError, match=r"p\.json: pp\(2\) \* dp\(2\) != num_ranks \(3\)"):
        load_plan(_write(tmp_path, plan.to_json() | {"num_ranks": 3, "dp": 2}))
    tp2 = replace(plan, layout=Layout(pp=2, dp=2, tp=2, zero=ZERO[3]))
    assert tp2.global_batch == 16 and tp2.num_ranks == 8  # tensor-parallel ranks share their replica's samples
    with pytest.raises(PlanError, match=r"p\.json: field 'zero': ZeRO stage 4 does not exist; give one of \[0, 1, 2, 3\]"):
        load_plan(_write(tmp_path, dp2.to_json() | {"tp": 1, "zero": 4}))
    with pytest.raises(PlanError, match=r"p\.json: ZeRO 1 shards over data-parallel replicas, and dp is 1"):
        load_plan(_write(tmp_path, plan.to_json() | {"tp": 1, "zero": 1}))
    with pytest.raises(TypeError, match="Layout.zero must be a ZeroStage, got 3"):
        Layout(pp=2, dp=2, zero=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Plan.layout must be a Layout"):
        replace(plan, layout=(2, 1))  # type: ignore[arg-type]


def test_3d_fields_round_trip_and_stay_out_of_pipeline_only_plans(tmp_path: Path) -> None:
    plan = _plan()
    assert "tp" not in plan.to_json() and "zero" not in plan.to_json()
    tp2 = replace(plan, layout=Layout(pp=2, dp=2, tp=2, zero=ZERO[1]),
                  tp_plan={"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"})
    data = tp2.to_json()
    assert (data["num_ranks"], data["tp"], data["zero"]) == (8, 2, 1) and "cp" not in data and "ep" not in data
    back = load_plan(tp2.save(tmp_path / "p.json"))
    assert back == tp2 and (back.layout.tp, back.layout.zero, back.tp_plan) == (2, ZERO[1], tp2.tp_plan)


def _write(tmp_path: Path, data: dict[str, object]) -> Path:
    (tmp_path / "p.json").write_text(json.dumps(data))
    return tmp_path / "p.json"


@pytest.mark.parametrize("field,value,message", [
    ("num_microbatches", "two", r"field 'num_microbatches' must be an integer >= 1, got 'two'"),
    ("microbatch_size", -4, r"field 'microbatch_size' must be an integer >= 1, got -4"),
    ("memory_limit_bytes", 1.5, r"field 'memory_limit_bytes' must be an integer >= 1"),
    ("dp", True, r"field 'dp' must be an integer >= 1, got True"),
    ("seed", 2**64, r"field 'seed' must be below 2\*\*63"),
    ("schedule", "2F2B", r"field 'schedule' is '2F2B'; expected one of \[.*'1F1B'"),
    ("num_microbatches", 1, r"field 'num_microbatches': 1F1B needs microbatches >= stages \(1 < 2\); re-plan"),
    ("virtual_stages", 2, r"2 stages for pp 2 x virtual_stages 2"),
    ("virtual_stages", 0, r"field 'virtual_stages' must be an integer >= 1, got 0"),
    ("custom_order", "0F0", r"field 'custom_order' must be a list of per-rank lists"),
])
def test_fields_are_type_and_range_checked(tmp_path: Path, field: str, value: object, message: str) -> None:
    # issue 13.6: "two" reached torch, -4 was blamed on the model file
    with pytest.raises(PlanError, match=r"p\.json: " + message):
        load_plan(_write(tmp_path, _plan().to_json() | {field: value}))


def test_a_stages_per_rank_rule_names_virtual_stages(tmp_path: Path) -> None:
    # Review of issue 13.6: every schedule-size failure was reported as field 'num_microbatches'.
    one_rank = _plan().to_json() | {"pp": 1, "num_ranks": 1, "virtual_stages": 2, "num_microbatches": 2}
    one_rank["stages"] = [{**st, "rank": 0} for st in one_rank["stages"]]
    with pytest.raises(PlanError, match=r"p\.json: field 'virtual_stages': 1F1B runs exactly 1 stage per rank "
                                        r"\(2 != 1\); re-plan"):
        load_plan(_write(tmp_path, one_rank))


def test_microbatch_count_must_fit_the_predicted_step(tmp_path: Path) -> None:
    # issue 13.6: num_microbatches 1000000 started the ranks and hung to the timeout. _plan(): F + B = 3 s per
    # microbatch on each rank; a planner-made plan (ideal_step_time_s > 0) predicting 14 s fits at most 4.
    plan = _plan()
    good = plan.to_json() | {"ideal_step_time_s": 6.0, "predicted": {**plan.to_json()["predicted"], "step_time_s": 14.0}}
    assert load_plan(_write(tmp_path, good)).num_microbatches == 4
    with pytest.raises(PlanError, match=r"p\.json: field 'num_microbatches' is 1000000, but 1000000 microbatches of "
                                        r"rank 0's stages take at least 3e\+06 s, and the plan predicts a 14 s step, "
                                        r"which fits at most 4: the file was edited after planning; re-plan"):
        load_plan(_write(tmp_path, good | {"num_microbatches": 1_000_000}))
    assert load_plan(_write(tmp_path, good | {"num_microbatches": 4, "ideal_step_time_s": 0.0}))  # hand-made: as is


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_plans_the_planner_makes_pass_every_check(tmp_path: Path) -> None:
    from autopp.data.cluster import Cluster
    from autopp.data.profile import load_profile
    from autopp.schedule import NAMED
    from autopp.solve import PlanRequest, make_plan
    profile = load_profile(Path(__file__).resolve().parent.parent / "profiles" / "gpt")
    for name in NAMED:
        plan = make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**32), global_batch=8,
                                              schedule=name))
        assert load_plan(plan.save(tmp_path / f"{name.value}.json")).num_microbatches == plan.num_microbatches


def test_directory_and_unreadable_plans(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"is a directory; give a plan JSON file"):
        load_plan(tmp_path)
    (tmp_path / "p.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(PlanError, match=r"p\.json: cannot read plan JSON file"):
        load_plan(tmp_path / "p.json")


def test_plan_without_device_order_loads_and_writes_none(tmp_path: Path) -> None:
    """Plans written before the field load with rank r on device r, and such plans are written as before."""
    data = _plan().to_json()
    assert "device_order" not in data
    plan = load_plan(_write(tmp_path, data))
    assert plan.device_order == () and [plan.rank_on(d) for d in range(2)] == [0, 1]


def test_device_order_round_trips(tmp_path: Path) -> None:
    plan = replace(_plan(), device_order=(1, 0))
    loaded = load_plan(plan.save(tmp_path / "p.json"))
    assert loaded == plan and loaded.to_json()["device_order"] == (1, 0)
    assert [loaded.rank_on(d) for d in range(2)] == [1, 0]


@pytest.mark.parametrize("order, message", [
    ([0, 0], r"field 'device_order' must be a permutation of 0..1 \(one device per rank\), got \[0, 0\]"),
    ([0, 1, 2], r"field 'device_order' must be a permutation of 0..1"),
    ([1, "0"], r"field 'device_order' must be a list of device indices"),
    ("10", r"field 'device_order' must be a list of device indices"),
])
def test_bad_device_order_is_refused(tmp_path: Path, order: object, message: str) -> None:
    with pytest.raises(PlanError, match=message) as info:
        load_plan(_write(tmp_path, {**_plan().to_json(), "device_order": order}))
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_hf_config_round_trips_and_is_absent_for_model_files(tmp_path: Path) -> None:
    """A plan of a model built from an HF config records its sequence length and task for `autopp run`; plans of
    model files are written as before."""
    assert "hf_config" not in _plan().to_json()
    plan = replace(_plan(), model_path="/models/c.json", hf_config={"seq_len": 8, "task": "causal-lm"})
    loaded = load_plan(plan.save(tmp_path / "p.json"))
    assert loaded == plan and loaded.hf_config == {"seq_len": 8, "task": "causal-lm"}


@pytest.mark.parametrize("hf, message", [
    ([8], r"field 'hf_config' must be \{\} or \{\"seq_len\": S >= 1, \"task\": T\}, got \[8\]"),
    ({"seq_len": 0, "task": "causal-lm"}, r"field 'hf_config' must be .*, got \{'seq_len': 0"),
    ({"seq_len": 8}, r"field 'hf_config' must be .*, got \{'seq_len': 8\}"),
])
def test_bad_hf_config_is_refused(tmp_path: Path, hf: object, message: str) -> None:
    with pytest.raises(PlanError, match=message) as info:
        load_plan(_write(tmp_path, {**_plan().to_json(), "hf_config": hf}))
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def _custom() -> Plan:
    rows = ("0F0 0F1 0B0 0B1", "1F0 1I0 1W0 1F1 1I1 1W1")
    return replace(_plan(), schedule=ScheduleName.CUSTOM, num_microbatches=2,
                   custom_order=tuple(tuple(parse_action(t) for t in row.split()) for row in rows))


def test_custom_order_loads_as_actions_and_is_written_as_text(tmp_path: Path) -> None:
    # issue 14.4: the order was text that predict and run each parsed; now only plan.py parses it
    path = _custom().save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["custom_order"] == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"]]
    loaded = load_plan(path)
    assert loaded == _custom() and loaded.custom_order[1][1] == Action(1, Kind.I, 0)
    text = path.read_text()
    assert loaded.save(tmp_path / "q.json").read_text() == text


@pytest.mark.parametrize("cell, message", [
    ("1X0", r"field 'custom_order' rank 1 position 2: cannot parse action '1X0'"),
    ("", r"field 'custom_order' rank 1 position 2: cannot parse action ''"),
    (5, r"field 'custom_order' rank 1 position 2 must be an action like \"0F0\", got 5"),
])
def test_a_bad_custom_order_cell_names_rank_and_position(tmp_path: Path, cell: object, message: str) -> None:
    data = _custom().to_json()
    data["custom_order"] = [list(row) for row in data["custom_order"]]
    data["custom_order"][1][2] = cell
    with pytest.raises(PlanError, match=r"p\.json: " + message) as info:
        load_plan(_write(tmp_path, data))
    assert "\n" not in str(info.value)


def test_custom_order_of_text_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="Plan.custom_order must hold Actions"):
        replace(_custom(), custom_order=(("0F0", "0B0"), ("1F0", "1B0")))


def test_fits_is_written_read_and_defaults_to_true(tmp_path: Path) -> None:
    plan = _plan()
    unfit = replace(plan, baselines={"even": replace(plan.predicted, fits=False)})
    data = unfit.to_json()
    assert data["predicted"]["fits"] is True and data["baselines"]["even"]["fits"] is False
    assert load_plan(_write(tmp_path, data)) == unfit
    del data["predicted"]["fits"], data["baselines"]["even"]["fits"]  # a plan written before the field
    assert load_plan(_write(tmp_path, data)) == plan
    data["baselines"]["even"]["fits"] = "no"
    with pytest.raises(PlanError, match=r"p\.json: baselines\.even: field 'fits' must be true or false, got 'no'"):
        load_plan(_write(tmp_path, data))


# Issue 26, point 10: `autopp run` picks its backend by the device kind and trains with the profile's optimizer, so
# the plan records both (written only when known: older plans stay as they were).
def test_device_and_optimizer_round_trip_and_stay_out_when_unknown(tmp_path: Path) -> None:
    data = _plan().to_json()
    assert "device" not in data and "optimizer" not in data
    plan = replace(_plan(), device="h100-sxm", optimizer="adamw")
    loaded = load_plan(plan.save(tmp_path / "p.json"))
    assert loaded == plan and (loaded.device, loaded.optimizer) == ("h100-sxm", "adamw")
    with pytest.raises(PlanError, match=r"field 'optimizer' must be a non-empty string, got 7"):
        load_plan(_write(tmp_path, {**plan.to_json(), "optimizer": 7}))


# Issue 26, point 5: the exports write the trainer's precision recipe from the profile's dtype, which the plan keeps.
def test_dtype_round_trips_and_stays_out_when_unknown(tmp_path: Path) -> None:
    assert "dtype" not in _plan().to_json()
    plan = replace(_plan(), dtype="bfloat16")
    assert load_plan(plan.save(tmp_path / "p.json")).dtype == "bfloat16"
    with pytest.raises(PlanError, match=r"field 'dtype' must be a non-empty string, got 16"):
        load_plan(_write(tmp_path, {**plan.to_json(), "dtype": 16}))

    fp8 = replace(plan, precision="fp8")
    assert load_plan(fp8.save(tmp_path / "f.json")).precision == "fp8" and "precision" not in plan.to_json()


def test_a_plan_records_its_profiles_recipe() -> None:
    """Issue 25, point 5: the recipe an analytic profile was counted for (`extra.precision`) goes into the plan; a
    profile without one (measured, or made before recipes) leaves it out, and its dtype's recipe applies."""
    from autopp.data.profile import load_profile
    from autopp.data.cluster import Cluster
    from autopp.solve import PlanRequest, make_plan
    profile = load_profile(Path(__file__).resolve().parent.parent / "profiles" / "gpt")
    request = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**32), global_batch=8)
    assert make_plan(profile, request).precision is None
    counted = replace(profile, meta=replace(profile.meta, extra={**profile.meta.extra, "precision": "fp32"}))
    assert make_plan(counted, request).precision == "fp32"


def test_vocab_round_trips_and_stays_out_when_off(tmp_path: Path) -> None:
    assert "vocab" not in _plan().to_json()
    assert load_plan(_plan().save(tmp_path / "p.json")).vocab is None
    plan = replace(_plan(), vocab=VocabVariant.VOCAB_1)
    assert plan.to_json()["vocab"] == "vocab-1"
    assert load_plan(plan.save(tmp_path / "p.json")).vocab is VocabVariant.VOCAB_1
    with pytest.raises(PlanError, match=r"field 'vocab' must be null or one of \['vocab-1', 'vocab-2'\], got 'v3'"):
        load_plan(_write(tmp_path, {**plan.to_json(), "vocab": "v3"}))
    with pytest.raises(PlanError, match=r"field 'vocab' 'vocab-1' splits the vocabulary over pp >= 2 pipeline ranks "
                                        r"and no other axis \(pp 2, 4 ranks\)"):
        load_plan(_write(tmp_path, {**plan.to_json(), "dp": 2, "num_ranks": 4}))


def test_a_plan_is_for_its_clusters_device_else_its_profiles() -> None:
    from autopp.data.catalog import cluster_from_catalog, load_device
    from autopp.data.cluster import Cluster
    from autopp.data.profile import load_profile
    from autopp.solve import PlanRequest, make_plan
    profile = load_profile(Path(__file__).resolve().parent.parent / "profiles" / "gpt")
    on_cpu = make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**32), global_batch=8))
    assert on_cpu.device == "cpu" and on_cpu.optimizer == profile.meta.optimizer
    assert on_cpu.dtype == profile.meta.dtype
    for count in (2, 4):  # one node (a flat cluster), two nodes of two
        cluster = cluster_from_catalog(load_device("h100-sxm"), count, devices_per_node=2)
        plan = make_plan(profile, PlanRequest(cluster=cluster, global_batch=32))
        assert plan.device == "h100-sxm" and (cluster.nodes is None) == (count == 2)


def test_step_band_and_ties_round_trip_and_stay_out_when_unknown(tmp_path: Path) -> None:
    """Issue 29, item 4: the step's band and the configurations inside it are written when known, else not at all
    (plans made before them, and pinned ones, are unchanged)."""
    assert not {"step_band_s", "tied"} & set(_plan().to_json())
    plan = replace(_plan(), step_band_s=(2.5, 3.5), tied=("GPipe pp(2) x dp(1) v=1 m=4: 3.1 s",))
    path = plan.save(tmp_path / "p.json")
    assert load_plan(path) == plan
    assert json.loads(path.read_text())["step_band_s"] == [2.5, 3.5]


@pytest.mark.parametrize("band, message", [
    ([3.5, 2.5], r"field 'step_band_s' must be \[low, high\] seconds with low <= high, got \[3.5, 2.5\]"),
    ([1.0], r"field 'step_band_s' must be \[low, high\] seconds, got \[1.0\]"),
    (["a", 2.0], r"field 'step_band_s' must be a finite number >= 0, got 'a'"),
])
def test_a_bad_step_band_is_refused(tmp_path: Path, band: object, message: str) -> None:
    with pytest.raises(PlanError, match=r"p\.json: " + message):
        load_plan(_write(tmp_path, _plan().to_json() | {"step_band_s": band}))


def test_seq_chunks_round_trip_only_under_seq1f1b(tmp_path: Path) -> None:
    """Sequence pipelining's chunks (docs/plan-format.md): written only when set, set exactly under Seq1F1B, each
    list one entry per chunk."""
    from autopp.schedule.seqpipe import ChunkCosts

    chunks = ChunkCosts((6, 4), (0.5, 0.5), (0.6, 0.46))
    plan = replace(_plan(), schedule=ScheduleName.SEQ_1F1B, seq_chunks=chunks)
    path = plan.save(tmp_path / "p.json")
    assert load_plan(path) == plan
    assert json.loads(path.read_text())["seq_chunks"] == {"lengths": [6, 4], "time_share": [0.5, 0.5],
                                                          "memory_share": [0.6, 0.46]}
    assert "seq_chunks" not in _plan().to_json()
    for data, message in [
        (_plan().to_json() | {"schedule": "Seq1F1B"}, r"field 'seq_chunks' is missing under schedule 'Seq1F1B'"),
        (_plan().to_json() | {"seq_chunks": plan.to_json()["seq_chunks"]},
         r"field 'seq_chunks' is set under schedule '1F1B'"),
        (plan.to_json() | {"seq_chunks": {"lengths": [6], "time_share": [0.5, 0.5], "memory_share": [1, 1]}},
         r"field 'seq_chunks' must be \{\"lengths\", \"time_share\", \"memory_share\"\}"),
        (plan.to_json() | {"seq_chunks": {"lengths": [6, 0], "time_share": [0.5, 0.5], "memory_share": [1, 1]}},
         r"positive token lengths and shares in \(0, 1\]")]:
        (tmp_path / "bad.json").write_text(json.dumps(data))
        with pytest.raises(PlanError, match=message):
            load_plan(tmp_path / "bad.json")


def test_overlap_round_trips_and_older_plans_read_the_default_of_their_device(tmp_path: Path) -> None:
    """Review: the exports must ask the trainer for what the prediction hid (autopp.export.overlap), so the plan
    records its overlap switches; a plan without them (written before the field) reads as the planner's default
    was then: the trainers' overlap on a catalog GPU, nothing on CPU or an unknown device."""
    from autopp.data.overlap import NO_OVERLAP, TRAINER_OVERLAP, Overlap
    old = _plan()
    assert "overlap" not in old.to_json() and old.overlap is None
    assert old.assumed_overlap == NO_OVERLAP and replace(old, device="cpu").assumed_overlap == NO_OVERLAP
    assert replace(old, device="h100-sxm").assumed_overlap == TRAINER_OVERLAP
    plan = replace(old, device="h100-sxm", overlap=Overlap(grad_reduce=False, async_tp=True))
    path = plan.save(tmp_path / "p.json")
    assert json.loads(path.read_text())["overlap"] == {"fsdp_prefetch": True, "grad_reduce": False, "async_tp": True}
    assert load_plan(path) == plan and load_plan(path).assumed_overlap == plan.overlap
    combined = replace(plan, overlap=Overlap(ep_a2a=True))  # written only when on: older plans read as written
    assert json.loads(combined.save(tmp_path / "c.json").read_text())["overlap"]["ep_a2a"] is True
    assert load_plan(tmp_path / "c.json") == combined
    nothing = replace(old, device="h100-sxm", overlap=NO_OVERLAP)
    assert load_plan(nothing.save(tmp_path / "n.json")).assumed_overlap == NO_OVERLAP  # recorded: not the default
    with pytest.raises(PlanError, match=r"p\.json: overlap: field 'grad_reduce' must be true or false, got 1$"):
        load_plan(_write(tmp_path, {**plan.to_json(), "overlap": {"grad_reduce": 1}}))
    with pytest.raises(PlanError, match=r"p\.json: overlap: unknown field 'prefetch'; expected fields"):
        load_plan(_write(tmp_path, {**plan.to_json(), "overlap": {"prefetch": True}}))


def test_the_planner_records_the_overlap_it_assumed() -> None:
    from autopp.data.cluster import Cluster
    from autopp.data.overlap import NO_OVERLAP, Overlap
    from autopp.data.profile import load_profile
    from autopp.solve import PlanRequest, make_plan
    profile = load_profile(Path(__file__).resolve().parent.parent / "profiles" / "gpt")
    request = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**32), global_batch=8)
    assert make_plan(profile, request).overlap == NO_OVERLAP  # no device kind: nothing overlapped
    asked = Overlap(fsdp_prefetch=False, grad_reduce=True)
    assert make_plan(profile, replace(request, overlap=asked)).overlap == asked



_Q3, _L8, _L32 = "qwen3-30b-a3b-h100-sxm-s4096", "llama-3-8b-h100-sxm-s8192", "llama-3.1-8b-h100-sxm-s32768"
_DPV, _ZBV = ScheduleName.DUAL_PIPE_V, ScheduleName.ZBV_ZERO_BUBBLE


@pytest.mark.parametrize("profile, devices, fields", [
    (_Q3, 16, {"schedule": _DPV, "pins": LayoutPins(pp=2, dp=8, ep=8)}),  # all-to-alls hidden in F + B pairs
    (_Q3, 8, {"schedule": _DPV, "pins": LayoutPins(pp=2, dp=4, ep=4)}),
    (_Q3, 16, {"schedule": _ZBV, "pins": LayoutPins(pp=2, dp=8, ep=8)}),
    (_Q3, 16, {"pins": LayoutPins(pp=2, dp=8, ep=8, zero=ZERO[1])}),
    (_L8, 16, {"pins": LayoutPins(pp=2, dp=8, zero=ZERO[2])}),  # reduce-scatters hidden under the backward
    (_L8, 16, {"pins": LayoutPins(pp=2, dp=8, zero=ZERO[3])}),  # all-gathers prefetched
    (_L32, 8, {"pins": LayoutPins(pp=2, cp=4)}),  # the cp ring under attention
    (_L32, 8, {"pins": LayoutPins(pp=2, tp=4), "overlap": Overlap(async_tp=True)}),
    (_L8, 4, {"pins": LayoutPins(pp=4), "activations": (Activation.OFFLOAD,)}),  # transfers under compute
], ids=["dualpipev-ep8", "dualpipev-ep4", "zbv-ep8", "1f1b-ep8", "zero2", "zero3", "cp4", "async-tp4", "offload"])
def test_plans_with_hidden_time_load_back(tmp_path: Path, profile: str, devices: int, fields: dict[str, Any]) -> None:
    # Planner-made DualPipeV MoE plans were refused by every command that loads a plan ("field 'num_microbatches'
    # is 16, but 16 microbatches of rank 1's stages take at least 4.06 s, and the plan predicts a 3.75 s step ...
    # the file was edited after planning"): the load check still counted the all-to-alls that DualPipeV's F + B
    # pairs hide. A plan with any kind of hidden time must load back as the planner made it.
    from autopp.data.catalog import cluster_from_catalog, load_device
    from autopp.data.profile import load_profile
    from autopp.solve import PlanRequest, make_plan
    offload = "activations" in fields  # at the device's own memory, so that offloading is what fits
    cluster = cluster_from_catalog(load_device("h100-sxm"), devices, memory_bytes=None if offload else 2**38)
    prof = load_profile(Path(__file__).resolve().parent.parent / "profiles" / profile)
    plan = make_plan(prof, PlanRequest(cluster=cluster, global_batch=8 * (fields["pins"].dp or 1),
                                       num_microbatches=8, **fields))
    assert not offload or Activation.OFFLOAD in {s.activation for s in plan.stages}
    assert load_plan(plan.save(tmp_path / "p.json")).to_json() == plan.to_json()  # the same file again


def test_a_fresh_dualpipev_moe_plan_exports_and_shows(tmp_path: Path) -> None:
    # The tester's reproduction, on 2 nodes: `autopp plan --profile qwen3-30b-a3b... --ep auto` chose DualPipeV with
    # the all-to-alls hidden, then `autopp export`/`show` refused the plan it had just written.
    from autopp.cli import main
    prof = Path(__file__).resolve().parent.parent / "profiles" / _Q3
    out = tmp_path / "q.plan.json"
    assert main(["plan", "--profile", str(prof), "--device", "h100-sxm", "--nodes", "2", "--memory", "256GiB",
                 "--global-batch", "64", "--schedule", "DualPipeV", "--ep", "8", "-o", str(out)]) == 0
    assert load_plan(out).schedule is _DPV and any(s.comm_s for s in load_plan(out).stages)
    assert main(["export", str(out), "--to", "torchtitan", "-o", str(tmp_path / "q.args")]) == 0
    assert main(["show", str(out), "-o", str(tmp_path / "q.png")]) == 0


def test_nodes_round_trip_stay_out_when_unknown_and_must_hold_the_ranks(tmp_path: Path) -> None:
    plan = _plan()
    assert "nodes" not in plan.to_json() and load_plan(plan.save(tmp_path / "a.json")).nodes is None
    two = replace(plan, nodes=(2, 1))
    assert two.to_json()["nodes"] == (2, 1) and load_plan(two.save(tmp_path / "b.json")).nodes == (2, 1)
    with pytest.raises(PlanError, match=r"p\.json: field 'nodes' is 2 nodes x 8 devices \(= 16\), but the plan has 2 "
                                        r"ranks$"):
        load_plan(_write(tmp_path, {**plan.to_json(), "nodes": [2, 8]}))
    with pytest.raises(PlanError, match=r"p\.json: field 'nodes' must be \[nodes, devices per node\], got 2"):
        load_plan(_write(tmp_path, {**plan.to_json(), "nodes": 2}))


def test_a_moe_plan_with_ep_left_at_1_says_it_was_not_searched(tmp_path: Path) -> None:
    """A new user's Qwen3-30B-A3B plan held all 128 experts on every rank and nothing said that ep (pinned 1 by
    default) was never tried; a plan with ep says nothing of it."""
    from autopp.cli import main
    prof = Path(__file__).resolve().parent.parent / "profiles" / _Q3
    said = "expert parallelism not searched (--ep 1, the default): each rank holds all 128 experts"
    for flags, expected in (([], True), (["--ep", "8"], False)):
        out = tmp_path / f"q{len(flags)}.plan.json"
        assert main(["plan", "--profile", str(prof), "--device", "h100-sxm", "--nodes", "2", "--memory", "256GiB",
                     "--global-batch", "64", "--schedule", "1F1B", *flags, "-o", str(out)]) == 0
        assert any(n.startswith(said.replace("--ep", "`ep`")) for n in load_plan(out).notes) is expected
