"""Cluster files: a flat list of devices (version 1) or nodes of identical devices (version 2), read into a
`Cluster` (format in docs/cluster-format.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import AutoppError
from ..jsonio import read_json
from ..sizes import parse_size
from .catalog import DeviceSpec, load_device
from .cluster import (DEFAULT_LINK, GLOO_COSTS, NCCL_COSTS, Cluster, Device, Link, Nodes, hierarchical_cluster,
                      link_fields, parse_link)

__all__ = ["load_cluster"]


def _link(p: Path, value: Any, where: str) -> Link:
    """A version 1 link: gloo's CPU costs (`GLOO_COSTS`) where overhead_s / progress_s are not given."""
    try:
        return parse_link(value, where, GLOO_COSTS)
    except ValueError as exc:
        raise AutoppError(f"{p}: {exc}") from None


def _device(d: dict[str, Any], where: str) -> Device:
    if not isinstance(d, dict) or any(isinstance(v, bool) for v in d.values()):
        raise AutoppError(f"{where}: bad device {d!r}: expected an object with \"memory\" (and \"speed\")")
    try:
        mem = d["memory"]
        return Device(memory_bytes=parse_size(mem) if isinstance(mem, str) else int(mem), speed=float(d.get("speed", 1.0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise AutoppError(f"{where}: bad device {d!r}: {exc}") from None


#: Keys of a flat cluster file (version 1, the default).
_KEYS = {"version", "devices", "link", "links", "data_link"}
#: Keys of a cluster file of nodes (version 2).
_NODE_KEYS = {"version", "nodes", "devices_per_node", "device", "memory", "intra_node_link", "inter_node_link",
              "regions", "wan_link"}


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster JSON file (format in docs/cluster-format.md): a flat list of devices (version 1, no "version"
    needed) or nodes of identical devices (version 2)."""
    p = Path(path)
    data = read_json(p, "cluster file", advice="see docs/cluster-format.md")
    if not isinstance(data, dict):
        raise AutoppError(f"{p}: a cluster file is a JSON object (docs/cluster-format.md)")
    version = data.get("version", 1)
    if version == 2 and not isinstance(version, bool):
        return _load_nodes(p, data)
    if version != 1 or isinstance(version, bool):
        raise AutoppError(f"{p}: version: expected 1 (a list of devices) or 2 (nodes), got {version!r} "
                          "(docs/cluster-format.md)")
    if "nodes" in data and "devices" not in data:
        raise AutoppError(f"{p}: a cluster file of nodes needs \"version\": 2 (docs/cluster-format.md)")
    if not isinstance(data.get("devices"), list) or not data["devices"]:
        raise AutoppError(f"{p}: a cluster file needs a non-empty \"devices\" list")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise AutoppError(f"{p}: unknown key {unknown[0]!r}; a cluster file has {sorted(_KEYS)} "
                          "(docs/cluster-format.md)")
    devices = tuple(_device(d, f"{p}: devices[{i}]") for i, d in enumerate(data["devices"]))
    link = _link(p, data["link"], "link") if "link" in data else DEFAULT_LINK
    if "links" in data and (not isinstance(data["links"], list) or len(data["links"]) != len(devices) - 1):
        given = len(data["links"]) if isinstance(data["links"], list) else type(data["links"]).__name__
        raise AutoppError(f"{p}: \"links\" must list the {len(devices) - 1} links between neighbouring devices "
                          f"(links[i] joins devices i and i + 1), got {given}; leave it out to use \"link\" for all")
    links = tuple(_link(p, d, f"links[{i}]") for i, d in enumerate(data.get("links", [])))
    data_link = _link(p, data["data_link"], "data_link") if "data_link" in data else None
    try:
        return Cluster(num_devices=len(devices), memory_bytes=min(d.memory_bytes for d in devices), link=link,
                       devices=devices, links=links, data_link=data_link)
    except ValueError as exc:
        raise AutoppError(f"{p}: {exc}") from None


def _load_nodes(p: Path, data: dict[str, Any]) -> Cluster:
    """A version 2 file: nodes x devices per node, links and memory defaulting to the catalog entry "device"."""
    unknown = sorted(set(data) - _NODE_KEYS)
    if unknown:
        raise AutoppError(f"{p}: unknown key {unknown[0]!r}; a cluster file of nodes (version 2) has "
                          f"{sorted(_NODE_KEYS)} (docs/cluster-format.md)")
    spec = _catalog_device(p, data["device"]) if "device" in data else None
    count = _positive(p, data, "nodes", None)
    per_node = _positive(p, data, "devices_per_node", spec.devices_per_node if spec else None)
    if "memory" in data:
        mem = data["memory"]
        try:
            memory = parse_size(mem) if isinstance(mem, str) else _positive(p, data, "memory", None)
        except ValueError as exc:
            raise AutoppError(f"{p}: memory: {exc}") from None
    elif spec is not None:
        memory = spec.memory_bytes
    else:
        raise AutoppError(f"{p}: memory: missing; give each device's memory (e.g. \"80GiB\") or a catalog \"device\"")
    intra, inter = (_node_link(p, data, key, getattr(spec, key).link if spec else None)
                    for key in ("intra_node_link", "inter_node_link"))
    regions = _positive(p, data, "regions", 1)
    if (regions > 1) != ("wan_link" in data):
        raise AutoppError(f"{p}: wan_link: a WAN link joins regions; give it exactly when \"regions\" > 1 "
                          f"(regions {regions})")
    wan = _node_link(p, data, "wan_link", None) if "wan_link" in data else None
    try:
        return hierarchical_cluster(Nodes(count=count, devices_per_node=per_node, intra=intra, inter=inter,
                                          device=spec.name if spec else None, regions=regions, wan=wan), memory)
    except ValueError as exc:
        raise AutoppError(f"{p}: {exc}") from None


def _catalog_device(p: Path, name: Any) -> DeviceSpec:
    """The catalog entry (or device file, relative to the cluster file) named by "device"."""
    if not isinstance(name, str) or not name:
        raise AutoppError(f"{p}: device: expected a catalog name (`autopp devices`), got {name!r}")
    if name.endswith(".json") and not Path(name).is_absolute():
        name = str(p.parent / name)
    try:
        return load_device(name)
    except AutoppError as exc:
        raise AutoppError(f"{p}: device: {exc}") from None


def _positive(p: Path, data: dict[str, Any], key: str, default: int | None) -> int:
    if key not in data:
        if default is None:
            raise AutoppError(f"{p}: {key}: missing; a cluster file of nodes needs it (docs/cluster-format.md)")
        return default
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AutoppError(f"{p}: {key}: expected an integer >= 1, got {value!r}")
    return value


def _node_link(p: Path, data: dict[str, Any], key: str, default: Link | None) -> Link:
    """A node or WAN link: its fields over the catalog device's link, or latency and bandwidth given (overhead and
    progress delay default to 0, `NCCL_COSTS`, as with NCCL between GPUs)."""
    then = "; give it" if key == "wan_link" or default is not None else \
        "; give it, or a catalog \"device\" to default from"
    try:
        return parse_link(data.get(key, {}), key, NCCL_COSTS if default is None else link_fields(default), then)
    except ValueError as exc:
        raise AutoppError(f"{p}: {exc}") from None
