"""Output and model paths are checked before any work, and the check leaves nothing behind (issue 13.5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.errors import AutoppError, ModelFileError
from autopp.preflight import check_model_file, check_output_dir, check_output_file


def test_output_file_in_new_directories_is_fine_and_nothing_is_created(tmp_path: Path) -> None:
    assert check_output_file(tmp_path / "a" / "b" / "p.json") == tmp_path / "a" / "b" / "p.json"
    assert list(tmp_path.iterdir()) == []  # neither the directories nor the probe file remain


@pytest.mark.parametrize("where,message", [
    ("/proc/autopp-x.json", r"/proc/autopp-x\.json \(-o\): cannot create files in /proc"),
    ("{tmp}", r"is a directory; give a file path"),
    ("{tmp}/f.txt/x.json", r"f\.txt is a file, not a directory"),
])
def test_unwritable_output_files(tmp_path: Path, where: str, message: str) -> None:
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(AutoppError, match=message):
        check_output_file(where.format(tmp=tmp_path), "-o")


def test_output_dir_new_empty_or_same_kind(tmp_path: Path) -> None:
    check_output_dir(tmp_path / "new")
    (tmp_path / "prof").mkdir()
    check_output_dir(tmp_path / "prof", marker="meta.json", kind="profile")
    (tmp_path / "prof" / "meta.json").write_text("{}")
    check_output_dir(tmp_path / "prof", marker="meta.json", kind="profile")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(AutoppError, match=r"other \(-o\): exists and is not a profile directory"):
        check_output_dir(tmp_path / "other", "-o", marker="meta.json", kind="profile")
    with pytest.raises(AutoppError, match=r"keep\.txt: is a file; give a directory"):
        check_output_dir(tmp_path / "other" / "keep.txt")


def test_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=r"nope\.py: no such file"):
        check_model_file(tmp_path / "nope.py")
    with pytest.raises(ModelFileError, match=r"is a directory; give the model's Python file"):
        check_model_file(tmp_path)
    (tmp_path / "m.py").write_text("x = 1\n")
    assert check_model_file(tmp_path / "m.py") == (tmp_path / "m.py").resolve()
