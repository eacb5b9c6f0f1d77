"""The test tiers (tests/conftest.py): a unit test cannot start ranks; measuring fixtures put a test in integration."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest


def test_a_unit_test_cannot_start_python() -> None:
    with pytest.raises(RuntimeError, match=r"test_tiers.py::test_a_unit_test_cannot_start_python starts a process "
                                           r".*mark it @pytest.mark.integration"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(RuntimeError, match="starts a multiprocessing child"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_other_programs_still_run() -> None:
    assert subprocess.run(["true"], check=True).returncode == 0


@pytest.mark.integration
def test_an_integration_test_may_start_python() -> None:
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True,
                          check=True).stdout == "42\n"


class _Item:
    def __init__(self, *fixtures: str, nodeid: str = "tests/test_x.py::test_x") -> None:
        self.fixturenames = list(fixtures)
        self.nodeid = nodeid
        self.marks: list[str] = []

    def add_marker(self, mark: pytest.MarkDecorator) -> None:
        self.marks.append(mark.name)


def test_a_test_using_a_measuring_fixture_is_integration() -> None:
    from .conftest import pytest_collection_modifyitems
    measures, plans = _Item("tmp_path", "gpt_profile"), _Item("shipped_gpt", "tmp_path")
    pytest_collection_modifyitems([measures, plans])  # type: ignore[list-item]
    assert measures.marks == ["integration"] and plans.marks == []


def test_under_xdist_the_typing_test_goes_first_and_the_rest_keep_their_order(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """scripts/test.sh runs two xdist workers; mypy (~30 s of one core) then starts first, beside the other worker."""
    from . import conftest
    items = [_Item(nodeid=f"tests/test_{name}.py::test_it") for name in ("a", "typing", "b", "c")]
    monkeypatch.setattr(conftest, "XDIST_WORKER", None)
    kept = list(items)
    conftest.pytest_collection_modifyitems(kept)  # type: ignore[arg-type]
    assert [i.nodeid for i in kept] == [i.nodeid for i in items]
    monkeypatch.setattr(conftest, "XDIST_WORKER", "gw0")
    conftest.pytest_collection_modifyitems(kept)  # type: ignore[arg-type]
    assert [i.nodeid[11:-12] for i in kept] == ["typing", "a", "b", "c"]
