"""`autopp devices`: the device catalog as a table, or one entry in full."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlparse

from ..data.catalog import DeviceLink, DeviceSpec, device_names, load_device
from ..sizes import format_size

__all__ = ["add_parser", "format_catalog", "format_device", "ridge_dtype"]


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The `devices` command."""
    p = sub.add_parser("devices", help="list the device catalog (peak FLOP/s, memory, bandwidth, links, sources)")
    p.add_argument("name", nargs="?", help="print this entry in full (a catalog name, or a device JSON file)")
    p.set_defaults(func=_cmd_devices)


def _cmd_devices(args: argparse.Namespace) -> int:
    if args.name:
        print(format_device(load_device(args.name)))
    else:
        print(format_catalog([load_device(n) for n in device_names()]))
    return 0


def _flops(spec: DeviceSpec, dtype: str) -> str:
    value = spec.peak_flops.get(dtype)
    return "-" if value is None else f"{value / 1e12:.4g}"


def _gbs(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.4g}"


def _source_short(spec: DeviceSpec) -> str:
    """The source's first web host, or its first words."""
    for word in spec.source.split():
        host = urlparse(word.strip("(),")).netloc
        if host:
            return host
    return spec.source.split(":")[0][:30]


_SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "float8": "fp8"}


def ridge_dtype(spec: DeviceSpec) -> str:
    """The dtype of the catalog table's ridge column: the faster of bfloat16 and float32 on `spec` (bf16 on the GPUs,
    float32 on a CPU without bf16 units)."""
    given = [d for d in ("bfloat16", "float32") if d in spec.peak_flops]
    return max(given, key=spec.peak) if given else max(spec.peak_flops, key=spec.peak)


def _ridge(spec: DeviceSpec) -> str:
    dtype = ridge_dtype(spec)
    return f"{spec.ridge_point(dtype):.3g} {_SHORT.get(dtype, dtype)}"


def format_catalog(specs: list[DeviceSpec]) -> str:
    """One row per device: dense TFLOP/s, memory, GB/s per direction of each link, the source's host."""
    head = ("device", "memory", "mem GB/s", "bf16 TF", "fp32 TF", "ridge", "intra GB/s", "inter GB/s", "per node",
            "source")
    rows = [(s.name, f"{s.memory_bytes / 1e9:.4g} GB = {format_size(s.memory_bytes)}",
             _gbs(s.memory_bandwidth_bytes_per_s), _flops(s, "bfloat16"),
             _flops(s, "float32"), _ridge(s), _gbs(s.intra_node_link.link.bandwidth_bytes_per_s),
             _gbs(s.inter_node_link.link.bandwidth_bytes_per_s),
             str(s.devices_per_node), _source_short(s)) for s in specs]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i in (0, len(head) - 1) else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in (head, *rows)]
    return "\n".join([*lines, "", "TF: dense peak TFLOP/s (no sparsity); memory in the vendor's GB (1e9 bytes) and "
                      "in GiB (2^30 bytes), the unit autopp prints; --memory takes either (80GB or 74.5GiB); "
                      "ridge: FLOP per byte of memory traffic in the faster of bf16 and fp32 (named); "
                      "link GB/s per direction per device. `autopp devices NAME` for an entry's links and sources."])


def _link_line(label: str, device_link: DeviceLink) -> str:
    link = device_link.link
    extra = (f", overhead {link.overhead_s * 1e6:g} us, progress delay {link.progress_s * 1e3:g} ms"
             if link.overhead_s or link.progress_s else "")
    return (f"{label:<18}{device_link.kind}: {_gbs(link.bandwidth_bytes_per_s)} GB/s per direction, latency "
            f"{link.latency_s * 1e6:g} us{extra}")


def format_device(spec: DeviceSpec) -> str:
    """Every field of one entry."""
    peaks = ", ".join(f"{k} {v / 1e12:.4g}" for k, v in spec.peak_flops.items())
    ridges = ", ".join(f"{k} {spec.ridge_point(k):.3g}" for k in spec.peak_flops)
    lines = [f"{spec.name}: {spec.model} ({spec.vendor})",
             f"{'memory':<18}{spec.memory_bytes / 1e9:.4g} GB = {format_size(spec.memory_bytes)} "
             f"({spec.memory_bytes:,} bytes)",
             f"{'memory bandwidth':<18}{_gbs(spec.memory_bandwidth_bytes_per_s)} GB/s",
             f"{'peak TFLOP/s':<18}{peaks} (dense)",
             f"{'ridge FLOP/byte':<18}{ridges}",
             _link_line("intra-node link", spec.intra_node_link),
             _link_line("inter-node link", spec.inter_node_link),
             f"{'devices per node':<18}{spec.devices_per_node}",
             f"{'profile device':<18}{' or '.join(repr(t) for t in spec.torch_names) or '-'} (in a profile's "
             "device string)",
             f"{'source':<18}{spec.source}"]
    if spec.notes:
        lines.append(f"{'notes':<18}{spec.notes}")
    return "\n".join(lines)
