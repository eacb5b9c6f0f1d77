"""`autopp run` options for torchrun: the printed per-node commands and a bad node rank (no processes started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.cli import main

from .conftest import LINRELU, pipeline_plan


def test_print_torchrun_prints_one_command_per_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = pipeline_plan(LINRELU, ["2"], "1F1B", pp=2, dp=2).save(tmp_path / "p.json")
    code = main(["run", str(plan), "--nnodes", "2", "--master-addr", "10.1.2.3", "--master-port", "29601",
                 "--print-torchrun"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("-m torch.distributed.run") == 2
    assert "--nproc-per-node=2" in out and "--master-addr=10.1.2.3" in out and "--node-rank=1" in out
    assert f"--plan {plan.resolve()}" in out


def test_bad_node_rank_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = pipeline_plan(LINRELU, ["2"], "1F1B").save(tmp_path / "p.json")
    assert main(["run", str(plan), "--nnodes", "2", "--node-rank", "5", "--print-torchrun"]) == 2
    assert "node rank 5 is not in 0..1" in capsys.readouterr().err
