"""Devices and links: the hardware a plan is made for, as data (no hard-coded hardware in the cost model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import AutoppError
from ..jsonio import read_json
from ..sizes import parse_size

__all__ = ["Link", "Device", "Cluster", "DEFAULT_LINK", "load_cluster"]


@dataclass(frozen=True, kw_only=True)
class Link:
    """A point-to-point link between neighbouring ranks."""

    latency_s: float
    """Time to send an empty message."""
    bandwidth_bytes_per_s: float
    """Sustained bandwidth of one transfer."""
    overhead_s: float = 0.0
    """Time each end of a transfer is kept busy by it, besides waiting: the schedule runtime preparing, posting and
    completing one send or receive around a compute action. Unlike latency it occupies the rank, so a rank that
    sends and receives on every action is slowed on every action."""
    progress_s: float = 0.0
    """Longest a message waits for its sender to stop computing (0: messages move while both ends compute, as with
    NCCL). gloo moves a message's bytes on the sender's progress thread; when every core of the host runs a rank,
    the OS runs that thread only once the sender's main thread blocks, or after a scheduling delay of a few ms
    (docs/accuracy.md). The simulator delivers such a message when the sender's run of back-to-back actions ends,
    at most `progress_s` after it could have moved."""

    def __post_init__(self) -> None:
        values = (self.latency_s, self.overhead_s, self.progress_s, self.bandwidth_bytes_per_s)
        if min(values) < 0 or self.bandwidth_bytes_per_s <= 0 or not all(math.isfinite(v) for v in values):
            raise ValueError(f"link needs finite latency, overhead and progress delay >= 0 and bandwidth > 0, got "
                             f"latency {self.latency_s}, bandwidth {self.bandwidth_bytes_per_s}, overhead "
                             f"{self.overhead_s}, progress {self.progress_s}")


#: Assumed gloo-over-loopback link between two processes on one CPU machine, used until links are measured
#: (`autopp profile-links`). The overhead and progress delay are typical of what its calibration fitted on the 2-core
#: development machine with torch 2.13 (40-136 us and 2.2-3.2 ms in nine runs; docs/accuracy.md).
DEFAULT_LINK = Link(latency_s=100e-6, bandwidth_bytes_per_s=2e9, overhead_s=70e-6, progress_s=2.3e-3)


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator."""

    memory_bytes: int
    """Memory available to a plan."""
    speed: float = 1.0
    """Relative compute speed: a stage takes its profiled time / speed."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.speed <= 0:
            raise ValueError(f"device needs memory > 0 and speed > 0, got {self.memory_bytes}, {self.speed}")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """`num_devices` in a line. Identical (`memory_bytes`, `link`) unless `devices` / `links` say otherwise."""

    num_devices: int
    memory_bytes: int
    """Memory of every device when `devices` is empty (else the smallest device's, for messages)."""
    link: Link = DEFAULT_LINK
    """Link between neighbouring devices when `links` is empty, and between non-neighbours always."""
    devices: tuple[Device, ...] = ()
    """Per device, in pipeline order (empty: identical devices)."""
    links: tuple[Link, ...] = ()
    """links[i] joins device i and i + 1 (empty: all `link`)."""
    data_link: Link | None = None
    """Link used by the data-parallel gradient all-reduce (None: `link`)."""
    order: tuple[int, ...] = ()
    """Device index (into `devices`, the file's order) of each pipeline rank; empty: rank r runs device r."""

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"need at least 1 device, got {self.num_devices}")
        if self.memory_bytes <= 0:
            raise ValueError(f"device memory must be positive, got {self.memory_bytes}")
        if self.devices and len(self.devices) != self.num_devices:
            raise ValueError(f"{len(self.devices)} devices listed for num_devices={self.num_devices}")
        if self.links and len(self.links) != self.num_devices - 1:
            raise ValueError(f"need {self.num_devices - 1} links between {self.num_devices} devices, got {len(self.links)}")
        if self.order and sorted(self.order) != list(range(self.num_devices)):
            raise ValueError(f"order must be a permutation of 0..{self.num_devices - 1}, got {list(self.order)}")

    @property
    def homogeneous(self) -> bool:
        """All devices alike and all neighbour links alike."""
        return len(set(self.devices)) <= 1 and len(set(self.links)) <= 1

    def device(self, rank: int) -> Device:
        """Device of pipeline rank `rank`."""
        return self.devices[self.index(rank)] if self.devices else Device(memory_bytes=self.memory_bytes)

    def index(self, rank: int) -> int:
        """Index in `devices` (the file's order) of the device running pipeline rank `rank`."""
        return self.order[rank] if self.order else rank

    def link_between(self, a: int, b: int) -> Link:
        """The link carrying a transfer between ranks a and b (links join devices adjacent in the file)."""
        return self.device_link(self.index(a), self.index(b))

    def device_link(self, d: int, e: int) -> Link:
        """The link between devices d and e (indices in the file's order)."""
        return self.links[min(d, e)] if self.links and abs(d - e) == 1 else self.link

    def reordered(self, order: tuple[int, ...]) -> Cluster:
        """The same devices and links with pipeline rank r on device order[r]."""
        return replace(self, order=tuple(order))

    @property
    def dp_link(self) -> Link:
        return self.data_link or self.link


