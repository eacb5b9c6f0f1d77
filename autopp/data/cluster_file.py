"""Cluster files: a flat list of devices (version 1) or nodes of identical devices (version 2), read into a
`Cluster` (format in docs/cluster-format.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import AutoppError
from ..jsonio import read_json
from .catalog import DeviceSpec, load_device
from .cluster import (DEFAULT_LINK, GLOO_COSTS, NCCL_COSTS, Cluster, Device, Link, Nodes, hierarchical_cluster,
                      link_fields, parse_link)
from .fields import Fields, is_int

__all__ = ["load_cluster"]


def _link(f: Fields, value: Any, where: str) -> Link:
    """A version 1 link: gloo's CPU costs (`GLOO_COSTS`) where overhead_s / progress_s are not given."""
    try:
        return parse_link(value, where, GLOO_COSTS)
    except ValueError as exc:
        f.fail(str(exc))


def _device(d: Any, f: Fields) -> Device:
    """A version 1 device: "memory" (a size) and "speed" (default 1)."""
    if "memory" not in f.obj(d):
        f.fail("missing field 'memory'")
    return Device(memory_bytes=f.size(d["memory"], "memory"),
                  speed=float(f.number(d.get("speed", 1.0), "speed", positive=True)))


#: The widest spread of device speeds a cluster file may give (fastest / slowest): a tester's 1e308 beside 1 overflowed
#: the placement's integer model.
MAX_SPEED_RATIO = 1e6
#: What every error about a cluster file ends with.
_ADVICE = "see docs/cluster-format.md"
#: Keys of a flat cluster file (version 1, the default).
_KEYS = {"version", "devices", "link", "links", "data_link"}
#: Keys of a cluster file of nodes (version 2).
_NODE_KEYS = {"version", "nodes", "devices_per_node", "device", "memory", "intra_node_link", "inter_node_link",
              "regions", "wan_link"}


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster JSON file (format in docs/cluster-format.md): a flat list of devices (version 1, no "version"
    needed) or nodes of identical devices (version 2)."""
    p = Path(path)
    f = Fields(str(p), advice=_ADVICE)
    data = f.obj(read_json(p, "cluster file", advice=_ADVICE))
    version = data.get("version", 1)
    if not is_int(version) or version not in (1, 2):
        f.bad("version", "1 (a list of devices) or 2 (nodes)", version)
    if version == 2:
        return _load_nodes(f, data)
    if "nodes" in data and "devices" not in data:
        f.fail("a cluster file of nodes needs \"version\": 2")
    if not isinstance(data.get("devices"), list) or not data["devices"]:
        f.fail("a cluster file needs a non-empty \"devices\" list")
    f.keys(data, _KEYS, listed=True)
    devices = tuple(_device(d, f.at(f"devices[{i}]")) for i, d in enumerate(data["devices"]))
    speeds = [d.speed for d in devices]
    if max(speeds) / min(speeds) > MAX_SPEED_RATIO:  # CP-SAT's placement times stages in integers of speed x 1000
        f.fail(f"the devices' speeds span {max(speeds) / min(speeds):.3g}x (fastest / slowest), more than the "
               f"{MAX_SPEED_RATIO:.0e}x autopp plans: give relative speeds (the slowest device 1, say)")
    link = _link(f, data["link"], "link") if "link" in data else DEFAULT_LINK
    if "links" in data and (not isinstance(data["links"], list) or len(data["links"]) != len(devices) - 1):
        given = len(data["links"]) if isinstance(data["links"], list) else type(data["links"]).__name__
        f.fail(f"\"links\" must list the {len(devices) - 1} links between neighbouring devices (links[i] joins "
               f"devices i and i + 1), got {given}; leave it out to use \"link\" for all")
    links = tuple(_link(f, d, f"links[{i}]") for i, d in enumerate(data.get("links", [])))
    data_link = _link(f, data["data_link"], "data_link") if "data_link" in data else None
    try:
        return Cluster(num_devices=len(devices), memory_bytes=min(d.memory_bytes for d in devices), link=link,
                       devices=devices, links=links, data_link=data_link)
    except ValueError as exc:
        f.fail(str(exc))


def _load_nodes(f: Fields, data: dict[str, Any]) -> Cluster:
    """A version 2 file: nodes x devices per node, links and memory defaulting to the catalog entry "device"."""
    f.keys(data, _NODE_KEYS, ["nodes"], listed=True)
    spec = _catalog_device(f, data["device"]) if "device" in data else None
    count = f.integer(data["nodes"], "nodes", 1)
    if "devices_per_node" not in data and spec is None:
        f.fail("missing field 'devices_per_node'; give it, or a catalog \"device\" to default from")
    per_node = f.integer(data.get("devices_per_node", spec.devices_per_node if spec else 0), "devices_per_node", 1)
    if "memory" not in data and spec is None:
        f.fail("missing field 'memory'; give each device's memory (e.g. \"80GiB\") or a catalog \"device\"")
    memory = f.size(data["memory"], "memory") if "memory" in data else spec.memory_bytes if spec else 0
    intra, inter = (_node_link(f, data, key, getattr(spec, key).link if spec else None)
                    for key in ("intra_node_link", "inter_node_link"))
    regions = f.integer(data.get("regions", 1), "regions", 1)
    if (regions > 1) != ("wan_link" in data):
        f.fail(f"field 'wan_link': a WAN link joins regions; give it exactly when \"regions\" > 1 (regions {regions})")
    wan = _node_link(f, data, "wan_link", None) if "wan_link" in data else None
    try:
        return hierarchical_cluster(Nodes(count=count, devices_per_node=per_node, intra=intra, inter=inter,
                                          device=spec.name if spec else None, regions=regions, wan=wan), memory)
    except ValueError as exc:
        f.fail(str(exc))


def _catalog_device(f: Fields, name: Any) -> DeviceSpec:
    """The catalog entry (or device file, relative to the cluster file) named by "device"."""
    if not isinstance(name, str) or not name:
        f.bad("device", "a catalog name (`autopp devices`) or a device file", name)
    if name.endswith(".json") and not Path(name).is_absolute():
        name = str(Path(f.where).parent / name)
    try:
        return load_device(name)
    except AutoppError as exc:  # the catalog's own message and advice
        raise AutoppError(f"{f.where}: field 'device': {exc}") from None


def _node_link(f: Fields, data: dict[str, Any], key: str, default: Link | None) -> Link:
    """A node or WAN link: its fields over the catalog device's link, or latency and bandwidth given (overhead and
    progress delay default to 0, `NCCL_COSTS`, as with NCCL between GPUs)."""
    then = "; give it" if key == "wan_link" or default is not None else \
        "; give it, or a catalog \"device\" to default from"
    try:
        return parse_link(data.get(key, {}), key, NCCL_COSTS if default is None else link_fields(default), then)
    except ValueError as exc:
        f.fail(str(exc))
