"""Measure point-to-point latency and bandwidth between ranks on this machine, fit `latency + bytes / bandwidth`, and
store it as JSON (docs/links-format.md) from which `autopp.cluster.Link` is built with `load_link`."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

from .cluster import DEFAULT_LINK, Link
from .errors import AutoppError
from .jsonio import write_json

__all__ = ["LINKS_VERSION", "DEFAULT_MESSAGE_BYTES", "PairFit", "LinkProfile", "fit_link", "measure_links",
           "load_link", "load_links"]

LINKS_VERSION = 1
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
    version: int = LINKS_VERSION

    def link(self) -> Link:
        """The fitted link; its per-message overhead is not measured here and stays the default's (DEFAULT_LINK)."""
        return Link(latency_s=self.latency_s, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
                    overhead_s=DEFAULT_LINK.overhead_s)

    def save(self, path: str | Path) -> Path:
        """Write the links JSON atomically."""
        return write_json(path, asdict(self))


def fit_link(message_bytes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares `t = latency + bytes / bandwidth` (latency clamped at 0, bandwidth from a positive slope)."""
    if len(message_bytes) != len(seconds) or len(set(message_bytes)) < 2:
        raise ValueError(f"need times at >= 2 distinct message sizes, got sizes {list(message_bytes)}")
    n = len(seconds)
    mx, my = sum(message_bytes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in message_bytes)
    slope = sum((x - mx) * (y - my) for x, y in zip(message_bytes, seconds)) / sxx
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_links(ranks: int, message_bytes: Sequence[int] = DEFAULT_MESSAGE_BYTES, warmup: int = 3,
                  repeats: int = 10, timeout_s: float = 120.0) -> LinkProfile:
    """Start `ranks` local processes (gloo on CPU, NCCL when CUDA is available), time neighbour ping-pongs of each
    message size, and fit latency and bandwidth per pair and over all pairs."""
    if ranks < 2:
        raise ValueError(f"need at least 2 ranks to measure a link, got {ranks}")
    sizes = sorted(set(int(n) for n in message_bytes))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, sizes, warmup, repeats, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    results: dict[int, dict[int, list[list[float]]]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < ranks:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AutoppError(f"measuring links on {ranks} ranks took over {timeout_s:g} s; stopped")
            try:
                rank, times, error = queue.get(timeout=min(remaining, 1.0))
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise AutoppError(f"rank {procs.index(dead[0])} exited with code {dead[0].exitcode}") from None
                continue
            if error:
                raise AutoppError(f"rank {rank} failed while measuring links: {error}")
            results[rank] = times
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return _summarise(results, ranks, sizes, repeats)


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
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise AutoppError(f"{p}: cannot read links file: {exc}") from exc
    if not isinstance(data, dict) or data.get("version") != LINKS_VERSION:
        version = data.get("version") if isinstance(data, dict) else None
        raise AutoppError(f"{p}: links file version {version!r} is not {LINKS_VERSION}")
    try:
        pairs = tuple(PairFit(**{**q, "seconds": tuple(q["seconds"]), "spread_s": tuple(q["spread_s"])})
                      for q in data["pairs"])
        profile = LinkProfile(**{**data, "pairs": pairs, "message_bytes": tuple(data["message_bytes"])})
        profile.link()
    except KeyError as exc:
        raise AutoppError(f"{p}: bad links file: missing field {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise AutoppError(f"{p}: bad links file: {exc}") from exc
    return profile


def load_link(path: str | Path) -> Link:
    """The Link (latency, bandwidth fitted over all neighbour pairs) stored in a links file."""
    return load_links(path).link()
