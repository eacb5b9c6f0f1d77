"""autopp.run.context_run: what `autopp run` refuses under context parallelism (one line each), the rotary positions
a cp rank's pieces are given, and (integration) a tiny HF Llama (examples/configs/tiny-llama.json) whose sequences
are sharded over cp ranks (head-tail chunks, their own rotary positions, attention as torch's ring), pp x cp, dp x
cp and ZeRO over cp on 2 and 4 gloo ranks (the last two as Qwen2 and Qwen3, the other listed families), validated
against one process in the loss and every gradient."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autopp.data.layout import Layout
from autopp.data.plan import Plan, Prediction, StagePlan
from autopp.model.hf import load_model
from autopp.model.units import discover_units, fingerprint
from autopp.run import GRAD_RTOL, RunOptions, RunReport, run_plan
from autopp.errors import RunError
from autopp.run.context_run import POSITIONS, check_context_model, check_context_plan, own_positions, rotary_modules
from autopp.schedule import ScheduleName, stage_to_rank

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "examples" / "configs" / "tiny-llama.json"
SEQ = 16


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def plan() -> Plan:
    return llama_plan(Layout(pp=2, cp=2), ["model.layers.2"])


def llama_plan(layout: Layout, split_points: list[str], schedule: str = "1F1B", num_microbatches: int = 2,
               microbatch_size: int = 2, seq_len: int = SEQ, config: Path = TINY_LLAMA) -> Plan:
    """A plan of the tiny HF Llama (or `config`) at `seq_len` tokens cut at `split_points`, the stages placed as the
    schedule places them."""
    hf = {"seq_len": seq_len, "task": "causal-lm"}
    mf = load_model(config, hf)
    model = mf.build(0)
    units = discover_units(mf, model)
    cuts = [0] + [next(u.index for u in units if u.split_point == p) for p in split_points] + [len(units)]
    ranks = stage_to_rank(ScheduleName(schedule), layout.pp, layout.v)
    stages = tuple(StagePlan(index=i, rank=ranks[i], units=(a, b), unit_names=tuple(u.name for u in units[a:b]),
                             split_point=None if i == 0 else split_points[i - 1], forward_s=0.01, backward_s=0.02,
                             memory_bytes=1000) for i, (a, b) in enumerate(zip(cuts, cuts[1:])))
    return Plan(model_path=str(config), fingerprint=fingerprint(model, units), schedule=ScheduleName(schedule),
                layout=layout, num_microbatches=num_microbatches, microbatch_size=microbatch_size,
                memory_limit_bytes=2**30, stages=stages, hf_config=hf,
                predicted=Prediction(step_time_s=0.1, peak_memory_bytes=(1000,) * layout.pp, bubble_fraction=0.0))


def test_a_llama_plan_with_cp_passes_the_checks(plan: Plan) -> None:
    check_context_plan(plan)
    check_context_model(load_model(TINY_LLAMA, plan.hf_config).build(0), plan)


@pytest.mark.parametrize("change, message", [
    (lambda p: replace(p, model_path="model.py", hf_config={}),
     "plan field 'cp' is 2: autopp run runs context parallelism for HF causal LMs given by --hf-config (llama, qwen2, "
     "qwen3), not the model file model.py; export the plan to torchtitan or megatron, or re-plan with `--cp 1`"),
    (lambda p: replace(p, hf_config={"seq_len": SEQ, "task": "seq-cls"}), "given by --hf-config (llama, qwen2, qwen3), "
     "not task seq-cls;"),
    (lambda p: replace(p, layout=Layout(pp=2, cp=2, tp=2)), "with tp 1, ep 1 and no vocabulary parallelism (plan has "
     "tp 2, ep 1, vocab off)"),
    (lambda p: replace(p, schedule=ScheduleName.SEQ_1F1B), "under schedules that run each microbatch whole, not "
     "Seq1F1B"),
    (lambda p: replace(p, hf_config={"seq_len": 6, "task": "causal-lm"}), "context parallelism needs seq % (2*cp) == "
     "0 (seq 6, cp 2, causal load balancing)"),
])
def test_what_the_runner_does_not_run_under_cp_is_refused_in_one_line(plan: Plan, change: Any, message: str) -> None:
    with pytest.raises(RunError, match=re.escape(message)) as caught:
        check_context_plan(change(plan))
    assert "\n" not in str(caught.value)


def test_a_model_without_one_rotary_embedding_of_a_listed_family_is_refused(plan: Plan) -> None:
    with pytest.raises(RunError, match=re.escape("for llama, qwen2, qwen3 causal LMs with autopp_causal attention, not "
                                                 "model_type Linear with None attention")):
        check_context_model(nn.Linear(2, 2), plan)
    model = load_model(TINY_LLAMA, plan.hf_config).build(0)
    model.model.layers[0].add_module("rotary_emb", copy.deepcopy(model.model.rotary_emb))
    with pytest.raises(RunError, match="through one rotary embedding module, and llama has 2"):
        check_context_model(model, plan)


def test_the_rotary_tables_are_those_of_the_ranks_own_positions(plan: Plan) -> None:
    # cp rank 1 of 2 at 16 tokens holds chunks 1 and 2 of 4: positions 4..7 and 8..11, whatever positions it is given.
    model = load_model(TINY_LLAMA, plan.hf_config).build(0)
    (name,) = rotary_modules(model)
    rotary = model.get_submodule(name)
    mine = torch.cat([torch.arange(4, 8), torch.arange(8, 12)])
    x = torch.randn(2, 8, 64)
    expected = rotary(x, mine.expand(2, -1))
    own_positions(model, mine)
    for got in (rotary(x, torch.arange(8).expand(2, -1)), rotary(x, position_ids=torch.arange(8)[None])):
        assert all(torch.equal(g.expand_as(e), e) for g, e in zip(got, expected))
    assert POSITIONS not in model.state_dict() and torch.equal(getattr(rotary, POSITIONS), mine[None])


def _check(report: RunReport) -> None:
    assert report.passed and report.complete, report.error
    assert report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)


@pytest.mark.integration
def test_two_stages_with_cp_2_on_four_ranks_match_one_process() -> None:
    # pp 2 x cp 2 under 1F1B: the rotary tables (buffers only) are held by each stage that reads them, for its own
    # cp rank's positions; stage 1's cp ranks ring among themselves while the pipeline sends between cp peers.
    plan = llama_plan(Layout(pp=2, cp=2), ["model.layers.2"], num_microbatches=2)
    report = run_plan(plan, RunOptions(steps=2, timeout_s=300))
    _check(report)
    assert {d.stage for d in report.grad_diffs} == {0, 1}


@pytest.mark.integration
def test_a_v_schedule_with_split_backward_and_cp_2_on_four_ranks_matches_one_process() -> None:
    # ZBVZeroBubble, pp 2 x v 2 x cp 2: two stages per rank, torch's I/W split backward through the ring's Function.
    plan = llama_plan(Layout(pp=2, v=2, cp=2), ["model.layers.1", "model.layers.2", "model.layers.3"],
                      schedule="ZBVZeroBubble", num_microbatches=4, microbatch_size=1)
    _check(run_plan(plan, RunOptions(steps=2, timeout_s=300)))


def _family(tmp_path: Path, family: str) -> Path:
    """The tiny Llama's sizes as another listed family: Qwen2 (q/k/v biases) or Qwen3 (q/k norms), the same one
    rotary embedding module."""
    config = tmp_path / f"tiny-{family}.json"
    config.write_text(json.dumps({**json.loads(TINY_LLAMA.read_text()), "model_type": family, "architectures": None}))
    return config


@pytest.mark.integration
def test_dp_2_by_cp_2_averages_gradients_over_the_four_sync_ranks(tmp_path: Path) -> None:
    # Each replica's half of the batch, each cp rank's half of every sequence: gradients averaged over dp x cp = 4.
    # The model is the tiny Llama as Qwen2: this run is also that family's with cp 2.
    plan = llama_plan(Layout(pp=1, dp=2, cp=2), [], schedule="GPipe", num_microbatches=2, microbatch_size=1,
                      config=_family(tmp_path, "qwen2"))
    _check(run_plan(plan, RunOptions(steps=2, timeout_s=300)))


@pytest.mark.integration
def test_a_plan_made_with_cp_2_and_zero_1_by_the_cli_runs_validated_on_two_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # profile -> plan --cp 2 --zero 1 -> run, as a user does: the plan is pp 1 x cp 2 on 2 devices (one stage), its
    # loss and every gradient match one process. ZeRO 1 without dp: FSDP2 shards the optimizer state over the cp
    # ranks, which are the synchronisation group. The model is the tiny Llama as Qwen3: this run is also that
    # family's with cp 2. (Without ZeRO, cp runs in the pp x cp and dp x cp tests above.)
    from autopp.cli import main

    monkeypatch.chdir(tmp_path)
    config = str(_family(tmp_path, "qwen3"))
    quick = ["--microbatch-sizes", "1,2", "--repeats", "1", "--warmup", "0"]
    assert main(["profile", "--hf-config", config, "--seq-len", str(SEQ), *quick]) == 0
    assert main(["plan", "--hf-config", config, "--seq-len", str(SEQ), "--devices", "2", "--cp", "2",
                 "--pp", "1", "--schedule", "GPipe", "--zero", "1", "--recompute", "none", "--memory", "1GiB",
                 "--global-batch", "4", "-o", "plan.json"]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert (plan["pp"], plan["cp"], plan["dp"], plan["zero"]) == (1, 2, 1, 1)
    assert plan["hf_config"]["model_type"] == "qwen3"
    capsys.readouterr()
    assert main(["run", "plan.json", "--steps", "2", "--run-dir", "ranks"]) == 0
    lines = [line for f in sorted((tmp_path / "ranks").glob("rank*.out")) for line in f.read_text().splitlines()]
    assert sum("ZeRO 1 over 2 ranks" in line for line in lines) == 2
    report = json.loads((tmp_path / "plan.report.json").read_text())
    assert report["passed"] is True and report["complete"] is True and report["cp"] == 2
    assert report["grad_max_rel_diff"] <= GRAD_RTOL
    assert report["losses"] == pytest.approx(report["reference_losses"], rel=1e-5)
