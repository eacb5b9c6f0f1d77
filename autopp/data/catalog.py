"""The device catalog: peak FLOP/s, memory bandwidth, memory and links of GPUs (and this CPU) as data files.

One JSON file per device under autopp/data/devices/ (format in docs/devices.md); vendor figures are dense (no 2:4
sparsity), and every file names its source. `plan --device NAME` builds its cluster from an entry, the analytic
profile turns FLOPs and bytes into seconds with one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import AutoppError
from ..jsonio import read_json
from .cluster import NCCL_COSTS, Cluster, Link, Nodes, hierarchical_cluster, parse_link
from .fields import Fields

__all__ = ["DeviceLink", "DeviceSpec", "LinkOverrides", "DTYPES", "load_device", "device_names", "identify_device",
           "cluster_from_catalog", "device_mismatch", "planned_device", "GPU_MEMORY_RESERVE"]

#: Memory a GPU of the catalog keeps from the plan (`DeviceSpec.memory_reserve_bytes`): what a training process
#: holds beside its tensors. About 0.5 GiB of CUDA context, kernels and cuBLAS workspaces (with CUDA's lazy module
#: loading, the default since CUDA 11.7; torch docs "CUDA semantics": the context "can take up to a few hundred MiB"
#: before any tensor), about 1 GiB of NCCL buffers (NCCL docs, NCCL_BUFFSIZE: 4 MiB per channel and peer, for each of
#: a run's communicators: pipeline, data-parallel and tensor-parallel groups), and about 1.5 GiB (2 % of an 80 GB
#: device) lost to the caching allocator's block rounding and fragmentation (torch docs "CUDA semantics", memory
#: management: reserved above allocated). An estimate to be replaced by a measurement on a lent device; `autopp plan
#: --memory-reserve` changes it. CPU ranks (`memory_shared`) keep none: their plans stay as before the reserve.
GPU_MEMORY_RESERVE = 3 * 2**30

#: The dtype names a device's `peak_flops` may have (torch's names, but "tf32": float32 matmuls on tensor cores).
DTYPES = ("float32", "tf32", "bfloat16", "float16", "float8")


@dataclass(frozen=True, kw_only=True)
class DeviceLink:
    """A device's link to a pipeline neighbour, within a node or to another node: what it is, and its figures."""

    kind: str
    """What it is, e.g. "NVLink 4 via NVSwitch" or "InfiniBand NDR 400 Gb/s, one NIC per GPU"."""
    link: Link
    """Its figures: bandwidth per direction, per device (a vendor's "900 GB/s bidirectional" NVLink is 450e9 here);
    latency assumed (of the order of NCCL's small-message latency; not a vendor figure); overhead and progress delay
    0 unless the file gives them (NCCL_COSTS: messages move on their own)."""


