"""Atomic JSON writes: a failure (or a kill) at any point leaves the old file or the whole new one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autopp.jsonio import write_json


def test_failed_rename_keeps_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13, point 12 asked whether this writer shares Profile.save's flaw (old removed before the new one is in
    place): it does not; the one rename replaces the file, and until it runs the old file is untouched."""
    target = write_json(tmp_path / "p.json", {"v": 1})
    seen = []

    def failing(src: str, dst: str) -> None:
        seen.append(json.loads(Path(dst).read_text()))  # the moment of the rename: the old file is still whole
        raise OSError("injected")

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="injected"):
        write_json(target, {"v": 2})
    monkeypatch.undo()
    assert seen == [{"v": 1}] and json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]
    assert json.loads(write_json(target, {"v": 2}).read_text()) == {"v": 2}
