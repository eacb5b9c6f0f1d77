"""Write JSON and text files atomically: a reader sees the old file or the whole new one, never half of it."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import AutoppError

__all__ = ["read_json", "write_json", "write_text", "shared_mode"]


def read_json(path: str | Path, what: str, error: type[AutoppError] = AutoppError, advice: str = "") -> Any:
    """The JSON in `path`; an `error` naming the file (and the line of a syntax error), `what` it should be and, for
    a file that is there but broken, `advice` on what to do."""
    p = Path(path)
    then = f": {advice}" if advice else ""
    if p.is_dir():
        raise error(f"{p}: is a directory; give a {what}")
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise error(f"{p}: no such {what}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{p}:{exc.lineno}: not valid JSON ({exc.msg}){then}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{p}: cannot read {what}: {getattr(exc, 'strerror', None) or exc}{then}") from None


def shared_mode(path: Path, directory: bool = False) -> None:
    """Give `path` the permissions a plain open() would (0666 or 0777 less the umask); mkstemp/mkdtemp use 0600/0700."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)


def write_text(path: str | Path, text: str, what: str = "the file") -> Path:
    """Write `text` to `path` through a temporary sibling renamed into place (a reader never sees half a file)."""
    target = Path(path)
    if target.is_dir():
        raise AutoppError(f"{target}: is a directory; give a file path to write {what} to")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        shared_mode(Path(tmp))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_json(path: str | Path, data: Any) -> Path:
    """Write `data` as indented JSON to `path` atomically (`write_text`)."""
    return write_text(path, json.dumps(data, indent=2) + "\n", "the JSON")
