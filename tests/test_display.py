"""The plan and profile tables at real size (issue 26): stage rows as unit ranges, one unit per column, no line
as wide as a stage's list of 40 layer names."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from autopp.data.cluster import Cluster
from autopp.data.layout import LayoutPins
from autopp.data.synthetic_profile import synthetic_profile
from autopp.data.vocab import VocabVariant
from autopp.display import format_plan, format_profile, stage_sizes, unit_span
from autopp.schedule import ScheduleName
from autopp.solve import PlanRequest, make_plan


@pytest.mark.parametrize("names,span", [
    (["model.embed_tokens", "model.layers.0", "model.layers.1"], "model.embed_tokens, model.layers.0-1"),
    ([f"model.layers.{i}" for i in range(40, 80)] + ["model.norm"], "model.layers.40-79, model.norm"),
    (["h.3"], "h.3"),
    (["h.1", "h.3"], "h.1, h.3"),  # not consecutive: two parts
    (["conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1.1"], "conv1 ... layer1.0-1"),
    (["0", "1", "2"], "0-2"),
])
def test_unit_span(names: list[str], span: str) -> None:
    assert unit_span(names) == span


def test_stage_sizes_count_repeats() -> None:
    assert stage_sizes([(0, 1), (1, 2), (2, 4), (4, 7), (7, 10), (10, 12)]) == "1 x2, 2, 3 x2, 2"


def _one_unit(column: list[str]) -> set[str]:
    return {cell.split()[-1] for cell in column if cell.strip()}


def _column(table: str, header: str) -> list[str]:
    """The cells under `header` in the first table of `table` (fixed-width columns, right-aligned figures)."""
    lines = [line for line in table.split("\n\n")[1].splitlines()]
    end = lines[0].index(header) + len(header)
    start = lines[1].rfind(" ", 0, end - 1) + 1
    return [line[start:end] for line in lines[2:]]


def test_a_32_stage_plan_reads_at_terminal_width() -> None:
    """Issue 26: rows of 200-330 characters (every model.layers.N listed), `9595 ms` beside `11.2 s`."""
    plan = make_plan(synthetic_profile(130), PlanRequest(cluster=Cluster(num_devices=32, memory_bytes=80 * 2**30),
                                                          global_batch=64, schedule=ScheduleName.ONE_F_ONE_B,
                                                          pins=LayoutPins(pp=32, dp=1)))
    text = format_plan(plan)
    tables = text.split("\n\n")[1:3]  # the stage table and the summary (the head and notes are prose)
    assert max(len(line) for t in tables for line in t.splitlines()) <= 100, tables
    assert re.search(r"^0 +0 +0-\d+ \(emb, h\.0-\d+\) ", text, re.M)
    assert "units per stage" in text and " x" in text  # 32 ranges would not fit: counted instead
    assert text.split("\n\n")[1].startswith("stage  pp rank  units")  # the pipeline rank (a report's: global)
    for header in ("forward/mb", "backward/mb", "rank peak memory"):
        assert len(_one_unit(_column(text, header))) == 1, header
    summary = text.split("\n\n")[2].split("\n(")[0].splitlines()  # the rows, up to "(simulated; ..."
    assert len({row.split()[2] for row in summary[2:]}) == 1  # step time, ideal too
    assert "e+" not in text and "e-0" not in text


def test_profile_table_has_one_unit_per_column() -> None:
    text = format_profile(synthetic_profile(6))
    rows = [line.split() for line in text.splitlines()[2:]]
    for i in (4, 6, 8, 10, 12):  # forward, backward, params, activations, output: value then unit
        assert len({r[i] for r in rows}) == 1, [r[i] for r in rows]


def test_the_plan_table_says_where_the_step_goes_and_what_overlap_hides() -> None:
    """Issue 25 item 7: the breakdown's rows, each on the critical path (averaged over the pp ranks), add up to the
    step; the all-reduce the overlap hides is shown beside what stays exposed."""
    from dataclasses import replace

    from autopp.data.overlap import TRAINER_OVERLAP
    from autopp.display import format_breakdown
    from autopp.sizes import format_time
    plan = make_plan(synthetic_profile(10), PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=80 * 2**30),
                                                        global_batch=16, pins=LayoutPins(pp=2, dp=2),
                                                        overlap=TRAINER_OVERLAP))
    text = format_breakdown(plan)
    assert text in format_plan(plan) and text.splitlines()[0].split() == \
        ["where", "the", "step", "goes", "time", "share", "hidden", "by", "overlap"]
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[2:-1])}
    assert set(rows) >= {"compute", "pipeline bubble", "DP/ZeRO at the step's end"}
    assert len(rows["DP/ZeRO at the step's end"]) == 3 and len(rows["compute"]) == 2  # the hidden part beside
    b = plan.time_breakdown
    assert b is not None and rows["compute"][0] == format_time(b.rows(2)[0][1])
    assert sum(float(r[1].rstrip("%")) for r in rows.values()) == pytest.approx(100, abs=0.2)
    assert format_breakdown(replace(plan, time_breakdown=None)) == ""


def test_the_band_line_says_whether_the_margin_is_inside_it() -> None:
    """Issue 29, item 4: the table gives the step's band and says when other configurations predict inside it; a
    profile without spreads says it has none."""
    from dataclasses import replace
    plan = make_plan(synthetic_profile(8), PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=80 * 2**30),
                                                      global_batch=8))
    assert "\nstep band: none (the profile has no spreads: counted analytically, or timed once)" in format_plan(plan)
    step = plan.predicted.step_time_s
    text = format_plan(replace(plan, step_band_s=(0.9 * step, 1.1 * step)))
    assert "(every unit at the low or high end of its profiled spread): no other configuration" in text
    text = format_plan(replace(plan, step_band_s=(0.9 * step, 1.1 * step), tied=("GPipe pp(2) x dp(1) v=1 m=8: x",)))
    assert "; the margin is inside it: 1 other configuration predicts inside it (GPipe pp(2) x dp(1) v=1 m=8: " \
        "x)" in text


def test_a_vocabulary_parallel_plan_says_so_under_its_heading() -> None:
    plan = make_plan(synthetic_profile(6), PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=80 * 2**30),
                                                       global_batch=4, pins=LayoutPins(pp=2, dp=1)))
    assert "vocabulary parallelism" not in format_plan(plan)
    text = format_plan(replace(plan, vocab=VocabVariant.VOCAB_1))
    assert text.splitlines()[1] == ("vocabulary parallelism vocab-1: embedding and head split along the vocabulary "
                                    "over all 2 ranks (their passes in the stages' times and memory)")
    own = next(line for line in text.splitlines() if line.startswith("autopp "))
    assert own.endswith(" + vocab-1 (the baselines without)")  # a tester: one split at two step times, unexplained


def test_one_microbatch_is_singular() -> None:
    """The tester's "without --for deepspeed: GPipe pp 1 x dp 64, ZeRO 3, 1 microbatches of 8": every view says the
    microbatches through one function, singular for one."""
    from autopp.display import format_microbatches
    assert format_microbatches(1, 8) == "1 microbatch of 8"
    assert format_microbatches(4, 2) == "4 microbatches of 2"


def test_a_pp_1_plan_prints_no_zero_sync_line_a_bubble_of_0_and_one_unit_per_breakdown_column() -> None:
    """Tester, at pp 1: "ZeRO 3 reduce-scatter + all-gather 0 ms at the step's end included", "pipeline bubble
    < 0.01 us" (float rounding in the simulator's idle fraction) and "optimizer step 425 us" under ms rows."""
    from autopp.data.zero import ZERO
    from autopp.display import format_breakdown
    plan = make_plan(synthetic_profile(8), PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=80 * 2**30),
                                                      global_batch=8, pins=LayoutPins(pp=1, dp=2)))
    b = plan.time_breakdown
    assert b is not None and b.bubble_s == 0.0
    text = format_breakdown(plan)
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[2:-1])}
    assert rows["pipeline bubble"][0] == "0 ms"
    assert len(_one_unit([r[0] for r in rows.values()])) == 1, rows
    unsynced = replace(plan, layout=replace(plan.layout, zero=ZERO[3]),
                       predicted=replace(plan.predicted, allreduce_s=0.0))
    assert "at the step's end included" not in format_plan(unsynced)
    assert "at the step's end included" in format_plan(plan)


