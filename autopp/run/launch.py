"""Start one worker process per rank on this machine, watch them, and kill them all on the first failure or timeout."""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from ..errors import RunError
from ..sizes import format_time
from ..spawn import PACKAGE_ENV, free_port, package_dir, rank_context

__all__ = ["RankProcess", "Process", "ForkedProcess", "WORKER_ENTRY", "fork_rank", "free_port", "worker_env",
           "launch_ranks", "wait_ranks", "exit_code", "kill_ranks", "tail", "rank_failure", "split_line"]

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

#: Seconds between checks of the ranks' exit status.
POLL_S = 0.05
#: Lines of a failed rank's stderr quoted in the error when it left no error file.
TAIL_LINES = 6


class Process(Protocol):
    """What the launcher reads of a rank's process: `subprocess.Popen`'s, or a forked rank's (`ForkedProcess`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ForkedProcess:
    """A rank forked from the rank server (autopp.spawn.rank_context) as `Process`: its exit code as Popen gives
    it (-N for signal N), `wait` raising subprocess.TimeoutExpired when it outlives `timeout`."""

    def __init__(self, process: Any, args: Sequence[str]) -> None:
        self._process, self._args = process, list(args)

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    @property
    def returncode(self) -> int | None:
        code = self._process.exitcode
        return None if code is None else int(code)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self._args, timeout or 0.0)
        return code


@dataclass
class RankProcess:
    """One rank's worker process and the files it writes into the run directory."""

    rank: int
    popen: Process
    run_dir: Path
    _read: int = field(default=0)
    graceful_s: float = 0.0
    """Seconds between SIGTERM and SIGKILL (torchrun needs a SIGTERM to stop the workers it started in their own
    sessions); 0: SIGKILL at once."""

    @property
    def stdout_path(self) -> Path:
        return self.run_dir / f"rank{self.rank}.out"

    @property
    def stderr_path(self) -> Path:
        return self.run_dir / f"rank{self.rank}.err"

    @property
    def error_path(self) -> Path:
        return self.run_dir / f"rank{self.rank}.error"

    def new_lines(self) -> list[str]:
        """Complete stdout lines written since the last call (the worker's progress messages)."""
        try:
            with self.stdout_path.open("rb") as f:
                f.seek(self._read)
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1
        self._read += end
        return chunk[:end].decode(errors="replace").splitlines()


