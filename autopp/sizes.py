"""Parse and format byte sizes ("80GiB", "512MB") and durations for tables, one unit per column."""

from __future__ import annotations

import math
import re
from typing import Iterable

__all__ = ["SIZE_UNITS_HELP", "parse_size", "format_size", "format_time", "size_unit", "time_unit", "format_in",
           "size_argument"]

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMBIGUOUS = {"k": "KiB", "m": "MiB", "g": "GiB", "t": "TiB"}
"""One-letter units: GiB to free(1) and Slurm, GB to Kubernetes and the vendors; refused, naming both readings."""

SIZE_UNITS_HELP = ("a number with its unit: GiB, MiB, KiB, TiB (powers of 2) or GB, MB, KB, TB (powers of 10, as "
                   "vendors count: an 80 GB H100 has 74.5 GiB); a bare number or a one-letter unit (80G) is refused")
"""How a size is written, for --help texts."""


def parse_size(text: str) -> int:
    """Bytes in `text`: a number with a unit (B; KB, MB, GB, TB decimal; KiB, MiB, GiB, TiB binary). A bare number
    (`80`: 80 bytes, never what is meant) and one-letter units (`80G`: GiB or GB?) are refused with what to write."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB, 512MiB or 80GB")
    number, unit = match.group(1), match.group(2).lower()
    if not unit:
        raise ValueError(f"size {text!r} has no unit; write {number}GiB or {number}GB (a bare number would be "
                         f"{number} bytes)")
    if unit in _AMBIGUOUS:
        binary = _AMBIGUOUS[unit]
        decimal = binary.replace("i", "")
        raise ValueError(f"size {text!r} is ambiguous; write {number}{binary} (= {_scaled(number, binary)}) or "
                         f"{number}{decimal} (= {_scaled(number, decimal)})")
    if unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB, 512MiB or 80GB")
    value = float(number) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return int(value)


def _scaled(number: str, unit: str) -> str:
    """`number` `unit` in the other family's unit of the same letter: 80GiB -> "85.9 GB", 80GB -> "74.5 GiB"."""
    scale = _UNITS[unit.lower()]
    other = unit.replace("i", "") if "i" in unit else unit[0] + "iB"
    return f"{_digits(float(number) * scale / _UNITS[other.lower()])} {other}"


def _digits(x: float) -> str:
    """`x` with 3 significant digits, never in exponent notation: 1.5, 12.3, 999, 1002."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


_SIZES = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
_TIMES = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))


def size_unit(n: float) -> tuple[str, float]:
    """The binary unit `format_size` writes `n` bytes in, and its scale: ("GiB", 2**30) for 3 GiB."""
    return next(((u, s) for u, s in _SIZES if abs(n) >= s), _SIZES[-1])


def time_unit(seconds: Iterable[float]) -> tuple[str, float]:
    """One unit for a column of durations: s when the largest is 10 s or more, ms from 1 ms (or when all are 0),
    else us; so that a column reads 9595 ms and 11200 ms or 9.6 s and 11.2 s, never both."""
    top = max((abs(s) for s in seconds), default=0.0)
    if top >= 10:
        return _TIMES[0]
    return _TIMES[1] if top >= 1e-3 or top == 0 else _TIMES[2]


def format_in(value: float, unit: tuple[str, float]) -> str:
    """`value` in `unit` (from `size_unit` or `time_unit`) with 3 significant digits, never in exponent notation
    (below 0.01 of its column's unit, to 3 significant digits down to 0.001, `0.00567 s`, as a single figure of it
    reads `5.67 ms` elsewhere: a tester met `< 0.01 s` beside a title's 5.67 ms; below that `< 0.001 s`)."""
    name, scale = unit
    x = value / scale
    if scale == 1 and name == "B":
        return f"{int(x)} B"
    if 0 < abs(x) < 0.001:
        return f"< 0.001 {name}"
    if 0 < abs(x) < 0.01:
        return f"{x:.{2 - math.floor(math.log10(abs(x)))}f}".rstrip("0") + f" {name}"  # 0.00400 -> 0.004
    return f"{_digits(x)} {name}"


def format_size(n: float) -> str:
    """`n` bytes in binary units with 3 significant digits (all the integer digits above 1000): 1.5 MiB, 1002 MiB."""
    unit, scale = size_unit(n)
    return f"{_digits(n / scale)} {unit}" if scale > 1 else f"{int(n)} B"


def size_argument(n: float) -> str:
    """`n` bytes as a size a user can paste (`--memory`), rounded up so that it is at least `n`: 141.3GiB, or whole
    MiB below 1 GiB (33MiB)."""
    if n < 2**30:
        return f"{-(-int(n) // 2**20)}MiB"
    tenths = -(-int(n) * 10 // 2**30)  # ceil(n / 2**30 * 10) in integers
    return f"{tenths / 10:g}GiB"


def format_time(seconds: float) -> str:
    """Seconds as ms (or s above 10 s) with 3 significant digits (all the integer digits above 1000); for a single
    figure. A table column takes one unit for all its rows (`time_unit`)."""
    return format_in(seconds, time_unit([seconds]))
