"""Live values and tied parameter groups: typed records read from and written back to meta.json unchanged."""

from __future__ import annotations

import json

import pytest

from autopp.errors import ProfileError
from autopp.data.profile import LiveValue, TiedGroup, ValueAction, load_profile

from .conftest import ROOT


def test_shipped_live_values_round_trip_unchanged() -> None:
    raw = json.loads((ROOT / "profiles" / "gpt" / "meta.json").read_text())
    meta = load_profile(ROOT / "profiles" / "gpt").meta
    assert [v.to_json() for v in meta.live_values] == raw["live_values"]
    assert {v.action for v in meta.live_values} >= {ValueAction.SEND}
    assert all(isinstance(b, int) for v in meta.live_values for b in v.bytes)


def test_an_entry_written_before_needs_grad_and_reads_is_written_back_without_them() -> None:
    old = {"name": "mask", "src": 0, "dsts": [1, 3], "action": "recompute", "relayed_over": [1, 2],
           "bytes": {"1": 16}}
    value = LiveValue.from_json(old, "meta.json")
    assert (value.needs_grad, value.reads, value.bytes) == (None, None, {1: 16})
    assert value.to_json() == old and value.crosses(3) and not value.crosses(4)


def test_tied_group_round_trips() -> None:
    data = {"names": ["wte.weight", "head.weight"], "units": [0, 5], "bytes": 2048}
    assert TiedGroup.from_json(data, "meta.json").to_json() == data


@pytest.mark.parametrize("entry, message", [
    ({"name": "x", "src": 0, "dsts": [1], "action": "teleport"}, r"meta.json: bad entry of 'live_values' \(ValueError"),
    ({"name": "x", "src": 0, "action": "send"}, r"meta.json: bad entry of 'live_values' \(KeyError"),
    ({"name": "x", "src": 0, "dsts": [], "action": "send"}, r"live value 'x' has no reader"),
])
def test_a_bad_live_value_is_refused_naming_the_field(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        LiveValue.from_json(entry, "meta.json")


def test_a_bad_tied_group_is_refused_naming_the_field() -> None:
    with pytest.raises(ProfileError, match=r"meta.json: bad entry of 'tied_parameters' \(KeyError"):
        TiedGroup.from_json({"names": ["a", "b"], "units": [0, 1]}, "meta.json")
