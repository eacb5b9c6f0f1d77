"""Size parsing and formatting."""

import pytest

from autopp.sizes import format_in, format_size, format_time, parse_size, size_argument, size_unit, time_unit


@pytest.mark.parametrize("text,value", [("80GiB", 80 * 2**30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536),
                                        ("1e9B", 10**9), ("4gib", 4 * 2**30), ("100B", 100), ("80GB", 80 * 10**9)])
def test_parse(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "0GiB"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("text,message", [
    ("80", "size '80' has no unit; write 80GiB or 80GB (a bare number would be 80 bytes)"),
    ("1e9", "size '1e9' has no unit; write 1e9GiB or 1e9GB (a bare number would be 1e9 bytes)"),
    ("80G", "size '80G' is ambiguous; write 80GiB (= 85.9 GB) or 80GB (= 74.5 GiB)"),
    ("512m", "size '512m' is ambiguous; write 512MiB (= 537 MB) or 512MB (= 488 MiB)"),
])
def test_bare_numbers_and_one_letter_units_are_refused(text: str, message: str) -> None:
    """Issue 26: `--memory 80` meant 80 bytes and `--memory 80G` 80 GiB (more than an 80 GB H100 has), silently."""
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert str(info.value) == message


def test_format() -> None:
    assert format_size(1536) == "1.5 KiB" and format_size(3 * 2**30) == "3 GiB" and format_size(12) == "12 B"


def test_format_never_uses_exponents() -> None:
    """A Llama-3-8B unit's parameters (just under 1 GiB) read 1002 MiB, not 1e+03 MiB; likewise times of 1-10 s."""
    assert format_size(1002 * 2**20 + 5) == "1002 MiB" and format_size(999.6 * 2**20) == "1000 MiB"
    assert format_size(2500 * 2**30) == "2500 GiB" and format_size(123.4 * 2**10) == "123 KiB"
    assert format_time(1.5) == "1500 ms" and format_time(0.0123) == "12.3 ms" and format_time(12345.0) == "12345 s"


def test_one_unit_per_column() -> None:
    """Issue 26: a column read `9595 ms` beside `11.2 s`; its unit now comes from its largest value."""
    unit = time_unit([9.595, 11.2, 0.004])
    assert [format_in(x, unit) for x in (9.595, 11.2, 0.004, 0.00567, 0.0004, 0.0)] == [
        "9.6 s", "11.2 s", "0.004 s", "0.00567 s", "< 0.001 s", "0 s"]  # a tester: `< 0.01 s` beside 5.67 ms
    unit = time_unit([9.595, 0.5])
    assert [format_in(x, unit) for x in (9.595, 0.5)] == ["9595 ms", "500 ms"]
    assert time_unit([2e-4]) == ("us", 1e-6) and time_unit([]) == ("ms", 1e-3)
    assert format_in(5 * 2**20, size_unit(45.6 * 2**30)) == "0.00488 GiB" and size_unit(12) == ("B", 1)
    assert format_in(12, size_unit(12)) == "12 B"


def test_memory_suggestions_are_pasteable_gib_at_least_the_need() -> None:
    """`use --memory 41465200640 or more` now reads `use --memory 38.7GiB or more`, rounded up, and parses back."""
    assert size_argument(41465200640) == "38.7GiB" and parse_size(size_argument(41465200640)) >= 41465200640
    assert size_argument(80 * 2**30) == "80GiB" and size_argument(32.7 * 2**20) == "33MiB"
    assert size_argument(1) == "1MiB" and size_argument(2**30) == "1GiB"
