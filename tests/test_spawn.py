"""autopp.spawn.spawn_local: its ranks run in the caller's environment as it is when they start, forked from the rank
server (started earlier, with the environment of that moment) or as new interpreters."""

from __future__ import annotations

import pytest

from autopp.spawn import spawn_local

from .run.standins import report_env


@pytest.mark.integration
@pytest.mark.parametrize("fork", [True, False], ids=["forked", "interpreter"])
def test_ranks_see_the_environment_of_the_call(fork: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "AUTOPP_SPAWN_SEEN"
    monkeypatch.delenv(name, raising=False)
    assert spawn_local(report_env, 2, (name,), 120, "reading the environment", fork) == {0: None, 1: None}
    monkeypatch.setenv(name, "now")  # after the rank server started (forked: it has the old environment)
    assert spawn_local(report_env, 2, (name,), 120, "reading the environment", fork) == {0: "now", 1: "now"}


def test_a_rank_that_imported_another_autopp_says_so_instead_of_running() -> None:
    """A tester: a clone's ranks ran its autopp under /work/main's command (the rank server's working directory came
    first on its path); each rank now checks it imported the command's autopp."""
    import os
    import queue

    from autopp import spawn
    ran: list[tuple[object, ...]] = []
    q: queue.Queue[tuple[object, ...]] = queue.Queue()
    env = dict(os.environ)
    spawn._in_env(env, "/elsewhere/autopp", lambda *a: ran.append(a), 1, 2, 3, q)
    rank, result, error = q.get_nowait()
    assert (rank, result, ran) == (1, None, []) and isinstance(error, str)
    assert error.startswith(f"this rank imported autopp from {spawn.package_dir()}, the command from /elsewhere/autopp")
    spawn._in_env(env, spawn.package_dir(), lambda *a: ran.append(a), 1, 2, 3, q)
    assert ran == [(1, 2, 3, q)] and os.environ == env


def test_autopp_runs_ranks_are_told_which_autopp_their_command_imported() -> None:
    """The reviewer: `autopp run`'s ranks (forked, or `python -m autopp.run.worker`) had no such check; the launcher
    now names the command's autopp in each rank's environment and the worker refuses another."""
    from autopp import spawn
    from autopp.run.launch import worker_env
    assert worker_env(0, 2, 1234)[spawn.PACKAGE_ENV] == spawn.package_dir()
    assert spawn.package_problem(None) is None and spawn.package_problem(spawn.package_dir()) is None
    assert (spawn.package_problem("/elsewhere/autopp") or "").startswith(
        f"this rank imported autopp from {spawn.package_dir()}, the command from /elsewhere/autopp")
