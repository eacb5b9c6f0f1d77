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
    `directory`, in '/' form. Both are taken with symlinks followed (the model file's path is: preflight resolves
    it), so through a symlinked checkout the path stays inside the checkout instead of climbing out to the real one.
    Absolute where the two share nothing but the root (a model file elsewhere on the machine), or where no relative
    path exists (another drive on Windows)."""
    absolute, base = os.path.realpath(path), os.path.realpath(directory)
    try:
        if os.path.commonpath([absolute, base]) == os.path.splitdrive(base)[0] + os.sep:
            return absolute
        return Path(os.path.relpath(absolute, base)).as_posix()
    except ValueError:
        return absolute


def resolved_path(stored: str, directory: str | Path) -> str:
    """A path read from a file in `directory`: absolute, normalized, relative ones taken from `directory` with its
    symlinks followed, as `stored_path` took it, so it inverts `stored_path`."""
    if os.path.isabs(stored):
        return stored
    return os.path.normpath(os.path.join(os.path.realpath(directory), stored))
