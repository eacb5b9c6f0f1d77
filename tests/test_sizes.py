"""Size parsing and formatting."""

import pytest

from autopp.sizes import format_size, format_time, parse_size


@pytest.mark.parametrize("text,value", [("80GiB", 80 * 2**30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536),
                                        ("1e9", 10**9), ("4g", 4 * 2**30), ("100", 100)])
def test_parse(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "0"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_format() -> None:
    assert format_size(1536) == "1.5 KiB" and format_size(3 * 2**30) == "3 GiB" and format_size(12) == "12 B"


def test_format_never_uses_exponents() -> None:
    """A Llama-3-8B unit's parameters (just under 1 GiB) read 1002 MiB, not 1e+03 MiB; likewise times of 1-10 s."""
    assert format_size(1002 * 2**20 + 5) == "1002 MiB" and format_size(999.6 * 2**20) == "1000 MiB"
    assert format_size(2500 * 2**30) == "2500 GiB" and format_size(123.4 * 2**10) == "123 KiB"
    assert format_time(1.5) == "1500 ms" and format_time(0.0123) == "12.3 ms" and format_time(12345.0) == "12345 s"
