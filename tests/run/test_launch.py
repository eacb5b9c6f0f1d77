"""Tests of the launcher with stand-in ranks (plain `python -c`, or the same code in a rank forked from the rank
server: tests/run/standins.py), so no rank pays torch's start-up."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopp.errors import RunError
from autopp.run.launch import (RankProcess, fork_rank, free_port, kill_ranks, rank_failure, split_line, tail,
                               wait_ranks, worker_env)

from .conftest import processes_mentioning

#: Each launcher test runs its ranks both ways: a new interpreter (`python -c`) and forked from the rank server.
WAYS = pytest.mark.parametrize("fork", [False, True], ids=["interpreter", "forked"])


def _fake_rank(rank: int, run_dir: Path, code: str, fork: bool = False) -> RankProcess:
    """A rank running `code` with the run dir as its argument (on its command line when not forked, so /proc can
    find it; a forked rank's is the rank server's: `_left` finds it by its pid)."""
    if fork:
        return fork_rank(rank, "tests.run.standins:run_code", [code, str(run_dir)], dict(os.environ), run_dir)
    with (run_dir / f"rank{rank}.out").open("wb") as out, (run_dir / f"rank{rank}.err").open("wb") as err:
        popen = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=out, stderr=err,
                                 start_new_session=True)
    return RankProcess(rank, popen, run_dir)


def _alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _left(procs: list[RankProcess], run_dir: Path) -> list[int]:
    """Live processes of these ranks: the ranks themselves and whatever mentions the run dir (their children)."""
    return sorted({p.popen.pid for p in procs if _alive(p.popen.pid)} | set(processes_mentioning(str(run_dir))))


SLEEPER = "import time; print('waiting', flush=True); time.sleep(60)"


@WAYS
@pytest.mark.integration
def test_all_ranks_succeed_and_progress_is_forwarded(fork: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Issue 13, point 15: one line per rank per step (79 lines for 40 steps of the demo) was noise. Progress gets one
    # line per step; every rank's own lines are logged at INFO (`autopp run --verbose`), "[rank R] " prefix or not.
    lines = ["[rank {r}] stages [{r}] built", "[rank {r}] step 1/2 0.25 s", "step 2/2 0.5 s"]
    procs = [_fake_rank(r, tmp_path, "; ".join(f"print({line.format(r=r)!r})" for line in lines), fork)
             for r in range(2)]
    seen: list[str] = []
    with caplog.at_level(logging.INFO, logger="autopp.run.launch"):
        # The wall time it returns is not bounded (the machine may be loaded): the ranks ended well, not by timeout.
        assert wait_ranks(procs, timeout_s=60, progress=seen.append) > 0
    assert all(p.popen.returncode == 0 for p in procs)
    told = [re.sub(r" on rank [01] ", " on rank R ", line) for line in seen]  # whichever rank told it first
    assert told == [f"step {n}/2 {t} ms on rank R (the report takes each step's slowest rank)"
                    for n, t in ((1, "250"), (2, "500"))]
    logged = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("rank "))
    assert logged == sorted(f"rank {r}: {line.format(r=r).removeprefix(f'[rank {r}] ')}"
                            for r in range(2) for line in lines)


def test_split_line_reads_the_rank_prefix() -> None:
    assert split_line("[rank 3] step 1/2 0.1 s", 0) == (3, "step 1/2 0.1 s")
    assert split_line("plain", 5) == (5, "plain") and split_line("", 1) == (1, "")


@WAYS
@pytest.mark.integration
def test_recorded_exception_is_reported_and_peer_is_killed(fork: bool, tmp_path: Path) -> None:
    fail = ("import sys, pathlib; pathlib.Path(sys.argv[1], 'rank1.error').write_text('ValueError: boom (at m.py:3)');"
            "sys.exit(1)")
    procs = [_fake_rank(0, tmp_path, SLEEPER, fork), _fake_rank(1, tmp_path, fail, fork)]
    with pytest.raises(RunError, match=r"^rank 1 failed: ValueError: boom \(at m.py:3\)$"):
        wait_ranks(procs, timeout_s=30)
    # Not by wall clock (the machine may be loaded): the message is not the timeout's, and the sleeping peer was
    # killed rather than left to finish.
    assert procs[0].popen.returncode == -signal.SIGKILL
    assert all(p.popen.returncode is not None for p in procs)
    assert _left(procs, tmp_path) == []


@WAYS
@pytest.mark.integration
def test_crash_without_record_quotes_stderr(fork: bool, tmp_path: Path) -> None:
    crash = "import sys; sys.stderr.write('first\\nSegmentation-ish fault\\n'); sys.exit(3)"
    with pytest.raises(RunError, match=r"rank 0 exited with code 3; last lines of its stderr:\nfirst\nSegmentation"):
        wait_ranks([_fake_rank(0, tmp_path, crash, fork), _fake_rank(1, tmp_path, SLEEPER, fork)], timeout_s=30)


@WAYS
@pytest.mark.integration
def test_abrupt_death_beats_a_peer_that_recorded_losing_it(fork: bool, tmp_path: Path) -> None:
    peer = "import sys, pathlib; pathlib.Path(sys.argv[1], 'rank0.error').write_text('RuntimeError: peer reset')"
    die = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    procs = [_fake_rank(0, tmp_path, peer + "; sys.exit(1)", fork), _fake_rank(1, tmp_path, die, fork)]
    for p in procs:
        p.popen.wait()
    with pytest.raises(RunError, match=r"^rank 1 died from signal SIGKILL \(no stderr\)\n\(also rank 0 failed"):
        wait_ranks(procs, timeout_s=30)


def _wait_for_output(path: Path, text: str, limit_s: float = 120.0) -> None:
    """Until `path` holds `text` (a generous limit: Python start-up alone may take seconds on a loaded machine)."""
    deadline = time.monotonic() + limit_s
    while text not in (path.read_text() if path.is_file() else "") and time.monotonic() < deadline:
        time.sleep(0.05)


@WAYS
@pytest.mark.integration
def test_timeout_kills_everything(fork: bool, tmp_path: Path) -> None:
    procs = [_fake_rank(r, tmp_path, SLEEPER, fork) for r in range(2)]
    # The 1 s clock must start after rank 0 has said "waiting": under two CPU-bound processes, Python's start-up took
    # over 1 s and the message said "(no progress printed)".
    _wait_for_output(tmp_path / "rank0.out", "waiting")
    with pytest.raises(RunError, match=r"ranks \[0, 1\] had not finished after 1 s .*\nrank 0 last said: waiting"):
        wait_ranks(procs, timeout_s=1)
    assert all(p.popen.returncode == -signal.SIGKILL for p in procs)  # killed, not waited for (they sleep 60 s)
    assert _left(procs, tmp_path) == []


@WAYS
@pytest.mark.integration
def test_kill_ranks_reaps_grandchildren_in_the_group(fork: bool, tmp_path: Path) -> None:
    spawner = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)',"
               " sys.argv[1]]); time.sleep(60)")
    procs = [_fake_rank(0, tmp_path, spawner, fork)]
    deadline = time.monotonic() + 120  # generous: start-up is slow on a loaded machine; the loop ends when both run
    while len(_left(procs, tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_left(procs, tmp_path)) == 2  # the rank and its child, else the test below would prove nothing
    kill_ranks(procs)
    deadline = time.monotonic() + 60  # the orphaned grandchild is reaped by init, asynchronously
    while _left(procs, tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _left(procs, tmp_path) == []


@pytest.mark.integration
@pytest.mark.parametrize("code, status, said", [("sys.exit()", 0, ""), ("sys.exit(None)", 0, ""),
                                                ("sys.exit(4)", 4, ""), ("sys.exit('no model')", 1, "no model\n")])
def test_a_forked_rank_exits_as_an_interpreter_would(tmp_path: Path, code: str, status: int, said: str) -> None:
    """sys.exit() and sys.exit(None) end a forked rank with 0, an integer with itself, a message with 1 and the
    message on stderr, as `python -c` does."""
    forked = _fake_rank(0, tmp_path, "import sys; " + code, fork=True)
    assert forked.popen.wait(120) == status
    assert (tmp_path / "rank0.err").read_text() == said


def test_helpers(tmp_path: Path) -> None:
    assert 0 < free_port() < 65536
    env = worker_env(1, 2, 12345)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("1", "2", "127.0.0.1", "12345")
    assert env["OMP_NUM_THREADS"] == "1" and env.get("PATH") == os.environ.get("PATH")
    (tmp_path / "log").write_text("a\n\nb\nc\n")
    assert tail(tmp_path / "log", 2) == "b\nc" and tail(tmp_path / "missing") == ""


@WAYS
@pytest.mark.integration
def test_rank_failure_prefers_the_record(fork: bool, tmp_path: Path) -> None:
    proc = _fake_rank(2, tmp_path, "import sys; sys.stderr.write('noise'); sys.exit(1)", fork)
    proc.popen.wait()
    assert rank_failure(proc) == "rank 2 exited with code 1; last lines of its stderr:\nnoise"
    proc.error_path.write_text("KeyError: 'x'\n")
    assert rank_failure(proc) == "rank 2 failed: KeyError: 'x'"


@WAYS
@pytest.mark.integration
def test_keyboard_interrupt_kills_every_rank(fork: bool, tmp_path: Path) -> None:
    stepper = SLEEPER.replace("'waiting'", "'step 1/2 0.1 s'")  # the progress callback is called (and interrupts)
    procs = [_fake_rank(r, tmp_path, stepper, fork) for r in range(2)]

    def interrupt(_line: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        wait_ranks(procs, timeout_s=30, progress=interrupt)
    assert all(p.popen.returncode is not None for p in procs)
    assert _left(procs, tmp_path) == []


@pytest.mark.integration
def test_sigterm_to_the_parent_kills_every_rank(tmp_path: Path) -> None:
    # The parent waits on a sleeping rank in a child python; SIGTERM to that parent must not orphan the rank.
    code = ("import sys, subprocess, pathlib\n"
            "from autopp.run.launch import RankProcess, wait_ranks\n"
            "d = pathlib.Path(sys.argv[1])\n"
            f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}, str(d)], start_new_session=True)\n"
            "(d / 'started').write_text(str(p.pid))\n"
            "wait_ranks([RankProcess(0, p, d)], timeout_s=60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    parent.terminate()
    _, err = parent.communicate(timeout=30)
    assert parent.returncode != 0 and b"stopped by signal SIGTERM" in err
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.integration
def test_a_forked_rank_runs_in_the_launchers_environment_and_directory(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank forked from the rank server (started by an earlier launch, with that moment's environment and
    directory) runs with exactly the environment and directory its launcher gives it, and what it prints reaches
    its stdout file line by line while it runs (the parent forwards progress from it), without a flush."""
    started = _fake_rank(0, tmp_path, "pass", fork=True)
    assert started.popen.wait(120) == 0  # the server runs from here on
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    code = ("import os, pathlib, sys, time; pathlib.Path(sys.argv[1], 'seen').write_text(repr((sorted(os.environ), "
            "os.getcwd()))); print('waiting'); time.sleep(60)")
    env = {"PATH": os.environ.get("PATH", ""), "AUTOPP_ONLY_HERE": "1"}
    rank = fork_rank(1, "tests.run.standins:run_code", [code, str(tmp_path)], env, tmp_path)
    try:
        _wait_for_output(tmp_path / "rank1.out", "waiting")
        assert (tmp_path / "rank1.out").read_text() == "waiting\n" and rank.popen.poll() is None
        assert (tmp_path / "seen").read_text() == repr((["AUTOPP_ONLY_HERE", "PATH"], str(tmp_path / "here")))
    finally:
        kill_ranks([rank])
    assert rank.popen.returncode == -signal.SIGKILL and _left([rank], tmp_path) == []
