"""Paths stored relative to the file that holds them, and resolved back (issue 13, point 10)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autopp.relpaths import resolved_path, stored_path


@pytest.mark.parametrize("model, directory, stored", [
    ("/repo/examples/gpt.py", "/repo/profiles/gpt", "../../examples/gpt.py"),
    ("/repo/examples/gpt.py", "/repo", "examples/gpt.py"),
    ("/elsewhere/m.py", "/repo/plans", "/elsewhere/m.py"),  # nothing in common but the root: absolute
])
def test_stored_relative_and_resolved_back(model: str, directory: str, stored: str) -> None:
    assert stored_path(model, directory) == stored
    assert resolved_path(stored, directory) == model
    assert resolved_path(stored, directory.replace("/repo", "/clone")) == model.replace("/repo", "/clone")


def test_relative_input_is_taken_from_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert stored_path("m.py", tmp_path / "plans") == "../m.py"
    assert resolved_path("../m.py", tmp_path / "plans") == os.path.join(str(tmp_path), "m.py")


def test_absolute_stored_paths_are_kept() -> None:
    assert resolved_path("/old/checkout/examples/mlp.py", "/repo/profiles/mlp") == "/old/checkout/examples/mlp.py"


def test_a_symlinked_checkout_stores_a_path_inside_it(tmp_path: Path) -> None:
    # Review of issue 13.10: the model path was resolve()d (symlinks followed) and the profile directory only
    # abspath'ed, so through a symlinked checkout the stored path climbed out to the real one
    # ("../../../real/examples/m.py"), and a copy of the checkout ran the original's model file.
    real = tmp_path / "real"
    (real / "examples").mkdir(parents=True)
    (real / "profiles" / "m").mkdir(parents=True)
    (real / "examples" / "m.py").write_text("")
    (tmp_path / "link").symlink_to(real)
    model = (tmp_path / "link" / "examples" / "m.py").resolve()  # as preflight gives it
    stored = stored_path(model, tmp_path / "link" / "profiles" / "m")
    assert stored == "../../examples/m.py"
    assert resolved_path(stored, tmp_path / "link" / "profiles" / "m") == str(real / "examples" / "m.py")
    assert stored_path(tmp_path / "link" / "examples" / "m.py", real / "profiles" / "m") == stored
