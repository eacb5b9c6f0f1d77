"""Run a plan through torchrun, on one machine or many: the exact command for each node, and starting it here."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import RunError
from .launch import RankProcess

__all__ = ["Nodes", "torchrun_command", "format_commands", "launch_torchrun", "TERM_GRACE_S"]

#: Seconds torchrun gets after SIGTERM to stop its workers before everything is SIGKILLed.
TERM_GRACE_S = 10.0


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """Where this node sits in a multi-machine run (torchrun's static rendezvous)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    """Address of node 0, reachable from every node."""
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise RunError(f"node rank {self.node_rank} is not in 0..{self.nnodes - 1}")


def torchrun_command(plan_path: str | Path, nnodes: int, node_rank: int = 0, master_addr: str = "127.0.0.1",
                     master_port: int = 29500, *, num_ranks: int, run_dir: str | Path, steps: int = 3,
                     lr: float = 0.01, backend: str = "gloo", timeout_s: float = 300.0,
                     python: str = sys.executable) -> list[str]:
    """The torchrun command node `node_rank` runs: `num_ranks / nnodes` workers per node, global rank =
    node_rank * per_node + local rank (torchrun's numbering), so nodes hold whole replicas when pp divides per_node.
    """
    Nodes(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port)
    if num_ranks % nnodes:
        raise RunError(f"plan needs {num_ranks} ranks, which {nnodes} nodes cannot share evenly")
    return [python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={num_ranks // nnodes}", f"--master-addr={master_addr}", f"--master-port={master_port}",
            "--max-restarts=0", "-m", "autopp.run.worker", "--plan", str(plan_path), "--run-dir", str(run_dir),
            "--steps", str(steps), "--lr", repr(lr), "--backend", backend, "--timeout-s", repr(timeout_s)]


def format_commands(plan_path: str | Path, nodes: Nodes, *, num_ranks: int, run_dir: str | Path,
                    **kwargs: object) -> str:
    """One shell line per node, for the user to run on each machine."""
    lines = []
    for node in range(nodes.nnodes):
        cmd = torchrun_command(plan_path, nodes.nnodes, node, nodes.master_addr, nodes.master_port,
                               num_ranks=num_ranks, run_dir=run_dir, **kwargs)  # type: ignore[arg-type]
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
