"""Cluster JSON: heterogeneous devices and links, and clear refusals of bad files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autopp.data.catalog import load_device
from autopp.data.cluster import (DEFAULT_LINK, GLOO_COSTS, NCCL_COSTS, Cluster, Device, Link, Nodes,
                                 hierarchical_cluster, link_fields, parse_link)
from autopp.data.cluster_file import load_cluster
from autopp.data.layout import Layout
from autopp.errors import AutoppError, LayoutError


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
    ('{"devices": [{"speed": 1}]}', r"c\.json: devices\[0\]: missing field 'memory'"),
    ('{"devices": [{"memory": 1, "speed": true}]}',
     r"c\.json: devices\[0\]: field 'speed' must be a finite number > 0, got True"),
    ('{"devices": [{"memory": 1.5}]}', r"c\.json: devices\[0\]: field 'memory' must be a size .* bytes > 0, got 1\.5"),
    # issue 13.7: an empty list was taken for "all links default"
    ('{"devices": [{"memory": 1}, {"memory": 1}], "links": []}', r"c\.json: \"links\" must list the 1 links .* got 0"),
    ('{"devices": [{"memory": 1}], "lnks": []}',
     r"c\.json: unknown field 'lnks'; expected fields \['data_link', 'devices', 'link', 'links', 'version'\]: "
     r"see docs/cluster-format\.md$"),
    ('{"devices": [1]}', r"c\.json: devices\[0\]: expected a JSON object, got int"),
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
    with pytest.raises(AutoppError, match=r"c\.json: links\[0\]: expected an object of numbers"):
        load_cluster(tmp_path / "c.json")


def test_flat_file_link_refuses_unknown_keys(tmp_path: Path) -> None:
    """Review 16.14: one link reader; a misspelt key in a version 1 link was ignored (its default used)."""
    link = {"latency_s": 0, "bandwidth_bytes_per_s": 1, "overhead": 0}
    (tmp_path / "c.json").write_text(json.dumps({"devices": [{"memory": 1}], "link": link}))
    with pytest.raises(AutoppError, match=r"^\S*c\.json: link: unknown key 'overhead'; a link has"):
        load_cluster(tmp_path / "c.json")


@pytest.mark.parametrize("defaults, costs", [(GLOO_COSTS, (DEFAULT_LINK.overhead_s, DEFAULT_LINK.progress_s)),
                                             (NCCL_COSTS, (0.0, 0.0))])
def test_parse_link_defaults_are_explicit(defaults: dict[str, float], costs: tuple[float, float]) -> None:
    link = parse_link({"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}, "x", defaults)
    assert (link.overhead_s, link.progress_s) == costs
    given = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9, "progress_s": 0}
    assert parse_link(given, "x", defaults).progress_s == 0
    base = Link(latency_s=1.0, bandwidth_bytes_per_s=2.0, overhead_s=3.0, progress_s=4.0)
    assert parse_link({"latency_s": 5.0}, "x", link_fields(base)) == replace(base, latency_s=5.0)
    with pytest.raises(ValueError, match=r"^x: missing 'latency_s'; say$"):
        parse_link({"bandwidth_bytes_per_s": 1e9}, "x", defaults, "; say")


def test_version_2_links_default_to_no_cpu_costs(tmp_path: Path) -> None:
    """The rule of docs/cluster-format.md: version 1 links take gloo's costs, version 2 links (without a catalog
    device) NCCL's 0."""
    c = load_cluster(_write(tmp_path, {"version": 2, "nodes": 2, "devices_per_node": 2, "memory": 1,
                                       "intra_node_link": {"latency_s": 0, "bandwidth_bytes_per_s": 1},
                                       "inter_node_link": {"latency_s": 0, "bandwidth_bytes_per_s": 1}}))
    assert c.nodes is not None and (c.nodes.inter.overhead_s, c.nodes.inter.progress_s) == (0, 0)


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


INTRA, INTER = Link(latency_s=1e-6, bandwidth_bytes_per_s=4e11), Link(latency_s=1e-5, bandwidth_bytes_per_s=5e10)


def _nodes(count: int = 2, per_node: int = 4) -> Cluster:
    return hierarchical_cluster(Nodes(count=count, devices_per_node=per_node, intra=INTRA, inter=INTER), 100)


def test_pp4_dp2_on_two_nodes_crosses_between_ranks_1_and_2() -> None:
    """Rank r of replica j runs device 2 r + j: ranks 0, 1 on node 0, ranks 2, 3 on node 1."""
    c = _nodes().placed(Layout(pp=4, dp=2))
    assert [c.link_between(r, r + 1) for r in range(3)] == [INTRA, INTER, INTRA]
    assert c.link_between(3, 0) == INTER  # the loop back of interleaved layouts
    assert [c.dp_group(r, 2) for r in range(4)] == [((2,),)] * 4  # each replica pair shares a node


