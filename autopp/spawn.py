"""Start a few local worker processes (one per rank, forked from a server that has imported torch) and gather one
result from each (torch-free: the server imports torch, this module does not)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from typing import Any

from .errors import AutoppError

__all__ = ["free_port", "spawn_local", "rank_context", "RANK_PRELOAD", "PACKAGE_ENV", "package_problem", "package_dir"]

#: What the rank server imports once (torch, torch.distributed's pipelining, DTensor and FSDP2, autopp's runner):
#: about 3 s of a core that each rank started as a fresh interpreter paid again (8 ranks on 2 cores: ~12 s of wall
#: time before the first step).
RANK_PRELOAD = ("autopp.run.worker",)


def rank_context() -> Any:
    """multiprocessing's forkserver context, its server preloading `RANK_PRELOAD`: each rank is forked from that
    server, which imported torch but ran nothing (no OpenMP pool, no CUDA context, no process group), so the child
    starts clean and at once. One server per process, started by the first rank and kept until the process exits
    (Python's `multiprocessing.forkserver`); a rank's environment is the server's unless the rank sets its own
    (autopp.run.launch does)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    return ctx


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_local(target: Any, ranks: int, args: tuple[Any, ...], timeout_s: float, what: str,
                fork: bool = True) -> dict[int, Any]:
    """Start `ranks` processes running `target(rank, ranks, port, *args, queue)` in the caller's environment as it
    is now, each of which puts (rank, result, error or None) on the queue, and return {rank: result}; raise
    AutoppError naming `what` if one fails, dies or the whole takes over `timeout_s`. Every process is joined or
    killed before returning. `fork`: forked from the rank server (`rank_context`), else new interpreters
    (multiprocessing's spawn), as `autopp run` starts CUDA ranks (docs/launch.md)."""
    ctx = rank_context() if fork else mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_in_env, args=(env, package_dir(), target, r, ranks, port, *args, queue))
             for r in range(ranks)]
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


def package_dir() -> str:
    """Where this process imported autopp from."""
    return os.path.dirname(os.path.realpath(__file__))


#: The environment variable `autopp run`'s launcher sets to the autopp its command imported (`package_problem`).
PACKAGE_ENV = "AUTOPP_PACKAGE"


def package_problem(origin: str | None) -> str | None:
    """Why this process (a rank) must not run: it imported another autopp than its command's (`origin`; None:
    not known). A rank's path starts with its working directory, and a checkout there comes before the installed
    autopp (a tester's ranks ran a clone's autopp under /work/main's command)."""
    if origin is None or package_dir() == origin:
        return None
    return (f"this rank imported autopp from {package_dir()}, the command from {origin} (another checkout in the "
            "working directory comes first on the rank's path): run from another directory, or run that checkout's "
            "own autopp")


def _in_env(env: dict[str, str], origin: str, target: Any, *args: Any) -> None:
    """`target(*args)` with `env` as the environment (a forked rank's is the rank server's, from when it started);
    a rank that imported another autopp than the command's (`origin`, `package_problem`) puts that error on the
    queue (`args[-1]`) instead of running mixed code."""
    os.environ.clear()
    os.environ.update(env)
    if why := package_problem(origin):
        args[-1].put((args[0], None, why))
        return
    target(*args)
