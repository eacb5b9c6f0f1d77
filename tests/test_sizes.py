"""Size parsing and formatting."""

import pytest

from autopp.sizes import format_size, parse_size


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
