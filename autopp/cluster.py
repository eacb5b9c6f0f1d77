"""Devices and links: the hardware a plan is made for, as data (no hard-coded hardware in the cost model)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Link", "Cluster", "DEFAULT_LINK"]


@dataclass(frozen=True, kw_only=True)
class Link:
    """A point-to-point link between neighbouring ranks."""

    latency_s: float
    """Time to send an empty message."""
    bandwidth_bytes_per_s: float
    """Sustained bandwidth of one transfer."""

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"link needs latency >= 0 and bandwidth > 0, got {self.latency_s}, {self.bandwidth_bytes_per_s}")

    def transfer_s(self, nbytes: float) -> float:
        """Time to send `nbytes` (0 for nothing to send)."""
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bandwidth_bytes_per_s


#: Assumed gloo-over-loopback link between two processes on one CPU machine, used until links are measured.
DEFAULT_LINK = Link(latency_s=100e-6, bandwidth_bytes_per_s=2e9)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Identical devices in a line: `num_devices` of `memory_bytes` each, neighbours joined by `link`."""

    num_devices: int
    memory_bytes: int
    link: Link = DEFAULT_LINK

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"need at least 1 device, got {self.num_devices}")
        if self.memory_bytes <= 0:
            raise ValueError(f"device memory must be positive, got {self.memory_bytes}")
