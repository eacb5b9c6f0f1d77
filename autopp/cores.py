"""The cores this process may run on, and what it means when the ranks on one host outnumber them (torch-free).

A CPU rank runs one thread (autopp.run.worker sets `torch.set_num_threads(1)`, as the profiler does), so a host
runs its ranks side by side only while it has a core for each. With more ranks than cores the OS time-slices them:
compute is serialised about ranks / cores fold, which neither the profile (timed with `co_runners` beside it) nor
the simulator (one core per rank) models. On the 2-core development machine 4 ranks measured 1.6-1.9x their
prediction (issue 29; docs/splits.md). autopp does not model it: it says so, at plan time and at run time
(docs/accuracy.md, "Oversubscribed ranks").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["usable_cores", "Oversubscribed", "oversubscribed", "MESH_ON_CPU"]


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask (`os.sched_getaffinity`, which a container's cpuset or
    `taskset` narrows), else `os.cpu_count()`; at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform (macOS, Windows)
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Oversubscribed:
    """`ranks` single-threaded ranks on one host of `cores` cores, ranks > cores."""

    ranks: int
    cores: int

    @property
    def share(self) -> float:
        """Ranks per core: about how many times slower each rank computes while all of them compute."""
        return self.ranks / self.cores

    def __str__(self) -> str:
        cores = f"{self.cores} core{'s' if self.cores > 1 else ''}"
        return (f"{self.ranks} ranks share {cores}, {self.share:.1f} per core: compute is serialised, "
                "which the prediction (a core per rank) does not model")


def oversubscribed(ranks: int, cores: int) -> Oversubscribed | None:
    """`Oversubscribed` when `ranks` single-threaded ranks outnumber a host's `cores`, else None."""
    if cores < 1:
        raise ValueError(f"a host has at least 1 core, got {cores}")
    return Oversubscribed(ranks, cores) if ranks > cores else None


#: What a layout that uses the mesh (autopp.data.layout.uses_mesh) costs on gloo CPU ranks beyond its prediction
#: (docs/accuracy.md, "Sharded layouts on CPU ranks"): said in such a plan's notes and such a run's report.
MESH_ON_CPU = ("a sharded layout on gloo CPU ranks (tensor, context or expert parallelism, ZeRO's FSDP2): each sharded "
               "op dispatches through DTensor in Python and each collective through gloo, which the profile (plain "
               "tensors) and the plan's link figures leave out; measured on 2 cores: tp 2 at 6-14x its prediction, "
               "ZeRO 3 at 1.5x where plain dp ran at 0.8x (docs/accuracy.md)")