def worker_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The parent's environment plus torch.distributed's rendezvous variables and one thread per rank."""
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               **{PACKAGE_ENV: package_dir()})  # the worker checks it imported this autopp (`package_problem`)
    return env


#: What a forked rank runs (`fork_rank`): the worker's `main(ARGS)`, as `python -m autopp.run.worker ARGS` does.
WORKER_ENTRY = "autopp.run.worker:main"


def launch_ranks(args: Sequence[str], world_size: int, run_dir: Path, fork: bool = False) -> list[RankProcess]:
    """Run the worker with ARGS once per rank, each in its own session (process group), its stdout and stderr in the
    run directory: with `fork`, forked from the rank server (`fork_rank`), else in a new interpreter (`python -m
    autopp.run.worker ARGS`, which imports torch again: about 3 s of a core per rank)."""
    port = free_port()
    procs: list[RankProcess] = []
    try:
        for rank in range(world_size):
            env = worker_env(rank, world_size, port)
            if fork:
                procs.append(fork_rank(rank, WORKER_ENTRY, args, env, run_dir))
                continue
            with (run_dir / f"rank{rank}.out").open("wb") as out, (run_dir / f"rank{rank}.err").open("wb") as err:
                popen = subprocess.Popen([sys.executable, "-m", "autopp.run.worker", *args], env=env, stdout=out,
                                         stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(RankProcess(rank, popen, run_dir))
    except BaseException:
        kill_ranks(procs)
        raise
    logger.info("started %d ranks (pids %s, port %d)", world_size, [p.popen.pid for p in procs], port)
    return procs


def fork_rank(rank: int, entry: str, args: Sequence[str], env: dict[str, str], run_dir: Path) -> RankProcess:
    """Rank `rank` forked from the rank server (autopp.spawn.rank_context), running `entry` ("module:function", the
    function given ARGS and returning the exit code) as `_forked_rank` sets it up."""
    out, err = run_dir / f"rank{rank}.out", run_dir / f"rank{rank}.err"
    child = rank_context().Process(target=_forked_rank, args=(entry, list(args), env, os.getcwd(), out, err),
                                   name=f"autopp rank {rank}")
    child.start()
    return RankProcess(rank, ForkedProcess(child, args), run_dir)


def _forked_rank(entry: str, args: list[str], env: dict[str, str], cwd: str, stdout: Path, stderr: Path) -> None:
    """A forked rank: in a session of its own (so that `kill_ranks` reaches whatever it starts), its stdout and
    stderr to the run directory's files (stdout line by line: the parent forwards progress), stdin from /dev/null,
    the launcher's environment and directory in place of the server's; then `entry`, and `os._exit` with its code
    (1 and the traceback on stderr if it raised), as `python -m autopp.run.worker` ends."""
    os.setsid()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code = 1
    try:
        module, function = entry.split(":")
        code = int(getattr(importlib.import_module(module), function)(args))
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:  # noqa: BLE001 - told on stderr, as an interpreter would, and the exit code says it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def exit_code(exc: SystemExit) -> int:
    """The exit status an interpreter gives `sys.exit(code)`: 0 for None, the integer, else 1 with the code printed on
    stderr (`sys.exit("message")`)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def kill_ranks(procs: Sequence[RankProcess]) -> None:
    """SIGKILL each rank's process group and reap it, so no process (or zombie) is left behind.

    A process with `graceful_s` gets SIGTERM first and that long to stop its own children.
    """
    for p in procs:
        if p.graceful_s > 0 and p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, signal.SIGTERM)
                p.popen.wait(timeout=p.graceful_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
    for p in procs:
        if p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except ProcessLookupError:  # gone, or a forked rank not yet in its own session: the process alone
                try:
                    os.kill(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for p in procs:
        p.popen.wait()


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` non-blank lines of a text file ('' when it is missing)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def rank_failure(p: RankProcess) -> str:
    """Why rank `p` failed: the exception its worker recorded, else how it died and the end of its stderr."""
    code = p.popen.returncode
    how = f"died from signal {signal.Signals(-code).name}" if code is not None and code < 0 else \
        f"exited with code {code}"
    recorded = p.error_path.read_text(errors="replace").strip() if p.error_path.is_file() else ""
    if recorded:
        return f"rank {p.rank} failed: {recorded}"
    stderr = tail(p.stderr_path)
    return f"rank {p.rank} {how}" + (f"; last lines of its stderr:\n{stderr}" if stderr else " (no stderr)")


def wait_ranks(procs: Sequence[RankProcess], timeout_s: float, progress: Progress | None = None) -> float:
    """Wait for all ranks to exit 0; return the wall time. On a failure or timeout kill them all and raise RunError.

    Whatever happens (including KeyboardInterrupt), no rank outlives this call.
    """
    start = time.monotonic()
    previous = _stop_on_sigterm()
    steps_seen: set[int] = set()
    try:
        while True:
            _forward_progress(procs, progress, steps_seen)
            failed = [p for p in procs if p.popen.poll() not in (None, 0)]
            if failed:
                raise RunError(_failure_message(failed))
            if all(p.popen.returncode == 0 for p in procs):
                return time.monotonic() - start
            elapsed = time.monotonic() - start
            if elapsed > timeout_s:
                raise RunError(_timeout_message(procs, timeout_s))
            time.sleep(POLL_S)
    finally:
        kill_ranks(procs)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _stop_on_sigterm() -> Any:
    """Turn SIGTERM into a RunError while waiting, so the ranks are killed on the way out (main thread only);
    the previous handler, or None when it could not be replaced."""
    def stop(signum: int, _frame: Any) -> None:
        raise RunError(f"stopped by signal {signal.Signals(signum).name}; killed all ranks")
    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        return None


def _root_cause(failed: list[RankProcess]) -> RankProcess:
    """Of ranks that failed in the same poll, the one whose failure caused the others' (they lost a peer).

    A rank that died without recording an exception (a signal, os._exit) failed on its own: peers that lose it
    raise, and record that. Otherwise the earliest record wins: a worker writes its error file before it exits,
    and its peers only notice when its sockets close at exit.
    """
    abrupt = [p for p in failed if not p.error_path.is_file()]
    if abrupt:
        return min(abrupt, key=lambda p: p.rank)
    return min(failed, key=lambda p: p.error_path.stat().st_mtime_ns)


def _failure_message(failed: list[RankProcess]) -> str:
    """The root cause in full, then one line for each other rank that failed in the same poll."""
    cause = _root_cause(failed)
    others = [_shortened(rank_failure(p).splitlines()[0]) for p in failed if p is not cause]
    return "\n".join([rank_failure(cause)] + [f"(also {line})" for line in others])


def _shortened(line: str, limit: int = 200) -> str:
    """`line` cut to `limit` characters, an ellipsis showing where."""
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _timeout_message(procs: Sequence[RankProcess], timeout_s: float) -> str:
    running = [p.rank for p in procs if p.popen.poll() is None]
    lines = [f"ranks {running} had not finished after {timeout_s:g} s (timeout); killed all ranks"]
    for p in procs:
        last = split_line(tail(p.stdout_path, 1), p.rank)[1] or "(no progress printed)"
        lines.append(f"rank {p.rank} last said: {last}")
    return "\n".join(lines)


#: A worker's stdout line: an optional "[rank R] " prefix (torchrun mixes a node's workers in one stream), then the
#: message; a step's end reads "step K/N T s".
_LINE = re.compile(r"^(?:\[rank (\d+)\] )?(.*)$")
_STEP = re.compile(r"^step (\d+)/(\d+) ([0-9.eE+-]+) s$")


def split_line(line: str, default_rank: int) -> tuple[int, str]:
    """(rank, message) of a worker's stdout line; `default_rank` when the line has no prefix."""
    match = _LINE.match(line)
    if match is None or match.group(1) is None:
        return default_rank, line if match is None else match.group(2)
    return int(match.group(1)), match.group(2)


def _forward_progress(procs: Sequence[RankProcess], progress: Progress | None, steps_seen: set[int]) -> None:
    """Every rank's line is logged (INFO: shown by `autopp run --verbose`); `progress` gets one line per step, when
    the first rank reports it (steps end on a barrier, so the ranks report them together)."""
    for p in procs:
        for line in p.new_lines():
            rank, text = split_line(line, p.rank)
            logger.info("rank %d: %s", rank, text)
            step = _STEP.match(text)
            if step is None or int(step.group(1)) in steps_seen:
                continue
            steps_seen.add(int(step.group(1)))
            if progress is not None:
                progress(f"step {step.group(1)}/{step.group(2)} {format_time(float(step.group(3)))} on rank {rank} "
                         "(the report takes each step's slowest rank)")
