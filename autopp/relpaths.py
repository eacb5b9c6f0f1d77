"""Paths stored in autopp's files: relative to the directory of the file that holds them, absolute in memory.

A profile's `meta.json` and a plan JSON name the model file relative to their own directory, so a checkout (or a
copy of a profile or plan together with the model files beside it) works wherever it lies. On load the stored path
is joined to that directory; absolute paths (files written before this rule) are used as they are.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["stored_path", "resolved_path"]


def stored_path(path: str | Path, directory: str | Path) -> str:
    """`path` (absolute, or relative to the working directory) as written into a file in `directory`: relative to
    `directory`, in '/' form; absolute only where no relative path exists (another drive on Windows)."""
    absolute = os.path.abspath(path)
    try:
        return Path(os.path.relpath(absolute, os.path.abspath(directory))).as_posix()
    except ValueError:
        return absolute


def resolved_path(stored: str, directory: str | Path) -> str:
    """A path read from a file in `directory`: absolute, normalized, relative ones taken from `directory`.

    Lexical (no symlinks followed), so it inverts `stored_path` exactly."""
    if os.path.isabs(stored):
        return stored
    return os.path.normpath(os.path.join(os.path.abspath(directory), stored))
