"""Check the files a command reads and writes before its work starts, so a bad path costs no profile or plan.

Torch-free and cheap: the CLI calls these right after parsing, before importing torch. Each failure is an
AutoppError naming the path (and the flag it came from) and what to do.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import AutoppError, ModelFileError

__all__ = ["check_model_file", "check_output_file", "check_output_dir"]


def _named(path: Path, flag: str | None) -> str:
    return f"{path} ({flag})" if flag else str(path)


def check_model_file(path: str | Path) -> Path:
    """The model file's resolved path if it is a readable file; else a ModelFileError."""
    p = Path(path).resolve()
    if p.is_dir():
        raise ModelFileError(f"{p}: is a directory; give the model's Python file (the contract is in README.md)")
    if not p.is_file():
        raise ModelFileError(f"{p}: no such file; give the path of a model file (contract in README.md)")
    if not os.access(p, os.R_OK):
        raise ModelFileError(f"{p}: model file is not readable (permission denied)")
    return p


def _writable_parent(target: Path, flag: str | None) -> None:
    """Raise unless the nearest existing ancestor of `target` is a directory we can create files in."""
    parent = target.parent
    while not parent.exists():
        if parent.is_symlink():  # a dangling link: creating through it fails
            raise AutoppError(f"{_named(target, flag)}: {parent} is a broken link")
        parent = parent.parent
    if not parent.is_dir():
        raise AutoppError(f"{_named(target, flag)}: {parent} is a file, not a directory")
    try:  # os.access says yes to root on read-only or pseudo file systems (/proc): try it
        fd, probe = tempfile.mkstemp(prefix=".autopp-probe.", dir=parent)
    except OSError as exc:
        raise AutoppError(f"{_named(target, flag)}: cannot create files in {parent} ({exc.strerror}); "
                          "give a path in a writable directory") from None
    os.close(fd)
    os.unlink(probe)


def check_output_file(path: str | Path, flag: str | None = None) -> Path:
    """`path` as a Path if a file can be written there (it may exist and is then replaced)."""
    p = Path(path)
    if p.is_dir():
        raise AutoppError(f"{_named(p, flag)}: is a directory; give a file path to write to")
    if p.exists() and not os.access(p, os.W_OK):
        raise AutoppError(f"{_named(p, flag)}: exists and is not writable")
    _writable_parent(p, flag)
    return p


def check_output_dir(path: str | Path, flag: str | None = None, marker: str = "", kind: str = "output") -> Path:
    """`path` as a Path if a directory can be written there: new, empty, or one that holds `marker` (a file such as
    a profile's "meta.json": an earlier output of the same kind, which may be replaced)."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise AutoppError(f"{_named(p, flag)}: is a file; give a directory")
        if any(p.iterdir()) and not (marker and (p / marker).is_file()):
            raise AutoppError(f"{_named(p, flag)}: exists and is not a {kind} directory (it holds other files and "
                              "would be replaced); give a new directory")
    _writable_parent(p, flag)
    return p