def _link(d: dict[str, Any], where: str) -> Link:
    if not isinstance(d, dict) or any(isinstance(v, bool) for v in d.values()):
        raise AutoppError(f"{where}: bad link {d!r}: expected numbers")
    try:
        return Link(latency_s=float(d["latency_s"]), bandwidth_bytes_per_s=float(d["bandwidth_bytes_per_s"]),
                    overhead_s=float(d.get("overhead_s", DEFAULT_LINK.overhead_s)),
                    progress_s=float(d.get("progress_s", DEFAULT_LINK.progress_s)))
    except (KeyError, TypeError, ValueError) as exc:
        raise AutoppError(f"{where}: bad link {d!r}: {exc}") from None


def _device(d: dict[str, Any], where: str) -> Device:
    if not isinstance(d, dict) or any(isinstance(v, bool) for v in d.values()):
        raise AutoppError(f"{where}: bad device {d!r}: expected an object with \"memory\" (and \"speed\")")
    try:
        mem = d["memory"]
        return Device(memory_bytes=parse_size(mem) if isinstance(mem, str) else int(mem), speed=float(d.get("speed", 1.0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise AutoppError(f"{where}: bad device {d!r}: {exc}") from None


#: Keys of a cluster file.
_KEYS = {"devices", "link", "links", "data_link"}


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster JSON file (format in docs/cluster-format.md)."""
    p = Path(path)
    data = read_json(p, "cluster file", advice="see docs/cluster-format.md")
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list) or not data["devices"]:
        raise AutoppError(f"{p}: a cluster file needs a non-empty \"devices\" list")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise AutoppError(f"{p}: unknown key {unknown[0]!r}; a cluster file has {sorted(_KEYS)} "
                          "(docs/cluster-format.md)")
    devices = tuple(_device(d, f"{p}: devices[{i}]") for i, d in enumerate(data["devices"]))
    link = _link(data["link"], f"{p}: link") if "link" in data else DEFAULT_LINK
    if "links" in data and (not isinstance(data["links"], list) or len(data["links"]) != len(devices) - 1):
        given = len(data["links"]) if isinstance(data["links"], list) else type(data["links"]).__name__
        raise AutoppError(f"{p}: \"links\" must list the {len(devices) - 1} links between neighbouring devices "
                          f"(links[i] joins devices i and i + 1), got {given}; leave it out to use \"link\" for all")
    links = tuple(_link(d, f"{p}: links[{i}]") for i, d in enumerate(data.get("links", [])))
    data_link = _link(data["data_link"], f"{p}: data_link") if "data_link" in data else None
    try:
        return Cluster(num_devices=len(devices), memory_bytes=min(d.memory_bytes for d in devices), link=link,
                       devices=devices, links=links, data_link=data_link)
    except ValueError as exc:
        raise AutoppError(f"{p}: {exc}") from None
