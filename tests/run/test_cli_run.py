"""`autopp run`: the printed per-node torchrun commands, arguments refused before any rank starts, a real two-node
torchrun launch on this machine, and the verdict and error lines of failing runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from autopp.cli import _parser, main
from autopp.data.layout import Layout
from autopp.spawn import free_port

from .conftest import LINRELU, pipeline_plan, processes_mentioning


def test_print_torchrun_prints_one_command_per_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = pipeline_plan(LINRELU, ["2"], "1F1B", Layout(pp=2, dp=2)).save(tmp_path / "p.json")
    code = main(["run", str(plan), "--nnodes", "2", "--master-addr", "10.1.2.3", "--master-port", "29601",
                 "--print-torchrun"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("-m torch.distributed.run") == 2
    assert "--nproc-per-node=2" in out and "--master-addr=10.1.2.3" in out and "--node-rank=1" in out
    assert f"--plan {plan.resolve()}" in out


def test_print_torchrun_for_several_nodes_without_an_address_writes_a_placeholder(tmp_path: Path,
                                                                                   capsys: pytest.CaptureFixture[str]
                                                                                   ) -> None:
    """Without --master-addr, 127.0.0.1 on every node would make nodes 1 and up wait on themselves: the commands
    carry NODE0_ADDRESS, and the header says to replace it."""
    plan = pipeline_plan(LINRELU, ["2"], "1F1B", Layout(pp=2, dp=2)).save(tmp_path / "p.json")
    assert main(["run", str(plan), "--nnodes", "2", "--print-torchrun"]) == 0
    out = capsys.readouterr().out
    assert out.count("--master-addr=NODE0_ADDRESS") == 2 and "127.0.0.1" not in out
    assert "NODE0_ADDRESS: node 0's address, reachable from every node (--master-addr)" in out.splitlines()[1]


# Issue 26, point 10: `--print-torchrun --nnodes 2` printed `--backend gloo` for an H100 plan.
def test_print_torchrun_follows_the_plans_device_and_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    from dataclasses import replace
    plan = pipeline_plan(LINRELU, ["2"], "1F1B", Layout(pp=2, dp=2))
    gpus = replace(plan, device="h100-sxm", optimizer="adamw").save(tmp_path / "gpu.json")
    assert main(["run", str(gpus), "--nnodes", "2", "--print-torchrun"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "# backend nccl: the plan is for h100-sxm (one GPU per rank)"
    assert out.count("--backend nccl") == 2 and out.count("--optimizer adamw") == 2 and "gloo" not in out
    assert main(["run", str(gpus), "--nnodes", "2", "--print-torchrun", "--backend", "gloo", "--optimizer",
                 "sgd"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "# backend gloo: given" and out.count("--backend gloo --") == 2
    assert out.count("--optimizer sgd") == 2


def test_print_torchrun_defaults_to_the_plans_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import replace
    plan = replace(pipeline_plan(LINRELU, ["2"], "1F1B", Layout(pp=2, dp=2)), nodes=(2, 2)).save(tmp_path / "p.json")
    assert main(["run", str(plan), "--print-torchrun"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == "# nodes 2 of 2 ranks each: the plan's cluster; NODE0_ADDRESS: node 0's address, " \
                                  "reachable from every node (--master-addr)"
    assert out.count("--nnodes=2") == 2 and out.count("--nproc-per-node=2") == 2 and "--node-rank=1" in out
    assert main(["run", str(plan), "--print-torchrun", "--nnodes", "1"]) == 0  # as asked, noted
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("# nodes 1: given, but the plan is for 2 nodes x 2 devices")
    assert out.count("torch.distributed.run") == 1 and "--nproc-per-node=4" in out


def test_bad_node_rank_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = pipeline_plan(LINRELU, ["2"], "1F1B").save(tmp_path / "p.json")
    assert main(["run", str(plan), "--nnodes", "2", "--node-rank", "5", "--print-torchrun"]) == 2
    assert "node rank 5 is not in 0..1" in capsys.readouterr().err


def _start_node(plan: Path, node_rank: int, port: int, report: Path) -> subprocess.Popen[str]:
    """`autopp run PLAN --nnodes 2 --node-rank R` as its own process group (so a failed test can kill it all)."""
    return subprocess.Popen([sys.executable, "-m", "autopp.cli", "run", str(plan), "--nnodes", "2", "--node-rank",
                             str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port), "--steps", "2",
                             "--timeout", "240", "--report", str(report)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


# Issue 13, point 16: multi-node for real. Two `autopp run --nnodes 2` processes on this machine, one torchrun each,
# rendezvous at 127.0.0.1: node 0 validates (PASSED) and writes the report, node 1 exits 0, nothing left behind.
# dp 2 x pp 2 = 4 ranks, 2 a node: the replicas average their gradients before SGD, ranks numbered replica-first
# (what a one-node torchrun launch of the same plan in tests/run/test_runner.py checked on a launch of its own).
@pytest.mark.integration
def test_two_node_torchrun_launch_on_this_machine(tmp_path: Path) -> None:
    plan = pipeline_plan(LINRELU, ["2"], "1F1B", Layout(pp=2, dp=2), num_microbatches=2,
                         microbatch_size=2).save(tmp_path / "p.json")
    port = free_port()
    nodes = [_start_node(plan, r, port, tmp_path / f"node{r}.report.json") for r in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "verdict     PASSED" in outputs[0] and "launcher" not in outputs[0]
    assert "node 1: its ranks finished" in outputs[1]
    assert "pp 2 x dp 2" in outputs[0]
    report = json.loads((tmp_path / "node0.report.json").read_text())
    assert report["passed"] is True and report["launcher"] == "torchrun" and report["num_ranks"] == 4
    assert [(r["rank"], r["replica"], r["pp_rank"]) for r in report["ranks"]] == [(0, 0, 0), (1, 1, 0), (2, 0, 1),
                                                                                  (3, 1, 1)]
    assert report["losses"] == pytest.approx(report["reference_losses"], rel=1e-5)
    assert not (tmp_path / "node1.report.json").exists()
    assert processes_mentioning(str(plan)) == []


@pytest.mark.parametrize("timeout", ["0", "-1", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_refused_at_parse_time(
        timeout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(tmp_path / "p.json"), "--timeout", timeout])
    assert exit_info.value.code == 2
    assert f"argument --timeout: expected a positive number of seconds, got '{timeout}'" in capsys.readouterr().err


@pytest.mark.parametrize("report", ["dir", "/proc/x.json"])
def test_an_unwritable_report_path_is_refused_before_any_rank_starts(
        report: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = pipeline_plan(LINRELU, ["2"], "1F1B").save(tmp_path / "p.json")
    target = tmp_path if report == "dir" else Path(report)
    assert main(["run", str(plan), "--report", str(target), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autopp: error: {target} (--report): ") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()  # no rank was started


NAN_MODEL = '''
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def sample_batch(batch_size):
    return torch.full((batch_size, 4), float("nan")), torch.zeros(batch_size, 4)
'''


# Issue 13, point 1: all-NaN losses and gradients were reported PASSED, exit 0.
@pytest.mark.integration
def test_a_run_whose_losses_are_nan_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "nan.py"
    model.write_text(NAN_MODEL)
    plan = pipeline_plan(model, ["2"], "1F1B").save(tmp_path / "p.json")
    assert main(["run", str(plan), "--steps", "1", "--timeout", "240"]) == 1
    out, err = capsys.readouterr()
    assert "verdict     FAILED: step 1 of 1: non-finite values on both sides: the single-process reference's loss " \
           "nan at step 1, the pipelined run's loss nan at step 1" in out
    # the reason is on one stream (the verdict); stderr says which step failed
    assert err.splitlines()[-1] == "autopp: error: validation failed at step 1 of 1: the verdict above says why"
    assert "non-finite" not in err
    assert json.loads((tmp_path / "p.report.json").read_text())["passed"] is False


FORWARD_FAULT_MODEL = '''
import os

import torch
from torch import nn

SAMPLED = [0]


@torch.library.custom_op("autopp_test::fault", mutates_args=())
def fault(x: torch.Tensor) -> torch.Tensor:
    if os.environ.get("RANK") == "1" and SAMPLED[0] >= 2:
        raise RuntimeError("injected fault on rank 1 after step 1")
    return x.clone()


@fault.register_fake
def _(x):
    return torch.empty_like(x)


fault.register_autograd(lambda ctx, grad: grad)


class Fault(nn.Module):
    def forward(self, x):
        return fault(x)


def build_model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Fault(), nn.Linear(8, 4))


def sample_batch(batch_size):
    SAMPLED[0] += 1
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
'''


# Issue 13, point 4: the user saw `rank 1 failed: RuntimeError: [Stage 1] failed to run forward: (at stage.py:900)`;
# the model's own exception was in a per-rank file of a deleted temporary directory.
@pytest.mark.integration
def test_a_failing_rank_reports_the_models_own_exception_and_keeps_the_logs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "faulty.py"
    model.write_text(FORWARD_FAULT_MODEL)
    plan = pipeline_plan(model, ["2"], "1F1B").save(tmp_path / "p.json")
    assert main(["run", str(plan), "--timeout", "240"]) == 2
    lines = capsys.readouterr().err.splitlines()
    # Rank 0 may fail in the same poll (its peer's sockets closed): then an indented "(also rank 0 ...)" follows.
    error = next(i for i, line in enumerate(lines) if line.startswith("autopp: error: "))
    assert lines[error] == ("autopp: error: rank 1 failed: RuntimeError: injected fault on rank 1 after step 1 "
                            "(at faulty.py:13 in fault)")
    assert all(line.startswith("  (also rank 0 ") for line in lines[error + 1:])
    logs = Path(lines[error - 1].removeprefix("logs of the ranks kept in ").split(" (rank*.err")[0])
    try:
        assert "[Stage 1] failed to run forward" in (logs / "rank1.err").read_text()
    finally:
        shutil.rmtree(logs)


@pytest.mark.parametrize("argv, verbose", [(["run", "p.json"], False), (["run", "p.json", "--verbose"], True),
                                           (["-v", "run", "p.json"], True), (["run", "p.json", "-v"], True)])
def test_verbose_is_accepted_after_run_as_before_it(argv: list[str], verbose: bool) -> None:
    # `autopp run --verbose` logs every rank's own lines (issue 13, point 15); the top-level -v must still work.
    assert _parser().parse_args(argv).verbose is verbose