def test_the_grid_names_every_axis_above_one() -> None:
    """A new user's: a plan with `--ep 2 --etp 2` was headed "pp 2 x dp 4 x ep 2" (the axes were listed by name,
    etp missing) while its notes spoke of etp; every axis of the registry above degree 1 is named, in mesh order."""
    from autopp.data.layout import Layout
    from autopp.data.zero import ZERO
    from autopp.display import format_grid
    assert format_grid(Layout(pp=2, dp=4, ep=2, etp=2)) == "pp 2 x dp 4 x ep 2 x etp 2"
    sp = Layout(pp=2, dp=2, cp=2, tp=2, sp=True, zero=ZERO[1])
    assert format_grid(sp) == "pp 2 x dp 2 x cp 2 x tp 2 + SP, ZeRO 1"
    assert format_grid(Layout(pp=4, dp=1)) == "pp 4 x dp 1"


def test_chimeras_step_end_is_named_as_its_replicas_gradient_sum_everywhere() -> None:
    """A tester: Chimera at dp 1 showed "DP/ZeRO at the step's end" in its breakdown and "all-reduce" in its title;
    that term is each rank's sum of its two replicas' gradients. Its table names both ranks of each stage."""
    from autopp.display import format_breakdown, format_predicted_step
    plan = make_plan(synthetic_profile(8), PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=80 * 2**30),
                                                      global_batch=8, schedule=ScheduleName.CHIMERA,
                                                      pins=LayoutPins(pp=2, dp=1)))
    assert plan.mirrored and "replicas' gradient sum at the step's end" in format_breakdown(plan)
    headline = format_predicted_step(plan, plan.predicted.step_time_s - plan.predicted.allreduce_s)
    assert "replicas' gradient sum" in headline and "all-reduce" not in headline
    text = format_plan(plan)
    assert "1 stage per rank in each of 2 pipelines running opposite ways" in text
    assert re.search(r"^0 +0 and 1 ", text.split("\n\n")[1].splitlines()[2])


def test_one_rank_is_one_rank() -> None:
    """A tester: "GPipe on 1 ranks"."""
    plan = make_plan(synthetic_profile(4), PlanRequest(cluster=Cluster(num_devices=1, memory_bytes=2**40),
                                                       global_batch=4, schedule=None))
    assert " on 1 rank (pp 1 x dp 1, " in format_plan(plan)
