"""The torchrun command for each node, and reading the workers' recorded errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autopp.data.layout import Layout
from autopp.data.plan import Plan, Prediction, StagePlan
from autopp.errors import RunError
from autopp.run.options import Nodes, RunOptions
from autopp.run.torchrun import format_commands, plan_nnodes, torchrun_command, worker_errors
from autopp.schedule import ScheduleName


def test_command_for_node_one_of_two() -> None:
    nodes = Nodes(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600)
    cmd = torchrun_command("/plans/p.json", RunOptions(steps=5, nodes=nodes), num_ranks=4, run_dir="/tmp/r")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:9] == ["--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--master-addr=10.0.0.1",
                        "--master-port=29600", "--max-restarts=0"]
    assert cmd[9:11] == ["-m", "autopp.run.worker"]
    assert cmd[cmd.index("--plan") + 1] == "/plans/p.json" and cmd[cmd.index("--steps") + 1] == "5"


def test_ranks_must_split_evenly_over_nodes() -> None:
    with pytest.raises(RunError, match=r"plan needs 4 ranks, which 3 nodes cannot share evenly"):
        torchrun_command("p.json", RunOptions(nodes=Nodes(nnodes=3)), num_ranks=4, run_dir="r")
    with pytest.raises(RunError, match=r"node rank 2 is not in 0..1"):
        Nodes(nnodes=2, node_rank=2)


def test_one_line_per_node() -> None:
    text = format_commands("p.json", RunOptions(nodes=Nodes(nnodes=2, master_addr="h")), num_ranks=4, run_dir="r")
    assert text.count("torch.distributed.run") == 2
    assert "# node 0" in text and "--node-rank=1" in text and "--master-addr=h" in text


def test_earliest_worker_error_wins(tmp_path: Path) -> None:
    assert worker_errors(tmp_path) is None
    (tmp_path / "rank3.error").write_text("ValueError: first\n")
    (tmp_path / "rank1.error").write_text("RuntimeError: peer reset\n")
    assert worker_errors(tmp_path) == "rank 3 failed: ValueError: first"


TORCHRUN_FAILURES = """
Failures:
[1]:
  time      : 2026-12-02_11:09:07
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 21604)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 21604
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_11:09:07
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 21603)
  error_file: <N/A>
"""


def test_a_killed_worker_beats_a_peer_that_lost_it(tmp_path: Path) -> None:
    # torchrun's "root cause" is the first failure it noticed: here rank 0, which only lost its peer.
    (tmp_path / "rank0.error").write_text("RuntimeError: Connection closed by peer\n")
    (tmp_path / "rank0.err").write_text("...\n" + TORCHRUN_FAILURES)
    assert worker_errors(tmp_path) == "rank 1 died from signal SIGKILL (reported by torchrun)"
    (tmp_path / "rank1.error").write_text("ValueError: injected\n")
    assert worker_errors(tmp_path) == "rank 0 failed: RuntimeError: Connection closed by peer"


def _plan(nodes: tuple[int, int] | None) -> Plan:
    """Four ranks (pp 2 x dp 2), planned for `nodes`."""
    stages = tuple(StagePlan(index=i, rank=i, units=(i, i + 1), unit_names=(f"u{i}",),
                             split_point=None if i == 0 else f"u{i}", forward_s=0.01, backward_s=0.02,
                             memory_bytes=1000) for i in range(2))
    return Plan(model_path="m.py", fingerprint="f", schedule=ScheduleName.GPIPE, layout=Layout(pp=2, dp=2),
                num_microbatches=2, microbatch_size=1, memory_limit_bytes=2**30, stages=stages,
                predicted=Prediction(step_time_s=0.1, peak_memory_bytes=(1000,) * 2, bubble_fraction=0.0),
                nodes=nodes)


def test_torchrun_starts_the_plans_own_nodes_unless_told_otherwise() -> None:
    # The tester's plan for 2 nodes x 8 GPUs printed one node with --nproc-per-node=16 unless --nnodes 2 was given.
    assert plan_nnodes(_plan((2, 2)), None) == (2, "2 of 2 ranks each: the plan's cluster", False)
    assert plan_nnodes(_plan((2, 2)), 2) == (2, "2 of 2 ranks each: the plan's cluster", False)
    assert plan_nnodes(_plan((2, 2)), 1) == (1, "1: given, but the plan is for 2 nodes x 2 devices, whose links its "
                                                "prediction assumed (without --nnodes: 2)", True)
    assert plan_nnodes(_plan(None), None) == (1, "1: the plan records no nodes (give --nnodes to use several)", False)
    assert plan_nnodes(_plan(None), 4) == (4, "4: given", False)
