"""Cores this process may use, and ranks that outnumber a host's cores (issue 29, item 3)."""

from __future__ import annotations

import os

import pytest

from autopp import cores
from autopp.cores import Oversubscribed, oversubscribed, usable_cores


def test_ranks_that_fit_the_cores_are_not_oversubscribed() -> None:
    assert oversubscribed(2, 2) is None and oversubscribed(1, 64) is None


def test_more_ranks_than_cores_say_how_many_share_a_core() -> None:
    over = oversubscribed(4, 2)
    assert over == Oversubscribed(4, 2) and over.share == 2.0
    assert str(over).startswith("4 ranks share 2 cores, 2.0 per core: compute is serialised")
    assert "3 ranks share 2 cores, 1.5 per core" in str(oversubscribed(3, 2))
    assert str(oversubscribed(2, 1)).startswith("2 ranks share 1 core, 2.0 per core")


def test_a_host_without_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 core, got 0"):
        oversubscribed(2, 0)


def test_usable_cores_read_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert usable_cores() == 3


def test_usable_cores_fall_back_to_the_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert cores.usable_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert cores.usable_cores() == 1
