"""autopp.data.fields: the one set of JSON field checks every reader uses (one line: file, field, rule, value)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest

from autopp.data.fields import Fields, is_int, is_number, is_span
from autopp.errors import PlanError, ProfileError

F = Fields("p.json", PlanError)


@pytest.mark.parametrize("value", [True, False, 0, 1.0, "1", None])
def test_integer_refuses_bools_floats_text_and_small_values(value: object) -> None:
    with pytest.raises(PlanError, match=rf"^p\.json: field 'dp' must be an integer >= 1, got {value!r}$"):
        F.integer(value, "dp", 1)


def test_checks_return_what_they_accepted() -> None:
    assert F.integer(3, "dp", 1) == 3 and F.number(0, "s") == 0 and F.flag(False, "fits") is False
    assert F.integers([1, 2], "sizes", 1, non_empty=True, distinct=True) == (1, 2)
    assert F.strings(["a"], "names") == ("a",) and F.size("1KiB", "memory") == 1024 and F.size(8e3, "memory") == 8000
    assert F.text_map({"a": "b"}, "tp_plan", "pattern -> style") == {"a": "b"} and F.entries((1,), "x") == [1]


@pytest.mark.parametrize("call, message", [
    (lambda: F.number(float("nan"), "s"), "field 's' must be a finite number >= 0, got nan"),
    (lambda: F.number(True, "s"), "field 's' must be a finite number >= 0, got True"),
    (lambda: F.number(0, "bw", positive=True), "field 'bw' must be a finite number > 0, got 0"),
    (lambda: F.integers([2, 2], "tp", 2, distinct=True),
     r"field 'tp' must be a list of distinct integers >= 2, got \[2, 2\]"),
    (lambda: F.integers([], "sizes", 1, non_empty=True), r"field 'sizes' must be a non-empty list of integers >= 1"),
    (lambda: F.integers([True], "order", noun="device indices"), r"field 'order' must be a list of device indices"),
    (lambda: F.strings([""], "names", empty_ok=False), r"field 'names' must be a list of non-empty strings"),
    (lambda: F.string("  ", "vendor"), "field 'vendor' must be a non-empty string, got '  '"),
    (lambda: F.size(1.5, "memory"), r"field 'memory' must be a size .* whole number of bytes > 0, got 1\.5"),
    (lambda: F.size("lots", "memory"), "field 'memory': cannot read 'lots' as a size"),
    (lambda: F.flag("yes", "fits"), "field 'fits' must be true or false, got 'yes'"),
    (lambda: F.entries("x", "live_values"), "field 'live_values' must be a list, got str"),
    (lambda: F.obj([]), "expected a JSON object, got list"),
    (lambda: F.keys({"a": 1}, ["b"], ["b"]), "missing field 'b'"),
    (lambda: F.keys({"a": 1}, ["b"], listed=True), r"unknown field 'a'; expected fields \['b'\]$"),
    (lambda: F.at("stage 1").integer(-1, "rank"), "p.json: stage 1: field 'rank' must be an integer >= 0, got -1"),
])
def test_each_failure_is_one_line_naming_the_file_and_the_field(call: Callable[[], object], message: str) -> None:
    with pytest.raises(PlanError, match=message) as info:
        call()
    assert str(info.value).startswith("p.json: ") and "\n" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_advice_follows_every_message_and_the_reader_error_is_raised() -> None:
    with pytest.raises(ProfileError, match=r"^m\.json: field 'x' must be an integer >= 0, got 'a': re-profile$"):
        Fields("m.json", ProfileError, "re-profile").integer("a", "x")


def test_record_takes_required_and_known_fields_from_a_dataclass() -> None:
    @dataclass
    class R:
        a: int
        b: int = 0
    assert F.record({"a": 1}, R) == {"a": 1}
    with pytest.raises(PlanError, match="missing field 'a'"):
        F.record({"b": 1}, R)
    with pytest.raises(PlanError, match="unknown field 'c'"):
        F.record({"a": 1, "c": 2}, R)


def test_predicates() -> None:
    assert is_int(2, 2) and not is_int(True) and not is_int(2.0) and not is_int(1, 2)
    assert is_number(10**400) and not is_number(float("inf")) and not is_number(False) and not is_number(-1)
    assert is_span([0, 2]) and not is_span([2, 2]) and not is_span([False, 1]) and not is_span([0])