def test_placement_of_other_grids() -> None:
    c = _nodes()
    one_per_node, one_per_device = c.placed(Layout(pp=2, dp=4)), c.placed(Layout(pp=8, dp=1))
    assert one_per_node.link_between(0, 1) == INTER and c.dp_group(1, 4) == ((4,),)  # one pipeline rank per node
    assert [one_per_device.link_between(r, r + 1) for r in range(7)] == [INTRA] * 3 + [INTER] + [INTRA] * 3
    assert c.dp_group(0, 8) == ((4, 4),)
    assert _nodes(3, 4).dp_group(1, 3) == ((1, 2),)  # devices 3 | 4, 5: groups need not divide the nodes
    # devices 0, 1 -> 2, 3: replica 1 leaves node 0
    assert _nodes(2, 3).placed(Layout(pp=3, dp=2)).link_between(0, 1) == INTER
    assert c.link == INTER and c.homogeneous and c.link_between(0, 1) == INTER  # not placed: the slower link


def test_flat_cluster_is_placed_unchanged() -> None:
    flat = Cluster(num_devices=8, memory_bytes=100, link=INTER)
    assert flat.placed(Layout(pp=4, dp=2)) is flat and flat.dp_group(0, 2) == ()


def test_nodes_must_match_the_devices() -> None:
    nodes = Nodes(count=2, devices_per_node=4, intra=INTRA, inter=INTER)
    with pytest.raises(ValueError, match="2 nodes x 4 devices != num_devices 6"):
        Cluster(num_devices=6, memory_bytes=1, nodes=nodes)
    with pytest.raises(LayoutError, match=r"pp\(3\) \* dp\(2\) = 6 != devices \(8\)"):
        _nodes().placed(Layout(pp=3, dp=2))
    with pytest.raises(ValueError, match="identical devices"):
        Cluster(num_devices=8, memory_bytes=1, nodes=nodes, devices=(Device(memory_bytes=1),) * 8)


WAN = Link(latency_s=0.02, bandwidth_bytes_per_s=1e9)


def test_regions_joined_by_a_wan_link() -> None:
    """4 nodes x 2 in 2 regions (nodes 0, 1 | 2, 3): pp 4 x dp 2 hops node to node, and region to region at 1-2."""
    nodes = Nodes(count=4, devices_per_node=2, intra=INTRA, inter=INTER, regions=2, wan=WAN)
    c = hierarchical_cluster(nodes, 100)
    assert c.link == WAN and c.pipeline_links[-3:] == (INTRA, INTER, WAN)
    placed = c.placed(Layout(pp=4, dp=2))
    assert [placed.link_between(r, r + 1) for r in range(3)] == [INTER, WAN, INTER]
    assert [placed.hop_level(r, r + 1) for r in range(3)] == [1, 2, 1]
    assert c.placed(Layout(pp=2, dp=4)).link_between(0, 1) == WAN and c.dp_group(0, 4) == ((2, 2),)
    assert c.dp_group(0, 8) == ((2, 2), (2, 2)) and c.dp_group(1, 3) == ((1,), (2,))  # devices 3 | 4, 5: regions 0, 1
    assert c.dp_group(0, 6) == ((2, 2), (2,))
    with pytest.raises(ValueError, match="a wan link joins regions"):
        Nodes(count=4, devices_per_node=2, intra=INTRA, inter=INTER, regions=2)
    with pytest.raises(ValueError, match="4 nodes do not split into 3 regions"):
        Nodes(count=4, devices_per_node=2, intra=INTRA, inter=INTER, regions=3, wan=WAN)


def _write(tmp_path: Path, data: object) -> Path:
    (tmp_path / "c.json").write_text(json.dumps(data))
    return tmp_path / "c.json"


def test_load_nodes_from_the_catalog(tmp_path: Path) -> None:
    spec = load_device("h100-sxm")
    c = load_cluster(_write(tmp_path, {"version": 2, "nodes": 8, "device": "h100-sxm",
                                       "inter_node_link": {"bandwidth_bytes_per_s": 25e9}}))
    assert c.num_devices == 64 and c.memory_bytes == spec.memory_bytes and c.nodes is not None
    assert (c.nodes.count, c.nodes.devices_per_node, c.nodes.device) == (8, 8, "h100-sxm")
    assert c.nodes.intra == spec.intra_node_link.link
    assert c.nodes.inter == replace(spec.inter_node_link.link, bandwidth_bytes_per_s=25e9)


def test_load_nodes_without_a_catalog_device(tmp_path: Path) -> None:
    c = load_cluster(_write(tmp_path, {"version": 2, "nodes": 2, "devices_per_node": 4, "memory": "16GiB",
                                       "intra_node_link": {"latency_s": 1e-6, "bandwidth_bytes_per_s": 4e11},
                                       "inter_node_link": {"latency_s": 1e-5, "bandwidth_bytes_per_s": 5e10}}))
    assert c == hierarchical_cluster(Nodes(count=2, devices_per_node=4, intra=INTRA, inter=INTER), 16 * 2**30)


