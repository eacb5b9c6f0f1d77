"""Measure the link between ranks on this machine and store it as JSON (docs/links-format.md), from which
`autopp.data.cluster.Link` is built with `load_link`.

A ping-pong times messages between idle ranks and fits `latency + bytes / bandwidth`. But in a pipeline the ranks
compute while messages move, and on a CPU host whose cores all run ranks two more costs appear (docs/accuracy.md):
each message keeps its rank busy a little (`Link.overhead_s`), and gloo moves a message only once the sender's
progress thread gets a core, which the OS grants when the sender's main thread blocks or after a scheduling delay
(`Link.progress_s`). Those are calibrated by running torch's own schedules on synthetic stages
(`autopp.run.calibrate.calibrate_links`, fitted by autopp.measure.calibration) and stored here beside the fit.

This module imports torch only inside the measuring functions: loading a links file (`autopp plan --links`) stays
torch-free."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

from ..data.cluster import DEFAULT_LINK, Link
from ..errors import AutoppError
from ..jsonio import read_json, write_json
from ..spawn import spawn_local
from ..schedule import ScheduleName
from .calibration import CalibrationRow

__all__ = ["LINKS_VERSION", "READABLE_VERSIONS", "DEFAULT_MESSAGE_BYTES", "PairFit", "LinkProfile", "fit_link",
           "measure_links", "load_link", "load_links"]

LINKS_VERSION = 2
#: Versions load_links reads (1: before the calibration; its overhead and progress delay are the defaults).
READABLE_VERSIONS = (1, 2)
#: Message sizes sent between neighbours by default: from latency-bound to bandwidth-bound.
DEFAULT_MESSAGE_BYTES = (4, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


@dataclass(frozen=True)
class PairFit:
    """One-way times between neighbouring ranks `src` and `dst` (median per size), and their fit."""

    src: int
    dst: int
    seconds: tuple[float, ...]
    spread_s: tuple[float, ...]
    latency_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class LinkProfile:
    """What `autopp profile-links` writes: per-pair times and one fit over all pairs."""

    backend: str
    device: str
    ranks: int
    message_bytes: tuple[int, ...]
    repeats: int
    pairs: tuple[PairFit, ...]
    latency_s: float
    bandwidth_bytes_per_s: float
    overhead_s: float | None = None
    """Fitted per-message overhead (None: not calibrated, DEFAULT_LINK's is used)."""
    progress_s: float | None = None
    """Fitted progress delay (None: not calibrated, DEFAULT_LINK's is used; 0 for NCCL)."""
    calibration: tuple[CalibrationRow, ...] = ()
    """The synthetic pipelines the overhead and progress delay were fitted to, with the fitted predictions."""
    calibration_rms: float | None = None
    """Root mean square relative error of the calibration rows under the fitted link."""
    version: int = LINKS_VERSION

    def link(self) -> Link:
        """The measured link: fitted latency and bandwidth, and the calibrated overhead and progress delay (the
        defaults' where not calibrated)."""
        return Link(latency_s=self.latency_s, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
                    overhead_s=DEFAULT_LINK.overhead_s if self.overhead_s is None else self.overhead_s,
                    progress_s=DEFAULT_LINK.progress_s if self.progress_s is None else self.progress_s)

    def save(self, path: str | Path) -> Path:
        """Write the links JSON atomically."""
        data = asdict(self)
        for row in data["calibration"]:
            row["schedule"] = row["schedule"].value
        return write_json(path, data)


def fit_link(message_bytes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """`t = latency + bytes / bandwidth` by least squares on the relative error (weights 1 / t^2), so that the
    microsecond times of small messages count as much as the milliseconds of large ones (latency clamped at 0,
    bandwidth from a positive slope)."""
    if len(message_bytes) != len(seconds) or len(set(message_bytes)) < 2:
        raise ValueError(f"need times at >= 2 distinct message sizes, got sizes {list(message_bytes)}")
    if min(seconds) <= 0:
        raise ValueError(f"times must be > 0, got {list(seconds)}")
    weights = [1.0 / (y * y) for y in seconds]
    total = sum(weights)
    mx = sum(w * x for w, x in zip(weights, message_bytes)) / total
    my = sum(w * y for w, y in zip(weights, seconds)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(weights, message_bytes))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, message_bytes, seconds)) / sxx
    if slope <= 0:
        raise ValueError(f"times do not grow with message size ({list(seconds)}): cannot fit a bandwidth")
    return max(0.0, my - slope * mx), 1.0 / slope


