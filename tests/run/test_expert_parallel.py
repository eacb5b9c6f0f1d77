"""Expert parallelism in the runner (autopp.run.expert_parallel): the experts module wrapped on one rank gives the
model's own output and gradients, the layouts it does not run are refused before any rank starts, and tiny HF
Mixtral and Qwen3-MoE run pp x dp with ep = dp (Mixtral at pp 1 beside ZeRO 3, Qwen3-MoE's pp 2 x dp 2 planned by
the CLI), and Mixtral with ep < dp (pp 1 x dp 4 x ep 2 beside ZeRO 3) and ep x etp < dp (ep 2 x etp 2 x edp 2 on
8 ranks: expert tensor parallelism, issue 24's proof axis), on gloo ranks, loss and every gradient (the expert
shards gathered) validated against one process."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autopp.data.layout import Layout
from autopp.data.zero import ZERO
from autopp.errors import RunError
from autopp.model import load_model_file
from autopp.run import GRAD_RTOL, RunOptions, run_plan
from autopp.run.runner import COMBINED_RUN_NOTE
from autopp.model.experts import experts_modules
from autopp.run.expert_parallel import (_check_etp, average_expert_grads, check_expert_parallel, expert_params,
                                        parallelize_experts)

from ..conftest import MODELS
from .conftest import pipeline_plan

MIXTRAL, QWEN3 = MODELS / "hf_mixtral.py", MODELS / "hf_qwen3_moe.py"


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    pytest.importorskip("transformers")


def test_the_experts_modules_are_found_by_their_stacked_weights() -> None:
    model = load_model_file(MIXTRAL).build(0)
    found = experts_modules(model)
    assert list(found) == [f"model.layers.{i}.mlp.experts" for i in range(4)]
    assert experts_modules(torch.nn.Linear(2, 2)) == {}


@pytest.mark.parametrize("layout, why", [
    (Layout(pp=1, dp=1, cp=2, ep=2), "cp 2"),
    (Layout(pp=1, dp=1, tp=2, ep=2), "tp 2"),
    (Layout(pp=1, dp=2, ep=2, zero=ZERO[1]), "zero 1"),
    (Layout(pp=2, dp=2, ep=2, zero=ZERO[3]), "zero 3"),
])
def test_layouts_the_runner_does_not_run_expert_parallel_are_refused(layout: Layout, why: str) -> None:
    with pytest.raises(RunError, match=r"^plan field 'ep' is \d with pp \d, .*" + why + r".*: autopp runs expert "
                                       r"parallelism with ep dividing dp, cp 1, tp 1 and zero 0, or zero 3 at pp 1 "
                                       r"\(ZeRO 1 and 2 beside ep are planned and exported, not run\); re-plan"):
        check_expert_parallel(layout)
    check_expert_parallel(Layout(pp=2, dp=2, ep=2))
    check_expert_parallel(Layout(pp=2, dp=4, ep=2))
    check_expert_parallel(Layout(pp=2, dp=4))
    check_expert_parallel(Layout(pp=1, dp=4, ep=2, zero=ZERO[3]))
    check_expert_parallel(Layout(pp=2, dp=4, ep=2, etp=2))


def test_etp_beside_zero_is_refused_naming_it() -> None:
    with pytest.raises(RunError, match=r"^plan field 'ep' is 2 \(etp 2\) with pp 2, dp 4, cp 1, tp 1, zero 1: autopp runs "
                                       r"expert parallelism with ep x etp dividing dp, cp 1, tp 1 and zero 0"):
        check_expert_parallel(Layout(pp=2, dp=4, ep=2, etp=2, zero=ZERO[1]))


def test_etp_refuses_experts_whose_weights_it_cannot_split() -> None:
    """Gate/up column-wise and down row-wise need the stacked (E, 2I, H) gate_up_proj and (E, H, I) down_proj with I
    divisible by etp, neither transposed nor with biases (GPT-OSS keeps both): anything else is one line."""
    class Experts(torch.nn.Module):
        def __init__(self, inner: int, bias: bool = False) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 2 * inner, 6))
            self.down_proj = torch.nn.Parameter(torch.zeros(4, 6, inner))
            self.has_bias = bias
    _check_etp(Experts(4), 4, 2)
    for module in (Experts(3), Experts(4, bias=True)):
        with pytest.raises(RunError, match=r"^etp\(2\) shards gate_up_proj \(E, 2 x I, H\) and down_proj \(E, H, I\) "
                                           r"with I divisible by etp, and Experts holds gate_up_proj \(4, \d+, 6\), "
                                           r"down_proj \(4, 6, \d\); re-plan with `--etp 1`$"):
            _check_etp(module, 4, 2)


@pytest.mark.parametrize("path", [MIXTRAL, QWEN3])
def test_on_one_rank_the_wrapped_experts_give_the_models_output_and_gradients(path: Path,
                                                                              one_rank_group: None) -> None:
    """Dispatch, the model's own expert computation on the received rows and the combine, over a one-rank ep
    group: the same loss and gradients as the unwrapped model (the routing weights applied after the combine)."""
    mf = load_model_file(path)
    reference = mf.build(0)
    wrapped, full = copy.deepcopy(reference), copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    assert parallelize_experts(wrapped, mesh, full, torch.device("cpu")) == 4
    experts = expert_params([wrapped])
    assert len(experts) == 8 and all(isinstance(p, DTensor) for p in experts)
    inputs, target = mf.sample_batch(4, seed=1)
    for model in (reference, wrapped):
        logits = model(*inputs).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    average_expert_grads(experts, Layout(pp=1), None)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in wrapped.named_parameters()}
    for name, p in reference.named_parameters():
        assert p.grad is not None and name in grads
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.integration
@pytest.mark.parametrize("dp", [2, 4])
def test_experts_beside_fsdp_at_pp_1_match_one_process(tmp_path: Path, dp: int) -> None:
    """Mixtral at pp 1 x dp `dp` with ep 2 and ZeRO 3 (FSDP2 without a pipeline, as torchtitan and NeMo AutoModel run
    MoE models; issue 30): each rank holds 2 of the 4 experts of every layer, tokens go to their experts and back by
    all-to-all, the dense units are fully_shard-ed over the dp ranks; with dp 2 (ep = dp) the experts are not sharded
    further (FSDP2's ignored parameters), with dp 4 they are fully_shard-ed over the 2 ranks holding the same
    experts, their gradients divided by dp (without that division the check fails: `gradient of
    model.layers.2.mlp.experts.down_proj (stage 0) differs ... by 1.00e+00 relative`). The loss and every gradient
    match one process. Qwen3-MoE's experts run the same wrapping per stage in its pp 2 x dp 2 plan from the CLI
    (test_a_plan_with_ep_from_the_cli_runs_validated, 4 ranks), and Mixtral's at pp 2 as the ep groups of its pp 2 x
    ep 2 x dp 2 run (test_experts_sharded_over_part_of_dp_match_one_process, 8 ranks), both with ZeRO 0."""
    plan = pipeline_plan(MIXTRAL, [], schedule="GPipe", layout=Layout(pp=1, dp=dp, ep=2, zero=ZERO[3]))
    report = run_plan(plan, RunOptions(steps=2, timeout_s=900, work_dir=tmp_path))
    assert report.passed and report.layout.ep == 2 and report.num_ranks == dp
    assert report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL
    lines = [line for f in sorted(tmp_path.glob("rank*.out")) for line in f.read_text().splitlines()]
    assert sum("expert parallelism over 2 ranks on 4 experts modules" in line for line in lines) == dp
    assert sum("ZeRO 3 over %d ranks: fully_shard(reshard_after_forward=True)" % dp in line for line in lines) == dp
    experts = sum("ZeRO 3 of 4 experts modules over the 2 ranks holding the same experts" in line for line in lines)
    assert experts == (dp if dp > 2 else 0)


@pytest.mark.integration
def test_experts_sharded_over_part_of_dp_match_one_process(tmp_path: Path) -> None:
    """ep 2 x etp 2 x edp 2 (pp 1 x dp 8, 8 ranks): the 8 replicas' expert grid, etp fastest; each rank holds 2 of
    the 4 experts of every layer, and of each its half of gate/up's columns and of down's rows; the rows an ep rank
    receives are all-gathered over its etp pair and the partial outputs reduce-scattered back; an expert shard's
    gradient is summed over the 2 ranks holding it and divided by dp; the loss and every gradient (the shards
    gathered with DTensor's full_tensor) match one process. (With ep 2 alone on these ranks the same grid holds an
    etp of 1: one split of the dp dimension, `ep_meshes`, serves both; ep at pp 2 runs in the CLI test below.)"""
    plan = pipeline_plan(MIXTRAL, [], schedule="GPipe", layout=Layout(pp=1, dp=8, ep=2, etp=2))
    report = run_plan(plan, RunOptions(steps=2, timeout_s=900, work_dir=tmp_path))
    assert report.passed and (report.layout.ep, report.layout.etp) == (2, 2) and report.num_ranks == 8
    assert report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL
    lines = [line for f in sorted(tmp_path.glob("rank*.out")) for line in f.read_text().splitlines()]
    assert sum("expert parallelism over 2 ranks x expert tensor parallelism over 2 on 4 experts modules" in line
               for line in lines) == 8


@pytest.mark.integration
def test_a_plan_with_ep_from_the_cli_runs_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`autopp plan --ep 2` (dp follows: 2) prints a plan that `autopp run` runs validated on 4 ranks (pp 2 x dp 2,
    each stage's experts over its 2 dp ranks, 2 of the 4 experts on each rank): the loss, every gradient and the
    optimizer step match one process. Planned on Interleaved1F1B with Megatron-Core's EP A2A overlap assumed
    (`--overlap ep-a2a`) on a link slow enough (10 MB/s) for its steady-state pairs to hide some all-to-alls, 8
    microbatches pinned (the profile is measured here: under load its spreads made the step band keep 1 microbatch,
    with no steady state), which the plan records and the run's report says torch's schedule does not hide."""
    import json

    from autopp.cli import main
    monkeypatch.chdir(tmp_path)  # the default profile directory is ./profiles/MODEL
    plan, report, ranks = tmp_path / "plan.json", tmp_path / "report.json", tmp_path / "ranks"
    assert main(["plan", str(QWEN3), "--devices", "4", "--pp", "2", "--ep", "2", "--memory", "4GiB", "--bandwidth",
                 "1e7", "--global-batch", "32", "--microbatches", "8", "--schedule", "Interleaved1F1B",
                 "--virtual-stages", "2", "--tp", "1", "--zero", "0", "--recompute", "none", "--overlap", "ep-a2a",
                 "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    assert (data["pp"], data["dp"], data["ep"], data["overlap"]["ep_a2a"]) == (2, 2, 2, True)
    assert sum(s["ep_hidden_s"] for s in data["time_breakdown"]["stages"]) > 0
    assert main(["run", str(plan), "--steps", "2", "--report", str(report), "--run-dir", str(ranks)]) == 0
    got = json.loads(report.read_text())
    assert got["passed"] is True and got["num_ranks"] == 4 and got["grad_max_rel_diff"] <= GRAD_RTOL
    assert COMBINED_RUN_NOTE in got["notes"]
    lines = [line for f in sorted(ranks.glob("rank*.out")) for line in f.read_text().splitlines()]
    modules = [int(line.split(" on ")[1].split()[0]) for line in lines if "expert parallelism over 2 ranks on" in line]
    assert sum(modules) == 2 * 4  # each stage (2 per rank) on its 2 dp ranks: its share of the 4 layers
