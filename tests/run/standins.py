"""Stand-in rank entries for the launcher's tests of forked ranks (autopp.run.launch.fork_rank): importable by the
rank server, which has the test session's sys.path."""

from __future__ import annotations

import os
import sys
from typing import Any

from autopp.run.launch import exit_code


def run_code(argv: list[str]) -> int:
    """Run `argv[0]` as `python -c CODE ARGS...` would: `sys.argv` is ["-c", *ARGS]; its exit code, 0 if it ends."""
    sys.argv = ["-c", *argv[1:]]
    try:
        exec(compile(argv[0], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        return exit_code(exc)
    return 0


def report_env(rank: int, ranks: int, port: int, name: str, queue: Any) -> None:
    """A `spawn_local` target: the value of environment variable `name` this rank sees."""
    queue.put((rank, os.environ.get(name), None))
