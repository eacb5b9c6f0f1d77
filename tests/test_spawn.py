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