@dataclass(frozen=True, kw_only=True)
class LinkOverrides:
    """Figures that replace a catalog entry's in `cluster_from_catalog` (None: the entry's)."""

    intra_bandwidth: float | None = None
    """Intra-node link bandwidth, bytes/s per direction per device."""
    inter_bandwidth: float | None = None
    """Inter-node link bandwidth (one device's NIC share)."""
    latency_s: float | None = None
    """Latency of the one link of a flat cluster (all devices in one node); refused across nodes."""
    bandwidth: float | None = None
    """Bandwidth of the one link of a flat cluster; refused across nodes."""
    overhead_s: float | None = None
    """Every link's per-message overhead."""
    progress_s: float | None = None
    """Every link's progress delay."""


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One device kind of the catalog."""

    name: str
    """Catalog name: the data file's stem, e.g. "h100-sxm"."""
    vendor: str
    """"NVIDIA", "AMD", or the CPU's vendor."""
    model: str
    """Full product name, e.g. "NVIDIA H100 SXM5 80GB"."""
    memory_bytes: int
    """Device memory (cpu: the machine's physical memory, shared by all ranks on it: `memory_shared`)."""
    memory_bandwidth_bytes_per_s: float
    """Peak DRAM/HBM bandwidth (cpu: measured one-thread copy, bytes read + written per second)."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by dtype name (DTYPES; only those the vendor gives). "float32" is non-tensor-core FP32,
    "tf32" float32 matmuls on tensor cores. Never with 2:4 sparsity."""
    intra_node_link: DeviceLink
    """Link between two devices of one node (NVLink, Infinity Fabric, PCIe)."""
    inter_node_link: DeviceLink
    """Link between devices of two nodes (the NIC share of one device)."""
    devices_per_node: int
    """Devices in a typical node (DGX/HGX: 8)."""
    source: str
    """Where the figures come from: the vendor document's title and URL (cpu: the command that measured them)."""
    torch_names: tuple[str, ...] = ()
    """Substrings of a profile's `device` ("cuda (NVIDIA H100 80GB HBM3)") that identify this device."""
    notes: str = ""
    """Assumptions and caveats (which figures are assumed, how sparse figures were halved)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the file records (cpu: the measured table)."""
    memory_shared: bool = False
    """`memory_bytes` is the host's, shared by the devices of a node (CPU ranks): a cluster gives each device
    memory_bytes / the devices on its node (`cluster_from_catalog`)."""
    host_link: DeviceLink | None = None
    """Link between one device and host memory (PCIe, NVLink-C2C), what activation offload moves bytes over (None:
    not known). A device whose memory is the host's (`memory_shared`) may name a memory copy here, but a cluster
    gives it no host link (`Cluster.host_bandwidth` 0): offloading would move bytes within the same memory."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or not self.memory_bandwidth_bytes_per_s > 0 \
                or not math.isfinite(self.memory_bandwidth_bytes_per_s):
            raise ValueError(f"device {self.name!r} needs memory > 0 and a finite memory bandwidth > 0, got "
                             f"{self.memory_bytes} bytes, {self.memory_bandwidth_bytes_per_s} B/s")
        if self.devices_per_node < 1:
            raise ValueError(f"device {self.name!r} needs devices_per_node >= 1, got {self.devices_per_node}")
        unknown = sorted(set(self.peak_flops) - set(DTYPES))
        if unknown or not self.peak_flops:
            raise ValueError(f"device {self.name!r}: peak_flops needs dtypes among {list(DTYPES)}, got "
                             f"{sorted(self.peak_flops)}")
        bad = {k: v for k, v in self.peak_flops.items() if not (math.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"device {self.name!r}: peak FLOP/s must be finite and > 0, got {bad}")

    @property
    def memory_reserve_bytes(self) -> int:
        """Memory a process on this device keeps from the plan: `GPU_MEMORY_RESERVE` on a GPU, 0 on CPU ranks."""
        return 0 if self.memory_shared else GPU_MEMORY_RESERVE

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` (a DTYPES name, or torch's "torch.bfloat16")."""
        key = dtype.removeprefix("torch.")
        if key not in self.peak_flops:
            raise AutoppError(f"device {self.name!r} has no peak FLOP/s for {key!r}; "
                              f"it lists {sorted(self.peak_flops)}")
        return self.peak_flops[key]

    def ridge_point(self, dtype: str) -> float:
        """FLOP per byte of memory traffic where the roofline turns: peak(dtype) / memory bandwidth."""
        return self.peak(dtype) / self.memory_bandwidth_bytes_per_s


#: Keys of a device file (docs/devices.md); "name" is the file's stem.
_KEYS = {"vendor", "model", "memory", "memory_bandwidth_bytes_per_s", "peak_flops", "intra_node_link",
         "inter_node_link", "devices_per_node", "source", "torch_names", "notes", "extra", "memory_shared",
         "host_link"}
_REQUIRED = _KEYS - {"torch_names", "notes", "extra", "memory_shared", "host_link"}
_ADVICE = "see docs/devices.md"


def _catalog_dir() -> Path:
    return Path(str(resources.files("autopp.data").joinpath("devices")))


def device_names() -> list[str]:
    """The catalog's device names, sorted."""
    return sorted(p.stem for p in _catalog_dir().glob("*.json"))


def load_device(name: str) -> DeviceSpec:
    """The catalog entry `name`, or a device file in the same format when `name` ends in .json."""
    if name.endswith(".json"):
        return _parse(Path(name))
    path = _catalog_dir() / f"{name}.json"
    if not path.is_file():
        raise AutoppError(f"unknown device {name!r}; the catalog has {', '.join(device_names())} "
                          "(or give a device JSON file, docs/devices.md)")
    return _parse(path)


