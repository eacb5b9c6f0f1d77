"""Checks of the JSON fields of a plan file: each raises a PlanError naming the field, what it must be and what it
got (`where`: the file). Shared by the plan's parts (autopp.data.plan)."""

from __future__ import annotations

import math
from dataclasses import MISSING, fields
from typing import Any

from ..errors import PlanError

__all__ = ["require_fields", "check_int", "check_number", "check_strings", "is_count", "is_span"]


def require_fields(data: Any, cls: type, where: str) -> None:
    """A PlanError naming the first field of `cls` without a default that `data` lacks, or unknown fields."""
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise PlanError(f"{where}: missing field {missing[0]!r}")
    unknown = sorted(set(data) - names)
    if unknown:
        raise PlanError(f"{where}: unknown field {unknown[0]!r}")


def check_int(value: Any, name: str, least: int, where: str) -> None:
    """Field `name` is an integer >= `least`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise PlanError(f"{where}: field {name!r} must be an integer >= {least}, got {value!r}")


def check_number(value: Any, name: str, where: str) -> None:
    """Field `name` is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise PlanError(f"{where}: field {name!r} must be a finite number >= 0, got {value!r}")


def check_strings(value: Any, name: str, where: str, empty_ok: bool = True) -> None:
    """Field `name` is a list of strings (non-empty ones unless `empty_ok`)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) and (empty_ok or x) for x in value):
        raise PlanError(f"{where}: field {name!r} must be a list of {'' if empty_ok else 'non-empty '}strings, "
                        f"got {value!r}")


def is_count(x: Any) -> bool:
    """`x` is an integer >= 1 (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def is_span(u: Any) -> bool:
    """`u` is a [first, end] unit range with 0 <= first < end."""
    return (isinstance(u, (list, tuple)) and len(u) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in u)
            and 0 <= u[0] < u[1])