def _pair_times(rank: int, world: int, sizes: Sequence[int], warmup: int, repeats: int, device: Any
                ) -> dict[int, list[list[float]]]:
    """Ping-pong between each neighbour pair in turn; the lower rank of a pair keeps one-way times (round trip / 2)."""
    import torch
    import torch.distributed as dist
    out: dict[int, list[list[float]]] = {}
    for src in range(world - 1):
        dist.barrier()
        if rank not in (src, src + 1):
            continue
        peer = src + 1 if rank == src else src
        per_size = []
        for nbytes in sizes:
            buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
            times = []
            for i in range(warmup + repeats):
                t0 = time.perf_counter()
                if rank == src:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) / 2)
            per_size.append(times)
        if rank == src:
            out[src] = per_size
    return out


def _worker(rank: int, world: int, port: int, sizes: Sequence[int], warmup: int, repeats: int,
            queue: Any) -> None:
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        try:
            queue.put((rank, _pair_times(rank, world, sizes, warmup, repeats, device), None))
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # reported to the parent, which raises
        queue.put((rank, {}, f"{type(exc).__name__}: {exc}"))


def measure_links(ranks: int, message_bytes: Sequence[int] = DEFAULT_MESSAGE_BYTES, warmup: int = 3,
                  repeats: int = 10, timeout_s: float = 120.0) -> LinkProfile:
    """Start `ranks` local processes (gloo on CPU, NCCL when CUDA is available), time neighbour ping-pongs of each
    message size, and fit latency and bandwidth per pair and over all pairs. NCCL links get no progress delay and
    the default overhead; a gloo link's overhead and progress delay are left uncalibrated (None: the defaults) for
    `autopp.run.calibrate.calibrate_links` to fit."""
    if ranks < 2:
        raise ValueError(f"need at least 2 ranks to measure a link, got {ranks}")
    import torch  # only here: the module is read without torch (autopp.cli)
    sizes = sorted(set(int(n) for n in message_bytes))
    results = spawn_local(_worker, ranks, (sizes, warmup, repeats), timeout_s, "measuring links",
                          fork=not torch.cuda.is_available())  # NCCL ranks as new interpreters, as `autopp run`'s
    profile = _summarise(results, ranks, sizes, repeats)
    return profile if profile.backend == "gloo" else replace(profile, progress_s=0.0)


def _summarise(results: dict[int, dict[int, list[list[float]]]], ranks: int, sizes: list[int],
               repeats: int) -> LinkProfile:
    import torch
    pairs = []
    for src in range(ranks - 1):
        per_size = results[src][src]
        medians = tuple(statistics.median(t) for t in per_size)
        latency, bandwidth = fit_link(sizes, medians)
        pairs.append(PairFit(src, src + 1, medians, tuple(max(t) - min(t) for t in per_size), latency, bandwidth))
    latency, bandwidth = fit_link([n for _ in pairs for n in sizes], [t for p in pairs for t in p.seconds])
    cuda = torch.cuda.is_available()
    return LinkProfile(backend="nccl" if cuda else "gloo", device=torch.cuda.get_device_name(0) if cuda else "cpu",
                       ranks=ranks, message_bytes=tuple(sizes), repeats=repeats, pairs=tuple(pairs),
                       latency_s=latency, bandwidth_bytes_per_s=bandwidth)


def load_links(path: str | Path) -> LinkProfile:
    """Read a links file written by `autopp profile-links`; reject another version or missing fields."""
    p = Path(path)
    data = read_json(p, "links file", advice="measure it again with `autopp profile-links`")
    if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
        version = data.get("version") if isinstance(data, dict) else None
        raise AutoppError(f"{p}: links file version {version!r} is not one of {list(READABLE_VERSIONS)}")
    try:
        pairs = tuple(PairFit(**{**q, "seconds": tuple(q["seconds"]), "spread_s": tuple(q["spread_s"])})
                      for q in data["pairs"])
        rows = tuple(CalibrationRow(**{**r, "schedule": ScheduleName(r["schedule"]), "forward_s": tuple(r["forward_s"]),
                                       "backward_s": tuple(r["backward_s"])})
                     for r in data.get("calibration", ()))
        profile = LinkProfile(**{**data, "pairs": pairs, "message_bytes": tuple(data["message_bytes"]),
                                 "calibration": rows, "version": LINKS_VERSION})
        profile.link()
    except KeyError as exc:
        raise AutoppError(f"{p}: bad links file: missing field {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise AutoppError(f"{p}: bad links file: {exc}") from exc
    return profile


def load_link(path: str | Path) -> Link:
    """The Link (latency, bandwidth fitted over all neighbour pairs) stored in a links file."""
    return load_links(path).link()
