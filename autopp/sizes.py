"""Parse and format byte sizes ("80GiB", "512MB", "1e9") and durations for tables."""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_size", "format_time"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """Bytes in `text`: a number with an optional unit (B, KB, MB, GB, TB decimal; KiB, MiB, GiB, TiB binary)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB, 512MiB, 16GB or a number of bytes")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return int(value)


def _digits(x: float) -> str:
    """`x` with 3 significant digits, never in exponent notation: 1.5, 12.3, 999, 1002."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def format_size(n: float) -> str:
    """`n` bytes in binary units with 3 significant digits (all the integer digits above 1000): 1.5 MiB, 1002 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{_digits(n / scale)} {unit}"
    return f"{int(n)} B"


def format_time(seconds: float) -> str:
    """Seconds as ms (or s above 10 s) with 3 significant digits (all the integer digits above 1000)."""
    return f"{_digits(seconds)} s" if seconds >= 10 else f"{_digits(seconds * 1e3)} ms"
