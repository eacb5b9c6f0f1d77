"""Data parallelism beyond replicas in the runner (autopp.run.data_parallel): what torch's pipelining cannot run, the
synchronisation ranks' mesh, and a ZeRO 3 run on gloo ranks validated against one process."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest
from torch.distributed.device_mesh import init_device_mesh

from autopp.data.layout import Layout
from autopp.data.zero import ZERO
from autopp.errors import RunError
from autopp.run import GRAD_RTOL, RunOptions, run_plan
from autopp.run.data_parallel import check_runnable, sync_mesh

from .conftest import GPT, LINRELU, pipeline_plan


def test_zero_2_is_refused_in_one_line_before_any_rank_starts() -> None:
    plan = pipeline_plan(LINRELU, ["2"], layout=Layout(pp=2, dp=2, zero=ZERO[2]))
    with pytest.raises(RunError, match=r"^plan field 'zero' is 2: torch.distributed.pipelining keeps .* cannot run "
                                       r"under it; plan with `zero` 1 or 3$"):
        check_runnable(plan)
    with pytest.raises(RunError, match="zero' is 2"):  # the unit tier refuses to start a process: none started
        run_plan(plan, RunOptions(steps=1))
    check_runnable(replace(plan, layout=replace(plan.layout, zero=ZERO[3])))


def test_context_parallelism_of_a_model_file_is_refused_in_one_line_before_any_rank_starts() -> None:
    """Issue 27: the runner runs cp for HF Llama-family causal LMs only (autopp.run.context_run); check_runnable is
    the door both the runner and every rank go through."""
    plan = pipeline_plan(LINRELU, ["2"], layout=Layout(pp=2, cp=2))
    with pytest.raises(RunError, match=r"^plan field 'cp' is 2: autopp run runs context parallelism for HF causal LMs "
                                       r"given by --hf-config \(llama, qwen2, qwen3\), not the model file "
                                       r".*linrelu.py; .*re-plan "
                                       r"with `--cp 1`$"):
        check_runnable(plan)


def _rank_lines(run_dir: Path, text: str) -> list[str]:
    return [line for f in sorted(run_dir.glob("rank*.out")) for line in f.read_text().splitlines() if text in line]


@pytest.mark.integration
def test_gpt_pp2_dp2_zero3_matches_one_process(tmp_path: Path) -> None:
    plan = pipeline_plan(GPT, ["h.2"], layout=Layout(pp=2, dp=2, zero=ZERO[3]))
    report = run_plan(plan, RunOptions(steps=2, timeout_s=600, work_dir=tmp_path))
    assert report.passed and (report.layout.tp, report.layout.zero, report.num_ranks) == (1, ZERO[3], 4)
    assert report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL and len(report.losses) == 2
    assert len(_rank_lines(tmp_path, "ZeRO 3 over 2 ranks: fully_shard(reshard_after_forward=True)")) == 4


def test_the_sync_mesh_is_dp_or_dp_and_cp_flattened(fake_world: Callable[[int], None]) -> None:
    """The ranks that average gradients (`Layout.sync`): the mesh's dp dimension, and dp x cp as one dimension once
    context parallelism adds its own (torchtitan's `dp_shard_cp`)."""
    fake_world(8)
    layout = Layout(pp=2, dp=2, tp=2)
    mesh = init_device_mesh("cpu", layout.shape[:2] + layout.shape[3:], mesh_dim_names=layout.mesh_axes)
    assert sync_mesh(mesh, layout).mesh_dim_names == ("dp",) and sync_mesh(mesh, layout).size() == 2
    with_cp = Layout(pp=2, dp=2, cp=2)
    mesh = init_device_mesh("cpu", with_cp.shape, mesh_dim_names=with_cp.mesh_axes)
    flat = sync_mesh(mesh, with_cp)
    assert flat.ndim == 1 and flat.size() == with_cp.sync == 4


def test_the_hsdp_sync_mesh_is_replicate_by_shard(fake_world: Callable[[int], None]) -> None:
    """Issue 25 item 3: HSDP's 2-D mesh for FSDP2, the replicas outermost: rank 0's shard group is ranks 0 and 1 (of
    dp 4 = 2 x 2 at pp 1), its replica group ranks 0 and 2."""
    fake_world(4)
    layout = Layout(dp=4, zero=ZERO[3], dp_replicate=2)
    hsdp = sync_mesh(init_device_mesh("cpu", (1, 4, 1), mesh_dim_names=layout.mesh_axes), layout)
    assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard") and hsdp.mesh.tolist() == [[0, 1], [2, 3]]


@pytest.mark.integration
def test_gpt_pp1_dp4_hsdp_2_x_2_matches_one_process(tmp_path: Path) -> None:
    """Issue 25 item 3: HSDP (pp 1, ZeRO 3, dp 4 = replicate 2 x shard 2) runs as FSDP2 over a 2-D mesh on 4 gloo
    ranks and matches one process."""
    plan = pipeline_plan(GPT, [], layout=Layout(pp=1, dp=4, zero=ZERO[3], dp_replicate=2), num_microbatches=1)
    report = run_plan(plan, RunOptions(steps=2, timeout_s=900, work_dir=tmp_path))
    assert report.passed and (report.layout.dp_replicate, report.layout.zero, report.num_ranks) == (2, ZERO[3], 4)
    assert report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL and len(report.losses) == 2
    assert len(_rank_lines(tmp_path, "ZeRO 3 over 4 ranks: fully_shard(reshard_after_forward=True)")) == 4


@pytest.mark.integration
def test_gpt_pp1_dp2_zero3_the_pure_fsdp_layout_matches_one_process(tmp_path: Path) -> None:
    """Issue 25 item 3: pure FSDP (pp 1, ZeRO 3), which the planner costs as FSDP2 resharding after forward, runs on
    2 gloo ranks (one stage each, FSDP2 over both) and matches one process."""
    plan = pipeline_plan(GPT, [], layout=Layout(pp=1, dp=2, zero=ZERO[3]), num_microbatches=1)
    report = run_plan(plan, RunOptions(steps=2, timeout_s=600, work_dir=tmp_path))
    assert report.passed and (report.layout.pp, report.layout.zero, report.num_ranks) == (1, ZERO[3], 2)
    assert report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL and len(report.losses) == 2
    assert len(_rank_lines(tmp_path, "ZeRO 3 over 2 ranks: fully_shard(reshard_after_forward=True)")) == 2


def test_what_the_runner_refuses_of_a_plan_is_said_from_the_plan_alone() -> None:
    """`run_refusal`, which `autopp plan` notes: ZeRO 1 beside ep (a tester's CPU plan, refused only when run), a
    context-parallel HF model type the ranks cannot place positions for (a tester's qwen3_moe); None for what
    runs."""
    from autopp.data.runner_rules import run_refusal
    plan = pipeline_plan(LINRELU, ["2"], layout=Layout(pp=2, dp=2))
    assert run_refusal(plan) is None
    beside = replace(plan, layout=replace(plan.layout, ep=2, zero=ZERO[1]))
    assert "ZeRO 1 and 2 beside ep are planned and exported, not run" in (run_refusal(beside) or "")
    cp = replace(plan, layout=replace(plan.layout, dp=1, cp=2),
                 hf_config={"task": "causal-lm", "model_type": "qwen3_moe", "seq_len": 64})
    assert (run_refusal(cp) or "").endswith("not model_type qwen3_moe; export the plan to torchtitan or megatron, or "
                                            "re-plan with `--cp 1`")
