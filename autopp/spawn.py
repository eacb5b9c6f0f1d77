"""Start a few local worker processes (spawned, one per rank) and gather one result from each (torch-free)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

from .errors import AutoppError

__all__ = ["free_port", "spawn_local"]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_local(target: Any, ranks: int, args: tuple[Any, ...], timeout_s: float, what: str) -> dict[int, Any]:
    """Start `ranks` spawned processes running `target(rank, ranks, port, *args, queue)`, each of which puts
    (rank, result, error or None) on the queue, and return {rank: result}; raise AutoppError naming `what` if one
    fails, dies or the whole takes over `timeout_s`. Every process is joined or killed before returning."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, ranks, port, *args, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < ranks:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AutoppError(f"{what} on {ranks} ranks took over {timeout_s:g} s; stopped (give a longer "
                                  "--timeout if the machine is busy)")
            try:
                rank, result, error = queue.get(timeout=min(remaining, 1.0))
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise AutoppError(f"rank {procs.index(dead[0])} exited with code {dead[0].exitcode} while "
                                      f"{what}") from None
                continue
            if error:
                raise AutoppError(f"rank {rank} failed while {what}: {error}")
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results
