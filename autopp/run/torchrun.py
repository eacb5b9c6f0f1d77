"""Run a plan through torchrun, on one machine or many: the exact command for each node, and starting it here."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from ..data.plan import Plan
from ..errors import RunError
from .launch import RankProcess
from .options import Nodes, RunOptions

__all__ = ["plan_nnodes", "check_node_share", "torchrun_command", "format_commands", "launch_torchrun", "worker_errors",
           "TERM_GRACE_S"]

#: Seconds torchrun gets after SIGTERM to stop its workers before everything is SIGKILLed.
TERM_GRACE_S = 10.0


def plan_nnodes(plan: Plan, nnodes: int | None) -> tuple[int, str, bool]:
    """The nodes torchrun starts for `plan`, why, and whether that is not the plan's own count: `nnodes` when given,
    else the plan's own (`Plan.nodes`, the cluster it was planned for; one node when it records none). A given count
    that is not the plan's runs (the ranks compute the same), said so: the prediction assumed the plan's nodes."""
    if plan.nodes is None:
        n = nnodes or 1
        return n, f"{n}: " + ("given" if nnodes else "the plan records no nodes (give --nnodes to use several)"), False
    own, per_node = plan.nodes
    if nnodes is None or nnodes == own:
        return own, f"{own} of {per_node} ranks each: the plan's cluster", False
    return nnodes, (f"{nnodes}: given, but the plan is for {own} nodes x {per_node} devices, whose links its "
                    f"prediction assumed (without --nnodes: {own})"), True


def check_node_share(num_ranks: int, nodes: Nodes | None) -> None:
    """A RunError unless the nodes share the plan's ranks evenly (checked before anything starts or is written)."""
    if nodes is not None and num_ranks % nodes.nnodes:
        divisors = [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]
        raise RunError(f"plan needs {num_ranks} ranks, which {nodes.nnodes} nodes cannot share evenly: give "
                       f"--nnodes {' or '.join(map(str, divisors))}")


def torchrun_command(plan_path: str | Path, options: RunOptions, *, num_ranks: int, run_dir: str | Path,
                     python: str = sys.executable) -> list[str]:
    """The torchrun command that node `options.nodes.node_rank` (no nodes: one node) runs: `num_ranks / nnodes`
    workers per node, global rank = node_rank * per_node + local rank (torchrun's numbering), so nodes hold whole
    replicas when pp divides per_node."""
    nodes = options.nodes or Nodes()
    check_node_share(num_ranks, nodes)
    return [python, "-m", "torch.distributed.run", f"--nnodes={nodes.nnodes}", f"--node-rank={nodes.node_rank}",
            f"--nproc-per-node={num_ranks // nodes.nnodes}", f"--master-addr={nodes.master_addr}",
            f"--master-port={nodes.master_port}", "--max-restarts=0", "-m", "autopp.run.worker",
            "--plan", str(plan_path), "--run-dir", str(run_dir), *options.worker_args()]


def format_commands(plan_path: str | Path, options: RunOptions, *, num_ranks: int, run_dir: str | Path) -> str:
    """One shell line per node of `options.nodes`, for the user to run on each machine."""
    nodes = options.nodes or Nodes()
    lines = []
    for node in range(nodes.nnodes):
        cmd = torchrun_command(plan_path, replace(options, nodes=replace(nodes, node_rank=node)),
                               num_ranks=num_ranks, run_dir=run_dir)
        lines.append(f"# node {node}\n{shlex.join(cmd)}")
    return "\n".join(lines)


def launch_torchrun(cmd: Sequence[str], run_dir: Path) -> RankProcess:
    """Start torchrun in its own session; its output goes to run_dir/rank0.out/.err (this node's torchrun)."""
    with (run_dir / "rank0.out").open("wb") as out, (run_dir / "rank0.err").open("wb") as err:
        popen = subprocess.Popen(list(cmd), stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
    return RankProcess(0, popen, run_dir, graceful_s=TERM_GRACE_S)


_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)")


def worker_errors(run_dir: Path) -> str | None:
    """Why this node's torchrun failed, choosing the root cause as launch.py does: a worker killed by a signal
    (torchrun's failure list) failed on its own, since peers that lose it raise and record that; otherwise the
    earliest exception a worker recorded (rank{r}.error)."""
    torchrun_err = run_dir / "rank0.err"
    text = torchrun_err.read_text(errors="replace") if torchrun_err.is_file() else ""
    for rank, code in sorted({(int(r), int(c)) for r, c in _FAILURE.findall(text)}):
        if code < 0 and not (run_dir / f"rank{rank}.error").is_file():
            return f"rank {rank} died from signal {signal.Signals(-code).name} (reported by torchrun)"
    files = sorted(run_dir.glob("rank*.error"), key=lambda f: f.stat().st_mtime_ns)
    for f in files:
        recorded = f.read_text(errors="replace").strip()
        if recorded:
            return f"{f.stem} failed: {recorded}".replace("rank", "rank ", 1)
    return None
