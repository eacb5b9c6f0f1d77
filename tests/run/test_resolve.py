"""The backend follows the plan's device kind (issue 26, point 10: `--print-torchrun` said gloo for an H100 plan),
the optimizer the plan's; both can be given."""

from __future__ import annotations


import pytest

from autopp.data.layout import Layout
from autopp.data.plan import Plan, Prediction, StagePlan
from autopp.errors import RunError
from autopp.run.options import Nodes, RunOptions
from autopp.run.resolve import plan_backend, resolve_options
from autopp.schedule import ScheduleName


def _plan(device: str | None, optimizer: str | None = None, pp: int = 2) -> Plan:
    stages = tuple(StagePlan(index=i, rank=i, units=(i, i + 1), unit_names=(f"u{i}",),
                             split_point=None if i == 0 else f"u{i}", forward_s=0.01, backward_s=0.02,
                             memory_bytes=1000) for i in range(pp))
    return Plan(model_path="m.py", fingerprint="f", schedule=ScheduleName.GPIPE, layout=Layout(pp=pp),
                num_microbatches=2, microbatch_size=1, memory_limit_bytes=2**30, stages=stages,
                predicted=Prediction(step_time_s=0.1, peak_memory_bytes=(1000,) * pp, bubble_fraction=0.0),
                device=device, optimizer=optimizer)


@pytest.mark.parametrize("device, backend, why", [
    ("h100-sxm", "nccl", "the plan is for h100-sxm (one GPU per rank)"),
    ("mi300x", "nccl", "the plan is for mi300x (one GPU per rank)"),
    ("cpu", "gloo", "the plan is for cpu (CPU ranks)"),
    (None, None, "the plan names no device kind"),
    ("tpu-v9", None, "the plan's device 'tpu-v9' is not in the device catalog"),
])
def test_the_backend_follows_the_plans_device(device: str | None, backend: str | None, why: str) -> None:
    assert plan_backend(_plan(device)) == (backend, why)


def test_a_printed_command_for_gpu_nodes_says_nccl_and_an_unknown_device_says_how_to_change_it() -> None:
    two_nodes = RunOptions(nodes=Nodes(nnodes=2))
    chosen = resolve_options(_plan("h100-sxm"), two_nodes, cuda_devices=None)
    assert chosen.options.backend == "nccl"
    assert chosen.backend_reason == "nccl: the plan is for h100-sxm (one GPU per rank)"
    unknown = resolve_options(_plan(None), two_nodes, cuda_devices=None)
    assert unknown.options.backend == "gloo"
    assert unknown.backend_reason == "gloo: the plan names no device kind (give --backend nccl for GPUs)"


def test_given_options_win_and_the_optimizer_is_the_plans() -> None:
    chosen = resolve_options(_plan("h100-sxm", "adamw"), RunOptions(backend="gloo"), cuda_devices=0)
    assert (chosen.options.backend, chosen.options.optimizer, chosen.backend_reason) == ("gloo", "adamw", "gloo: given")
    given = resolve_options(_plan("cpu", "adamw"), RunOptions(optimizer="sgd"), cuda_devices=0)
    assert given.options.optimizer == "sgd"
    assert resolve_options(_plan("cpu"), RunOptions(), cuda_devices=0).options.optimizer == "sgd"  # older plans


def test_running_here_a_gpu_plan_needs_a_cuda_device_per_rank() -> None:
    with pytest.raises(RunError, match=r"^the plan is for h100-sxm \(one GPU per rank\) but this node has 1 CUDA "
                                       r"devices for its 2 ranks: run it on those machines, or give --backend gloo "
                                       r"to run it on CPU here$"):
        resolve_options(_plan("h100-sxm"), RunOptions(), cuda_devices=1)
    assert resolve_options(_plan("h100-sxm"), RunOptions(), cuda_devices=2).options.backend == "nccl"
    assert resolve_options(_plan("cpu"), RunOptions(), cuda_devices=8).options.backend == "gloo"


def test_a_given_nccl_backend_needs_a_cuda_device_per_rank_here() -> None:
    # The tester's `autopp run PLAN --backend nccl` on a host without a GPU started the ranks, which failed with
    # "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'", and wrote a report.
    for plan in (_plan("cpu"), _plan(None), _plan("h100-sxm")):
        with pytest.raises(RunError, match=r"^--backend nccl needs a CUDA device per rank, but this node has 0 CUDA "
                                           r"devices for its 2 ranks: run it on GPU machines, or give --backend gloo "
                                           r"to run it on CPU here$"):
            resolve_options(plan, RunOptions(backend="nccl"), cuda_devices=0)
    two_nodes = RunOptions(backend="nccl", nodes=Nodes(nnodes=2))
    assert resolve_options(_plan(None, pp=4), two_nodes, cuda_devices=2).backend_reason == "nccl: given"
    with pytest.raises(RunError, match=r"has 1 CUDA devices for its 2 ranks"):
        resolve_options(_plan(None, pp=4), two_nodes, cuda_devices=1)
    printed = resolve_options(_plan("cpu"), RunOptions(backend="nccl"), cuda_devices=None)  # for other machines
    assert printed.options.backend == "nccl"


def test_a_plan_without_a_device_kind_gets_nccl_only_with_a_cuda_device_per_rank_here() -> None:
    four = _plan(None, pp=4)
    assert resolve_options(four, RunOptions(), cuda_devices=4).options.backend == "nccl"
    on_cpu = resolve_options(four, RunOptions(), cuda_devices=2)
    assert on_cpu.options.backend == "gloo"
    assert on_cpu.backend_reason == "gloo: the plan names no device kind; this node has 2 CUDA devices for 4 ranks"
    assert resolve_options(four, RunOptions(nodes=Nodes(nnodes=2)), cuda_devices=2).options.backend == "nccl"
