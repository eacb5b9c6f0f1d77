"""Stand-in rank entries for the launcher's tests of forked ranks (autopp.run.launch.fork_rank): importable by the
rank server, which has the test session's sys.path."""

from __future__ import annotations

import sys


def run_code(argv: list[str]) -> int:
    """Run `argv[0]` as `python -c CODE ARGS...` would: `sys.argv` is ["-c", *ARGS]; its exit code, 0 if it ends."""
    sys.argv = ["-c", *argv[1:]]
    try:
        exec(compile(argv[0], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0