def identify_device(profile_device: str) -> str | None:
    """The catalog name whose `torch_names` occur in a profile's device string, or None. A CPU profile's string
    ("cpu (x86_64)": `platform.processor()` or the machine, no model name) matches the `cpu` entry whatever CPU it
    was measured on: that entry's figures are this machine's (docs/devices.md)."""
    text = profile_device.lower()
    for name in device_names():
        if any(t.lower() in text for t in load_device(name).torch_names):
            return name
    return None


def planned_device(cluster: Cluster, profile_device: str, analytic_device: str | None = None) -> str | None:
    """The catalog name of the device kind a plan is for: the cluster's (`--device`, a cluster file's "device"),
    else the one the profile is analytic for, else the one it was measured on (`identify_device`); None if unknown."""
    return cluster.device_kind or analytic_device or identify_device(profile_device)


def cluster_from_catalog(spec: DeviceSpec, devices: int | None = None, *, nodes: int | None = None,
                         devices_per_node: int | None = None, memory_bytes: int | None = None,
                         overrides: LinkOverrides = LinkOverrides(), memory_reserve: int | None = None) -> Cluster:
    """`devices` of `spec` (or `nodes` x devices per node), with the catalog's memory and links unless given. All in
    one node: a flat Cluster on the intra-node link. Whole nodes: a cluster of nodes (`Cluster.nodes`): each pipeline
    hop and all-reduce on the link it crosses. A partly filled last node is refused (AutoppError suggesting whole
    nodes): no cluster of nodes models it, and a flat one would price every hop alike. Each device's memory is less
    `memory_reserve` (None: the device's `memory_reserve_bytes` of the catalog's memory, none of a `memory_bytes`
    given, which is what the plan may use), recorded as `Cluster.memory_reserve_bytes`."""
    per_node = devices_per_node or spec.devices_per_node
    count = _device_count(spec, devices, nodes, per_node)
    intra = _with(spec.intra_node_link.link, overrides, overrides.intra_bandwidth)
    inter = _with(spec.inter_node_link.link, overrides, overrides.inter_bandwidth)
    memory = memory_bytes or (spec.memory_bytes // min(count, per_node) if spec.memory_shared else spec.memory_bytes)
    host = 0.0 if spec.host_link is None or spec.memory_shared else spec.host_link.link.bandwidth_bytes_per_s
    default = spec.memory_reserve_bytes if memory_bytes is None else 0  # a memory given is what the plan may use
    reserve = default if memory_reserve is None else memory_reserve
    if reserve >= memory:
        raise AutoppError(f"a memory reserve of {reserve / 2**30:.3g} GiB leaves nothing of the {memory / 2**30:.3g} "
                          f"GiB per {spec.name}: give a smaller `memory_reserve`")
    memory -= reserve
    try:
        if count <= per_node:
            flat = replace(intra, bandwidth_bytes_per_s=overrides.bandwidth or intra.bandwidth_bytes_per_s,
                           latency_s=intra.latency_s if overrides.latency_s is None else overrides.latency_s)
            return Cluster(num_devices=count, memory_bytes=memory, link=flat, device_kind=spec.name,
                           host_bandwidth=host, memory_reserve_bytes=reserve)
        if overrides.latency_s is not None or overrides.bandwidth:
            raise AutoppError(f"`latency_s`/`bandwidth` set the one link of a flat cluster; {count} devices span "
                              f"{-(-count // per_node)} nodes: give `intra_bandwidth` / `inter_bandwidth`")
        return replace(hierarchical_cluster(Nodes(count=count // per_node, devices_per_node=per_node, intra=intra,
                                                  inter=inter, device=spec.name), memory), host_bandwidth=host,
                       memory_reserve_bytes=reserve)
    except ValueError as exc:
        raise AutoppError(f"device {spec.name!r}: {exc}") from None


def _device_count(spec: DeviceSpec, devices: int | None, nodes: int | None, per_node: int) -> int:
    """Devices in all: `devices`, or `nodes` x `per_node` (both given: they must agree), filling whole nodes."""
    count = devices or (nodes * per_node if nodes else None)
    if count is None:
        raise AutoppError(f"give `devices` N or `nodes` N with `device` {spec.name} ({per_node} devices per node)")
    if nodes and count != nodes * per_node:
        raise AutoppError(f"`devices` {count} != `nodes` {nodes} x {per_node} devices per node "
                          f"({nodes * per_node}); give one of them")
    if count > per_node and count % per_node:
        whole = max(k for k in range(1, per_node + 1) if count % k == 0)
        split = f"`nodes` {count // whole} `devices_per_node` {whole}, or " if whole > 1 else ""
        below, above = count // per_node * per_node, -(-count // per_node) * per_node
        raise AutoppError(f"{count} devices of {spec.name} leave the last node of {per_node} partly filled; plan "
                          f"whole nodes: {split}`devices` {below} or {above}")
    return count


def _with(link: Link, overrides: LinkOverrides, bandwidth: float | None) -> Link:
    """`link` with `bandwidth` and the overrides' per-message CPU costs, where given."""
    return replace(link, bandwidth_bytes_per_s=bandwidth or link.bandwidth_bytes_per_s,
                   overhead_s=link.overhead_s if overrides.overhead_s is None else overrides.overhead_s,
                   progress_s=link.progress_s if overrides.progress_s is None else overrides.progress_s)


def _parse(path: Path) -> DeviceSpec:
    """A device file read and checked: every error names the file and the field."""
    f = Fields(str(path), advice=_ADVICE)
    data = f.keys(read_json(path, "device file", advice=_ADVICE), _KEYS, _REQUIRED, listed=True)
    try:
        return DeviceSpec(
            name=path.stem, vendor=f.string(data["vendor"], "vendor"), model=f.string(data["model"], "model"),
            memory_bytes=f.size(data["memory"], "memory"),
            memory_bandwidth_bytes_per_s=float(f.number(data["memory_bandwidth_bytes_per_s"],
                                                        "memory_bandwidth_bytes_per_s", positive=True)),
            peak_flops=_peaks(data["peak_flops"], f),
            intra_node_link=_link(data["intra_node_link"], "intra_node_link", f),
            inter_node_link=_link(data["inter_node_link"], "inter_node_link", f),
            devices_per_node=f.integer(data["devices_per_node"], "devices_per_node", 1),
            source=f.string(data["source"], "source"),
            torch_names=f.strings(data.get("torch_names", []), "torch_names", empty_ok=False),
            notes=str(data.get("notes", "")), extra=dict(data.get("extra", {})),
            memory_shared=f.flag(data.get("memory_shared", False), "memory_shared"),
            host_link=_link(data["host_link"], "host_link", f) if "host_link" in data else None)
    except (ValueError, TypeError) as exc:  # the links' figures, the dtypes, DeviceSpec's own checks
        f.fail(str(exc))


def _peaks(value: Any, f: Fields) -> dict[str, float]:
    if not isinstance(value, dict):
        f.bad("peak_flops", "an object of dtype: FLOP/s", value)
    return {str(k): float(f.number(v, f"peak_flops.{k}", positive=True)) for k, v in value.items()}


def _link(value: Any, name: str, f: Fields) -> DeviceLink:
    """A device file's link: "kind" and a link's numbers (`parse_link`; overhead and progress default to 0)."""
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str) or not value["kind"].strip():
        f.bad(name, "an object with \"kind\", \"bandwidth_bytes_per_s\", \"latency_s\"", value)
    numbers = {k: v for k, v in value.items() if k != "kind"}
    return DeviceLink(kind=value["kind"], link=parse_link(numbers, name, NCCL_COSTS))


def device_mismatch(name: str, profile_device: str, analytic_device: str | None = None) -> str | None:
    """Why a profile's times are not catalog device `name`'s (None when they are): it was measured on another device
    (its `device` string, matched by `identify_device`) or is analytic for another one."""
    if analytic_device:
        if analytic_device == name:
            return None
        where = f"is analytic for {analytic_device}"
    else:
        if identify_device(profile_device) == name:
            return None
        where = f"was measured on {profile_device}"
    return (f"the profile {where}, not {name}: its times are that device's, memory and links come from {name} "
            f"(profile with `analytic` {name} for {name}'s times)")
