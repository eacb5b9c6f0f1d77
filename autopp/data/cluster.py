"""Devices and links: the hardware a plan is made for, as data (no hard-coded hardware in the cost model)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from .layout import Coords, Layout

__all__ = ["Link", "Device", "Nodes", "Cluster", "DEFAULT_LINK", "GLOO_COSTS", "NCCL_COSTS", "LINK_KEYS",
           "parse_link", "link_fields", "hierarchical_cluster"]


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


#: A link's JSON keys (cluster files, device files).
LINK_KEYS = ("latency_s", "bandwidth_bytes_per_s", "overhead_s", "progress_s")
#: Defaults of a link's CPU costs where messages go over gloo on a CPU host (a version 1 cluster file).
GLOO_COSTS: Mapping[str, float] = {"overhead_s": DEFAULT_LINK.overhead_s, "progress_s": DEFAULT_LINK.progress_s}
#: Defaults where messages move on their own, as NCCL's between GPUs (version 2 cluster files, device files).
NCCL_COSTS: Mapping[str, float] = {"overhead_s": 0.0, "progress_s": 0.0}


def link_fields(link: Link) -> dict[str, float]:
    """`link` as the defaults of `parse_link` (every field)."""
    return asdict(link)


def parse_link(value: object, where: str, defaults: Mapping[str, float], hint: str = "") -> Link:
    """The one reader of a link's JSON object: its numbers over `defaults` (GLOO_COSTS, NCCL_COSTS, or a whole
    link's `link_fields`). ValueError starting with `where` on anything else (`hint` follows a missing key)."""
    if not isinstance(value, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                          for v in value.values()):
        raise ValueError(f"{where}: expected an object of numbers {list(LINK_KEYS)}, got {value!r}")
    unknown = sorted(set(value) - set(LINK_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; a link has {list(LINK_KEYS)}")
    fields = {**defaults, **{k: float(v) for k, v in value.items()}}
    missing = [k for k in LINK_KEYS if k not in fields]
    if missing:
        raise ValueError(f"{where}: missing {missing[0]!r}{hint}")
    try:
        return Link(**fields)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


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
class Nodes:
    """How a cluster's identical devices sit in nodes: `count` nodes of `devices_per_node`, numbered node-major
    (device d is on node d // devices_per_node), joined by `intra` inside a node and `inter` across nodes. Both
    links are per device and per direction (each device has its own NIC share, as in a DGX/HGX node). Optionally
    the nodes form `regions` (in order, equally many each) joined by a slow `wan` link."""

    count: int
    devices_per_node: int
    intra: Link
    """Link between two devices of one node (NVLink class)."""
    inter: Link
    """Link between devices of two nodes of one region (InfiniBand/Ethernet class: one device's NIC share)."""
    device: str | None = None
    """The device kind's catalog name (autopp.data.catalog), when known."""
    regions: int = 1
    """Regions (sites) the nodes are split into: node n is in region n // (count / regions)."""
    wan: Link | None = None
    """Link between devices of two regions (one device's share of the WAN); given exactly when regions > 1."""

    def __post_init__(self) -> None:
        if self.count < 1 or self.devices_per_node < 1:
            raise ValueError(f"need at least 1 node of at least 1 device, got {self.count} nodes x "
                             f"{self.devices_per_node} devices")
        if self.regions < 1 or self.count % self.regions:
            raise ValueError(f"{self.count} nodes do not split into {self.regions} regions of equally many")
        if (self.wan is None) != (self.regions == 1):
            raise ValueError(f"a wan link joins regions: give one exactly when regions > 1 (regions {self.regions})")

    @property
    def links(self) -> tuple[Link, ...]:
        """The link of each level: inside a node, across nodes of a region, across regions."""
        return (self.intra, self.inter) if self.wan is None else (self.intra, self.inter, self.wan)


def _device(pp_rank: int, replica: int, dp: int) -> int:
    """The device of pipeline rank `pp_rank` of replica `replica` on the cluster of pipeline ranks (each group of
    cp x tp devices one rank, `Cluster.tp_groups`): `Layout.rank`, whose numbering does not depend on the pipeline
    degree (pp is outermost)."""
    return Layout(pp=pp_rank + 1, dp=dp).rank(Coords(pp=pp_rank, dp=replica))


@lru_cache(maxsize=4096)
def _hop_level(per_node: int, per_region: int, dp: int, a: int, b: int) -> int:
    """The highest level some replica's transfer between pipeline ranks a and b climbs (`Cluster.placed`'s layout):
    0 inside a node, 1 across nodes, 2 across regions (`per_region`: devices per region)."""
    ends = [(_device(a, j, dp), _device(b, j, dp)) for j in range(dp)]
    if any(x // per_region != y // per_region for x, y in ends):
        return 2
    return 1 if any(x // per_node != y // per_node for x, y in ends) else 0


@lru_cache(maxsize=4096)
def _members(per_node: int, nodes_per_region: int, dp: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """Members per node, by region, of devices rank * dp .. rank * dp + dp - 1 (`Cluster.dp_group`)."""
    first, last = _device(rank, 0, dp), _device(rank, dp - 1, dp)
    regions: dict[int, list[int]] = {}
    for n in range(first // per_node, last // per_node + 1):
        regions.setdefault(n // nodes_per_region, []).append(
            min(last, (n + 1) * per_node - 1) - max(first, n * per_node) + 1)
    return tuple(tuple(counts) for counts in regions.values())


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
    nodes: Nodes | None = None
    """Devices in nodes (`hierarchical_cluster`); None: a flat line. `link` is then the inter-node link, what a
    caller that has not `placed` a configuration gets (the slower link, assumed for every hop)."""
    grid: Layout | None = None
    """The pipeline x data-parallel layout `placed` on a hierarchical cluster: links and groups follow from it."""
    device_kind: str | None = None
    """The device kind's catalog name (autopp.data.catalog), when known (a cluster of nodes: its nodes')."""
    host_bandwidth: float = 0.0
    """Bytes/s per direction between one device and host memory (the catalog's `host_link`: PCIe, NVLink-C2C); 0:
    none known, or the device's memory is the host's (CPU ranks), and activation offload is not offered."""
    memory_reserve_bytes: int = 0
    """What each device keeps beside the plan's tensors (CUDA context, NCCL buffers, fragmentation:
    `catalog.GPU_MEMORY_RESERVE`), already taken from `memory_bytes`; recorded for the plan's notes."""

    def __post_init__(self) -> None:
        self._check_nodes()
        if not 0 <= self.host_bandwidth < math.inf:
            raise ValueError(f"host bandwidth must be finite and >= 0, got {self.host_bandwidth}")
        if self.num_devices < 1:
            raise ValueError(f"need at least 1 device, got {self.num_devices}")
        if self.memory_bytes <= 0:
            raise ValueError(f"device memory must be positive, got {self.memory_bytes}")
        if self.devices and len(self.devices) != self.num_devices:
            raise ValueError(f"{len(self.devices)} devices listed for num_devices={self.num_devices}")
        if self.links and len(self.links) != self.num_devices - 1:
            raise ValueError(f"need {self.num_devices - 1} links between {self.num_devices} devices, "
                             f"got {len(self.links)}")
        if self.order and sorted(self.order) != list(range(self.num_devices)):
            raise ValueError(f"order must be a permutation of 0..{self.num_devices - 1}, got {list(self.order)}")

    def _check_nodes(self) -> None:
        if self.nodes is None:
            if self.grid is not None:
                raise ValueError("a layout is placed on a cluster of nodes only")
            return
        if self.num_devices != self.nodes.count * self.nodes.devices_per_node:
            raise ValueError(f"{self.nodes.count} nodes x {self.nodes.devices_per_node} devices != num_devices "
                             f"{self.num_devices}")
        if self.devices or self.links or self.order or self.data_link is not None:
            raise ValueError("a cluster of nodes has identical devices: no devices, links, order or data_link")
        if self.grid is not None:
            self.grid.check_devices(self.num_devices)

    def placed(self, layout: Layout) -> Cluster:
        """The cluster of pipeline ranks (this one, or its `tp_groups` view) as `layout`'s pipeline x data-parallel
        grid sees it: on a cluster of nodes, pipeline rank r of replica j runs the device `Layout.rank` numbers
        (autopp.data.layout: pp outermost, as torchtitan's and Megatron-LM's meshes lay ranks out); `link_between`
        and `dp_group` then follow where the devices are. A flat cluster is returned as it is."""
        return self if self.nodes is None else replace(self, grid=Layout(pp=layout.pp, dp=layout.dp))

    def dp_group(self, rank: int, dp: int) -> tuple[tuple[int, ...], ...]:
        """Where pipeline rank `rank`'s data-parallel group of `dp` replicas (devices rank * dp .. rank * dp + dp - 1,
        `placed`) lies: per region, its members on each node, in order; () on a flat cluster."""
        if self.nodes is None:
            return ()
        return _members(self.nodes.devices_per_node, self.nodes.count // self.nodes.regions, dp, rank)

    def hop_level(self, a: int, b: int) -> int:
        """On a cluster of nodes `placed` for (pp, dp): how far some replica's transfer between pipeline ranks a and
        b goes: 0 inside its node, 1 to another node, 2 to another region (0 on a flat or unplaced cluster)."""
        if self.nodes is None or self.grid is None:
            return 0
        per_node = self.nodes.devices_per_node
        return _hop_level(per_node, per_node * self.nodes.count // self.nodes.regions, self.grid.dp, a, b)

    @property
    def pipeline_links(self) -> tuple[Link, ...]:
        """Every link a pipeline transfer may take."""
        return (self.link, *self.links, *(self.nodes.links if self.nodes is not None else ()))

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

    def mirror_symmetric(self, pp: int) -> bool:
        """Whether rank r and rank pp - 1 - r have the same device and links (Chimera's up replica of a stage is then
        as fast as its down replica, which the simulator assumes: `simulate`'s `mirror`)."""
        return all(self.device(r) == self.device(pp - 1 - r) for r in range(pp)) and all(
            self.link_between(r, r + 1) == self.link_between(pp - 1 - r, pp - 2 - r) for r in range(pp - 1))

    def link_between(self, a: int, b: int) -> Link:
        """The link carrying a transfer between ranks a and b (links join devices adjacent in the file). On a
        cluster of nodes `placed` for (pp, dp): the link of the highest level any replica's transfer climbs
        (`hop_level`: the slowest replica paces the pipeline): intra-node, inter-node or WAN."""
        if self.nodes is not None and self.grid is not None:
            return self.nodes.links[self.hop_level(a, b)]
        return self.device_link(self.index(a), self.index(b))

    def device_link(self, d: int, e: int) -> Link:
        """The link between devices d and e (indices in the file's order)."""
        return self.links[min(d, e)] if self.links and abs(d - e) == 1 else self.link

    def tp_groups(self, tp: int) -> Cluster:
        """The cluster as a tensor-parallel degree `tp` sees it: each group of `tp` consecutive devices (`Layout.rank`:
        tp innermost) is one pipeline rank, with the memory and speed of one device (a rank's costs are per device,
        sharded). Inside a node when `tp` divides the devices per node; a larger `tp` spans whole nodes, and the
        groups are then joined by the inter-node link only. ValueError when `tp` does not divide the devices or the
        cluster is not homogeneous."""
        if tp == 1:
            return self
        if self.num_devices % tp or not self.homogeneous or self.order:
            raise ValueError(f"tensor parallelism of degree {tp} needs identical devices in groups of {tp}: "
                             f"{self.num_devices} devices" + ("" if self.homogeneous else ", not all alike"))
        groups = self.num_devices // tp
        if self.nodes is None:  # identical devices and links: as many as there are groups
            return replace(self, num_devices=groups, devices=self.devices[:groups], links=self.links[:groups - 1])
        per = self.nodes.devices_per_node
        if per % tp == 0:
            nodes = replace(self.nodes, devices_per_node=per // tp)
        elif tp % per == 0:
            nodes = replace(self.nodes, count=groups, devices_per_node=1, intra=self.nodes.inter)
        else:
            raise ValueError(f"tensor parallelism of degree {tp} neither fits in nor spans whole nodes of {per} "
                             f"devices")
        return replace(self, num_devices=groups, nodes=nodes, grid=None)

    def tp_link(self, tp: int) -> Link:
        """The link a tensor-parallel group of `tp` consecutive devices all-reduces on: the intra-node link when the
        group fits in a node, else the inter-node link; a flat cluster's `link`."""
        if self.nodes is None:
            return self.link
        return self.nodes.intra if self.nodes.devices_per_node % tp == 0 else self.nodes.inter

    def reordered(self, order: tuple[int, ...]) -> Cluster:
        """The same devices and links with pipeline rank r on device order[r]."""
        return replace(self, order=tuple(order))

    @property
    def dp_link(self) -> Link:
        return self.data_link or self.link


def hierarchical_cluster(nodes: Nodes, memory_bytes: int) -> Cluster:
    """`nodes.count` x `nodes.devices_per_node` identical devices of `memory_bytes` each (`Cluster.nodes`); `link`
    is the slowest level's."""
    return Cluster(num_devices=nodes.count * nodes.devices_per_node, memory_bytes=memory_bytes,
                   link=nodes.links[-1], nodes=nodes, device_kind=nodes.device)
