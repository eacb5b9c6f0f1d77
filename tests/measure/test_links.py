"""Link measurement: the latency + bytes/bandwidth fit is exact on known times; two gloo ranks give a usable Link;
links files of every readable version load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopp.data.cluster import DEFAULT_LINK, Link
from autopp.costmodel import transfer_time
from autopp.errors import AutoppError
from autopp.measure.links import fit_link, load_link, load_links, measure_links


def test_fit_recovers_latency_and_bandwidth() -> None:
    link = Link(latency_s=50e-6, bandwidth_bytes_per_s=2e9)
    sizes = [4, 65536, 1 << 20, 8 << 20]
    latency, bandwidth = fit_link(sizes, [transfer_time(link, n) for n in sizes])
    assert latency == pytest.approx(50e-6) and bandwidth == pytest.approx(2e9)


def test_fit_needs_two_sizes_and_growing_times() -> None:
    with pytest.raises(ValueError, match="2 distinct message sizes"):
        fit_link([8, 8], [1e-3, 1e-3])
    with pytest.raises(ValueError, match="do not grow"):
        fit_link([8, 1024], [2e-3, 1e-3])


@pytest.mark.integration
def test_two_gloo_ranks_round_trip(tmp_path: Path) -> None:
    links = measure_links(2, message_bytes=(4, 32 << 20), warmup=3, repeats=5, timeout_s=90)  # 32 MiB: far above
    # the noise of a loaded machine (with 8 MiB, a 4-byte round trip once took longer, and no bandwidth could be fit)
    assert links.backend == "gloo" and links.ranks == 2 and len(links.pairs) == 1
    assert all(t > 0 for t in links.pairs[0].seconds)
    assert links.calibration == () and links.overhead_s is None and links.progress_s is None  # calibrate_links fits
    path = links.save(tmp_path / "links.json")
    assert load_links(path) == links
    link = load_link(path)
    assert link.latency_s == links.latency_s and link.bandwidth_bytes_per_s > 0
    assert (link.overhead_s, link.progress_s) == (DEFAULT_LINK.overhead_s, DEFAULT_LINK.progress_s)


def test_version_1_file_loads_with_the_default_overhead_and_delay(tmp_path: Path) -> None:
    (tmp_path / "v1.json").write_text(json.dumps({
        "version": 1, "backend": "gloo", "device": "cpu", "ranks": 2, "message_bytes": [4, 1024], "repeats": 3,
        "pairs": [{"src": 0, "dst": 1, "seconds": [1e-5, 2e-5], "spread_s": [0, 0], "latency_s": 1e-5,
                   "bandwidth_bytes_per_s": 1e8}], "latency_s": 1e-5, "bandwidth_bytes_per_s": 1e8}))
    link = load_link(tmp_path / "v1.json")
    assert link.latency_s == 1e-5
    assert (link.overhead_s, link.progress_s) == (DEFAULT_LINK.overhead_s, DEFAULT_LINK.progress_s)


def test_bad_links_file(tmp_path: Path) -> None:
    (tmp_path / "l.json").write_text(json.dumps({"version": 7}))
    with pytest.raises(AutoppError, match=r"l\.json: links file version 7 is not one of \[1, 2\]"):
        load_link(tmp_path / "l.json")
    (tmp_path / "m.json").write_text(json.dumps({"version": 1, "latency_s": 1e-5}))
    with pytest.raises(AutoppError, match=r"m\.json: bad links file"):
        load_link(tmp_path / "m.json")