def test_load_regions(tmp_path: Path) -> None:
    c = load_cluster(_write(tmp_path, {"version": 2, "nodes": 4, "device": "h100-sxm", "regions": 2,
                                       "wan_link": {"latency_s": 0.02, "bandwidth_bytes_per_s": 1e9}}))
    assert c.nodes is not None and (c.nodes.regions, c.nodes.wan) == (2, WAN) and c.num_devices == 32


def test_flat_file_may_say_version_1(tmp_path: Path) -> None:
    assert load_cluster(_write(tmp_path, {"version": 1, "devices": [{"memory": 5}]})).num_devices == 1


_OK = {"version": 2, "nodes": 2, "device": "h100-sxm"}


@pytest.mark.parametrize("data,pattern", [
    ({"version": 3, "nodes": 2}, r"c\.json: field 'version' must be 1 \(a list of devices\) or 2 \(nodes\), got 3"),
    ({"nodes": 2, "device": "h100-sxm"}, r"c\.json: a cluster file of nodes needs \"version\": 2"),
    ({"version": 2, "device": "h100-sxm"}, r"c\.json: missing field 'nodes': see docs/cluster-format\.md$"),
    ({**_OK, "nodes": 0}, r"c\.json: field 'nodes' must be an integer >= 1, got 0"),
    ({**_OK, "devices_per_node": "8"}, r"c\.json: field 'devices_per_node' must be an integer >= 1, got '8'"),
    ({**_OK, "link": {}}, r"c\.json: unknown field 'link'; expected fields \['device', "),
    ({**_OK, "device": "v100"}, r"c\.json: field 'device': unknown device 'v100'; the catalog has"),
    ({"version": 2, "nodes": 2, "devices_per_node": 4}, r"c\.json: missing field 'memory'; give each device's memory"),
    ({**_OK, "memory": "lots"}, r"c\.json: field 'memory': cannot read 'lots' as a size"),
    ({**_OK, "inter_node_link": {"bandwidth": 1e9}}, r"c\.json: inter_node_link: unknown key 'bandwidth'"),
    ({**_OK, "inter_node_link": {"bandwidth_bytes_per_s": -1.0}}, r"c\.json: inter_node_link: link needs"),
    ({**_OK, "intra_node_link": {"latency_s": True}}, r"c\.json: intra_node_link: expected an object of numbers"),
    ({"version": 2, "nodes": 2, "devices_per_node": 4, "memory": "1GiB",
      "intra_node_link": {"bandwidth_bytes_per_s": 1e9}}, r"c\.json: intra_node_link: missing 'latency_s'"),
    ({**_OK, "regions": 2},
     r"c\.json: field 'wan_link': a WAN link joins regions; give it exactly when \"regions\" > 1"),
    ({**_OK, "regions": 2, "wan_link": {"bandwidth_bytes_per_s": 1e9}},
     r"c\.json: wan_link: missing 'latency_s'; give it: see docs/cluster-format\.md$"),
    ({**_OK, "nodes": 3, "regions": 2, "wan_link": {"latency_s": 0, "bandwidth_bytes_per_s": 1}},
     r"c\.json: 3 nodes do not split into 2 regions"),
])
def test_bad_node_files(tmp_path: Path, data: dict[str, object], pattern: str) -> None:
    with pytest.raises(AutoppError, match=pattern) as info:
        load_cluster(_write(tmp_path, data))
    assert "\n" not in str(info.value)


def test_tp_groups_make_each_group_one_pipeline_rank() -> None:
    from autopp.data.cluster import hierarchical_cluster
    intra, inter = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e11), Link(latency_s=5e-6, bandwidth_bytes_per_s=1e10)
    cluster = hierarchical_cluster(Nodes(count=4, devices_per_node=8, intra=intra, inter=inter), 2**34)
    g = cluster.tp_groups(4)
    assert (g.num_devices, g.nodes.count, g.nodes.devices_per_node) == (8, 4, 2)
    assert g.memory_bytes == cluster.memory_bytes and cluster.tp_link(4) == intra
    span = cluster.tp_groups(16)  # groups of two whole nodes, joined by the inter-node link only
    assert (span.num_devices, span.nodes.devices_per_node, span.nodes.intra) == (2, 1, inter)
    assert cluster.tp_link(16) == inter and cluster.tp_groups(1) is cluster
    with pytest.raises(ValueError, match="neither fits in nor spans whole nodes"):
        hierarchical_cluster(Nodes(count=3, devices_per_node=4, intra=intra, inter=inter), 2**34).tp_groups(6)
    flat = Cluster(num_devices=8, memory_bytes=2**30)
    assert flat.tp_groups(2).num_devices == 4 and flat.tp_link(2) == flat.link
    with pytest.raises(ValueError, match="groups of 3"):
        flat.tp_groups(3)
