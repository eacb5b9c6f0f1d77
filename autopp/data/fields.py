"""Checks of the fields of autopp's JSON files, one set for every reader (plan, profile metadata and its TP fields,
cluster and device files, HF configs, run reports). A failed check raises the reader's error as one line: the file
(and the part of it), the field, what it must be and what it got, then what to do (`Fields.advice`). No torch here."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, Callable, Collection, NoReturn, TypeGuard

from ..errors import AutoppError
from ..sizes import parse_size

__all__ = ["Fields", "is_int", "is_number", "is_span"]


def is_int(x: Any, least: int | None = None) -> TypeGuard[int]:
    """`x` is an integer (not a bool), >= `least` when given."""
    return isinstance(x, int) and not isinstance(x, bool) and (least is None or x >= least)


def is_number(x: Any, least: float = 0.0, positive: bool = False) -> TypeGuard[float]:
    """`x` is a finite int or float (not a bool), >= `least` (or > it when `positive`)."""
    return (isinstance(x, (int, float)) and not isinstance(x, bool) and x < math.inf
            and (x > least if positive else x >= least))  # NaN fails every comparison


def is_span(u: Any) -> bool:
    """`u` is a [first, end] unit range with 0 <= first < end."""
    return isinstance(u, (list, tuple)) and len(u) == 2 and all(is_int(x) for x in u) and 0 <= u[0] < u[1]


@dataclass(frozen=True)
class Fields:
    """The field checks of one JSON object: `where` it is (the file, then the part: "p.json: stage 0"), the `error`
    its reader raises, and the `advice` that follows every message after ": " (what to do; "" for none). Each check
    returns the value it accepted."""

    where: str
    error: type[AutoppError] = AutoppError
    advice: str = ""

    def at(self, part: str) -> Fields:
        """The checks of a part of this object (a stage, an entry of a list)."""
        return replace(self, where=f"{self.where}: {part}")

    def fail(self, message: str) -> NoReturn:
        """Raise `error` with "`where`: `message`: `advice`" (alone: not chained to an exception being handled)."""
        raise self.error(f"{self.where}: {message}" + (f": {self.advice}" if self.advice else "")) from None

    def bad(self, name: str, expected: str, value: Any) -> NoReturn:
        """Raise "field `name` must be `expected`, got `value`"."""
        self.fail(f"field {name!r} must be {expected}, got {value!r}")

    def obj(self, data: Any) -> dict[str, Any]:
        """`data` is a JSON object."""
        if not isinstance(data, dict):
            self.fail(f"expected a JSON object, got {type(data).__name__}")
        return data

    def keys(self, data: Any, known: Collection[str] | None, required: Collection[str] = (), listed: bool = False
             ) -> dict[str, Any]:
        """`data` is a JSON object with every `required` key and no other than `known` (None: any others), which
        the message about an unknown one lists when `listed`."""
        self.obj(data)
        missing = [k for k in required if k not in data]
        if missing:
            self.fail(f"missing field {missing[0]!r}")
        unknown = sorted(set(data) - set(known)) if known is not None else []
        if unknown:
            self.fail(f"unknown field {unknown[0]!r}" + (f"; expected fields {sorted(known or ())}" if listed else ""))
        return data

    def record(self, data: Any, cls: type, listed: bool = False) -> dict[str, Any]:
        """`keys` with the fields of dataclass `cls`: those without a default are required."""
        names = [f.name for f in fields(cls)]
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        return self.keys(data, names, required, listed)

    def entries(self, value: Any, name: str) -> list[Any]:
        """Field `name` is a list (of entries that their own reader checks)."""
        if not isinstance(value, (list, tuple)):
            self.fail(f"field {name!r} must be a list, got {type(value).__name__}")
        return list(value)

    def integer(self, value: Any, name: str, least: int = 0) -> int:
        """Field `name` is an integer >= `least` (not a bool: JSON true is no count)."""
        if not is_int(value, least):
            self.bad(name, f"an integer >= {least}", value)
        return int(value)

    def number(self, value: Any, name: str, least: float = 0.0, positive: bool = False) -> float:
        """Field `name` is a finite number >= `least` (> it when `positive`)."""
        if not is_number(value, least, positive):
            self.bad(name, f"a finite number {'>' if positive else '>='} {least:g}", value)
        return value  # an int stays an int: a JSON integer may be too large for a float

    def size(self, value: Any, name: str) -> int:
        """Field `name` is a size: a string such as "80GiB" or "16GB", or a whole number of bytes > 0 (8e10 too)."""
        if isinstance(value, str):
            try:
                return parse_size(value)
            except ValueError as exc:
                self.fail(f"field {name!r}: {exc}")
        if not is_number(value, positive=True) or not float(value).is_integer():
            self.bad(name, "a size (e.g. \"80GiB\") or a whole number of bytes > 0", value)
        return int(value)

    def string(self, value: Any, name: str) -> str:
        """Field `name` is a non-empty string (not only spaces)."""
        if not isinstance(value, str) or not value.strip():
            self.bad(name, "a non-empty string", value)
        return value

    def flag(self, value: Any, name: str) -> bool:
        """Field `name` is true or false."""
        if not isinstance(value, bool):
            self.bad(name, "true or false", value)
        return value

    def text_map(self, value: Any, name: str, meaning: str) -> dict[str, str]:
        """Field `name` is an object of string -> string (`meaning`, e.g. "module-name pattern -> style")."""
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            self.bad(name, f"an object of {meaning} strings", value)
        return dict(value)

    def strings(self, value: Any, name: str, empty_ok: bool = True, noun: str = "") -> tuple[str, ...]:
        """Field `name` is a list of strings (non-empty ones unless `empty_ok`), said as `noun` if given (e.g.
        "module names")."""
        noun = noun or ("strings" if empty_ok else "non-empty strings")
        return self._items(value, name, lambda x: isinstance(x, str) and bool(empty_ok or x), noun)

    def integers(self, value: Any, name: str, least: int = 0, non_empty: bool = False, distinct: bool = False,
                 noun: str = "") -> tuple[int, ...]:
        """Field `name` is a list of integers >= `least` (at least one when `non_empty`, no repeats when
        `distinct`), said as `noun` if given (e.g. "device indices")."""
        noun = noun or f"{'distinct ' if distinct else ''}integers >= {least}"
        items = self._items(value, name, lambda x: is_int(x, least), noun, non_empty)
        if distinct and len(set(items)) != len(items):
            self.bad(name, f"a list of {noun}", value)
        return items

    def numbers(self, value: Any, name: str) -> tuple[float, ...]:
        """Field `name` is a list of finite numbers >= 0."""
        return self._items(value, name, is_number, "finite numbers >= 0")

    def _items(self, value: Any, name: str, ok: Callable[[Any], bool], noun: str, non_empty: bool = False
               ) -> tuple[Any, ...]:
        if not isinstance(value, (list, tuple)) or (non_empty and not value) or not all(ok(x) for x in value):
            self.bad(name, f"a {'non-empty ' if non_empty else ''}list of {noun}", value)
        return tuple(value)
