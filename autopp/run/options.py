"""What a run of a plan is asked for (`RunOptions`, as PlanRequest is for planning), and where this node sits in a
multi-machine run (`Nodes`). Torch-free: the CLI builds them before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import RunError

__all__ = ["Backend", "Nodes", "RunOptions"]

Backend = Literal["gloo", "nccl"]
"""A torch.distributed backend the ranks can use."""


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


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How to run a plan (autopp.run.run_plan): the training the ranks do, where they run, what is kept."""

    steps: int = 3
    """Training steps every rank runs (each validated from shared parameters unless `validate` is False)."""
    lr: float = 0.01
    """The optimizer's learning rate on every rank."""
    optimizer: str | None = None
    """The optimizer the ranks train with ("sgd", "momentum", "adam", "adamw": autopp.measure.options); None: the
    plan's (the profile's, whose state the plan's memory counts), SGD for plans that predate the field."""
    timeout_s: float = 120.0
    """Seconds before the ranks are stopped and the run fails."""
    backend: Backend | None = None
    """torch.distributed backend; None: the plan's device kind decides, NCCL for GPUs and gloo for the CPU; for a
    plan that names none, NCCL when this node has a CUDA device per rank, else gloo (autopp.run.resolve)."""
    nodes: Nodes | None = None
    """None: every rank a process on this machine; else this node's share through torchrun (docs/launch.md)."""
    work_dir: str | Path | None = None
    """Keep the ranks' logs and results here; None: a temporary directory, removed unless a rank failed."""
    check: bool = True
    """Raise when a gradient or loss is out of tolerance (else the report says `passed` False)."""
    validate: bool = True
    """Compare every step with the single-process reference; False: measure only (no reference, for a model one
    process cannot hold; no parameters or gradients gathered): the report says `validated` false, never passed."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise RunError(f"steps must be at least 1, got {self.steps}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise RunError(f"the learning rate must be a finite number >= 0, got {self.lr}")
        if not self.timeout_s > 0:
            raise RunError(f"the timeout must be more than 0 seconds, got {self.timeout_s}")
        if self.backend not in (None, "gloo", "nccl"):
            raise RunError(f"backend must be 'gloo' or 'nccl' (or None: chosen), got {self.backend!r}")

    @property
    def launcher(self) -> str:
        """How the ranks start, as the run report says: "local" or "torchrun"."""
        return "local" if self.nodes is None else "torchrun"

    def worker_args(self) -> list[str]:
        """The flags of autopp.run.worker that these options set (each rank trains with them)."""
        return ["--steps", str(self.steps), "--lr", repr(self.lr), "--optimizer", self.optimizer or "sgd",
                "--backend", self.backend or "gloo", "--timeout-s", repr(self.timeout_s),
                *([] if self.validate else ["--no-validate"])]
