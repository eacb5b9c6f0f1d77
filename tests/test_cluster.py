"""Cluster JSON: heterogeneous devices and links, and clear refusals of bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopp.data.cluster import DEFAULT_LINK, Cluster, Device, Link, load_cluster
from autopp.errors import AutoppError


def test_load_heterogeneous(tmp_path: Path) -> None:
    data = {"devices": [{"memory": "16GiB", "speed": 1.0}, {"memory": "8GiB", "speed": 2.0}],
            "links": [{"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e10, "overhead_s": 2e-5, "progress_s": 0.0}],
            "data_link": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    c = load_cluster(tmp_path / "c.json")
    assert c.num_devices == 2 and c.memory_bytes == 8 * 2**30 and not c.homogeneous
    assert c.device(1) == Device(memory_bytes=8 * 2**30, speed=2.0)
    assert c.link_between(1, 0).bandwidth_bytes_per_s == 1e10 and c.dp_link.latency_s == 1e-4
    assert (c.link_between(1, 0).overhead_s, c.link_between(1, 0).progress_s) == (2e-5, 0.0)
    assert (c.dp_link.overhead_s, c.dp_link.progress_s) == (DEFAULT_LINK.overhead_s, DEFAULT_LINK.progress_s)


@pytest.mark.parametrize("field", ["latency_s", "overhead_s", "progress_s", "bandwidth_bytes_per_s"])
def test_link_rejects_negative_or_infinite_times(field: str) -> None:
    for bad in (-1e-6, float("inf")):
        with pytest.raises(ValueError, match="link needs finite latency, overhead and progress delay >= 0"):
            Link(**{"latency_s": 0.0, "bandwidth_bytes_per_s": 1.0, field: bad})


def test_identical_devices_are_homogeneous() -> None:
    c = Cluster(num_devices=3, memory_bytes=100)
    assert c.homogeneous and c.device(2).memory_bytes == 100 and c.link_between(0, 2) == c.link


@pytest.mark.parametrize("text,pattern", [
    ("{", "not valid JSON"), ("{}", "non-empty \"devices\""),
    ('{"devices": [{"speed": 1}]}', "bad device"),
    # issue 13.7: an empty list was taken for "all links default"
    ('{"devices": [{"memory": 1}, {"memory": 1}], "links": []}', r"c\.json: \"links\" must list the 1 links .* got 0"),
    ('{"devices": [{"memory": 1}], "lnks": []}', r"c\.json: unknown key 'lnks'"),
    ('{"devices": [1]}', r"c\.json: devices\[0\]: bad device 1"),
    ('{"devices": {"memory": 1}}', "non-empty \"devices\" list"),
])
def test_bad_files(tmp_path: Path, text: str, pattern: str) -> None:
    (tmp_path / "c.json").write_text(text)
    with pytest.raises(AutoppError, match=pattern):
        load_cluster(tmp_path / "c.json")


def test_link_fields_must_be_numbers(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps({"devices": [{"memory": 1}, {"memory": 1}],
                                                 "links": [{"latency_s": 0, "bandwidth_bytes_per_s": 1,
                                                            "progress_s": True}]}))
    with pytest.raises(AutoppError, match=r"c\.json: links\[0\]: bad link .*expected numbers"):
        load_cluster(tmp_path / "c.json")


def test_wrong_link_count() -> None:
    with pytest.raises(ValueError, match="need 2 links between 3 devices"):
        Cluster(num_devices=3, memory_bytes=1, links=(Link(latency_s=0, bandwidth_bytes_per_s=1),))


def test_reordered_maps_ranks_to_devices_and_links() -> None:
    slow, fast = Link(latency_s=1e-3, bandwidth_bytes_per_s=1e8), Link(latency_s=1e-6, bandwidth_bytes_per_s=1e10)
    devices = tuple(Device(memory_bytes=100 * (d + 1), speed=1.0 + d) for d in range(3))
    c = Cluster(num_devices=3, memory_bytes=100, devices=devices, links=(fast, Link(latency_s=0, bandwidth_bytes_per_s=1)),
                link=slow).reordered((2, 0, 1))
    assert [c.device(r).speed for r in range(3)] == [3.0, 1.0, 2.0] and c.index(0) == 2
    assert c.link_between(0, 1) == slow  # devices 2 and 0 are not adjacent in the file
    assert c.link_between(1, 2) == fast  # devices 0 and 1 are joined by links[0]
    with pytest.raises(ValueError, match="permutation"):
        Cluster(num_devices=2, memory_bytes=1, order=(0, 0))
