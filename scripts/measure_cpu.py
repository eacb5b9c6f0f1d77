"""Measure this CPU for the device catalog: one-thread matmul FLOP/s (float32, bfloat16) and copy bandwidth.

autopp's CPU ranks run one thread each (torch.set_num_threads(1)), so the `cpu` catalog entry is one core's figures:
  matmul   n x n @ n x n for each --sizes n: 2 n^3 FLOP / time, the median of --repeats timed runs (after one warm-up);
           the best size's median is the peak stored
  copy     dst.copy_(src) of a --copy-mib MiB float32 tensor: bytes read + written (2 x size) / time, median of
           --repeats
Prints a table (median and spread = max - min over the repeats) and writes autopp/data/devices/cpu.json (or -o) with
the machine's description (lscpu model name, cores), its physical memory (psutil) and this command in `source`.
The links are not measured here: the gloo loopback link assumed by autopp.data.cluster.DEFAULT_LINK is written
(measure the real one with `autopp profile-links`).

    .venv/bin/python scripts/measure_cpu.py
    .venv/bin/python scripts/measure_cpu.py --sizes 256,512 --repeats 3 -o /tmp/cpu.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from autopp.data.catalog import load_device
from autopp.data.cluster import DEFAULT_LINK
from autopp.jsonio import write_json
from autopp.measure.options import DTYPES
from autopp.measure.timing import Budget, Timer

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "autopp" / "data" / "devices" / "cpu.json"


def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of `repeats` calls of `fn` after one warm-up call, timed as the profiler times (autopp.measure.timing)."""
    timer = Timer(torch.device("cpu"))
    return [t for timed in Budget(warmup=1, repeats=repeats).runs() for _, t in [timer.time(fn)] if timed]


def matmul_flops(dtype: torch.dtype, n: int, repeats: int) -> list[float]:
    """FLOP/s of each timed n x n matmul in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    out = torch.empty(n, n, dtype=dtype)
    return [2 * n**3 / t for t in _times(lambda: torch.mm(a, b, out=out), repeats)]


def copy_bandwidth(mib: int, repeats: int) -> list[float]:
    """Bytes read + written per second of each timed copy of a `mib` MiB float32 tensor."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    return [2 * src.nbytes / t for t in _times(lambda: dst.copy_(src), repeats)]


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def _vendor(info: dict[str, str]) -> str:
    raw = info.get("Vendor ID", "")
    return {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(raw, raw or platform.machine())


def _row(label: str, samples: list[float], scale: float, unit: str) -> str:
    med = statistics.median(samples)
    return f"{label:<22} {med / scale:>10.2f} {unit:<8} spread {(max(samples) - min(samples)) / scale:.2f}"


def measure(sizes: list[int], repeats: int, copy_mib: int) -> tuple[dict[str, float], dict[str, Any], float]:
    """Best median FLOP/s per dtype, the per-size medians, and the median copy bandwidth; prints the table."""
    peaks: dict[str, float] = {}
    table: dict[str, Any] = {}
    for name, dtype in DTYPES.items():
        medians = {}
        for n in sizes:
            samples = matmul_flops(dtype, n, repeats)
            medians[str(n)] = statistics.median(samples)
            print(_row(f"matmul {name} n={n}", samples, 1e9, "GFLOP/s"), flush=True)
        peaks[name] = max(medians.values())
        table[f"matmul_{name}_flops_by_size"] = medians
    samples = copy_bandwidth(copy_mib, repeats)
    print(_row(f"copy {copy_mib} MiB", samples, 1e9, "GB/s"), flush=True)
    return peaks, table, statistics.median(samples)


def _link(kind: str, bandwidth: float, latency: float) -> dict[str, Any]:
    return {"kind": kind, "bandwidth_bytes_per_s": bandwidth, "latency_s": latency,
            "overhead_s": DEFAULT_LINK.overhead_s, "progress_s": DEFAULT_LINK.progress_s}


def entry(peaks: dict[str, float], table: dict[str, Any], bandwidth: float, command: str) -> dict[str, Any]:
    """The cpu.json document."""
    info = _lscpu()
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    model = info.get("Model name") or platform.processor() or platform.machine()
    virt = f", {info['Hypervisor vendor']} guest" if "Hypervisor vendor" in info else ""
    return {
        "vendor": _vendor(info),
        "model": f"{model} ({cores} cores{virt}), one thread per rank",
        "memory": psutil.virtual_memory().total,
        "memory_shared": True,
        "memory_bandwidth_bytes_per_s": bandwidth,
        "peak_flops": peaks,
        "intra_node_link": _link("gloo over loopback between processes of one host (assumed: "
                                 "autopp.data.cluster.DEFAULT_LINK)", DEFAULT_LINK.bandwidth_bytes_per_s,
                                 DEFAULT_LINK.latency_s),
        "inter_node_link": _link("gloo over TCP, 10 Gb/s Ethernet (assumed)", 1.25e9, DEFAULT_LINK.latency_s + 50e-6),
        "devices_per_node": cores,
        "torch_names": ["cpu ("],
        "source": f"measured on this machine: {command} ({datetime.now(timezone.utc):%Y-%m-%d}, torch "
                  f"{torch.__version__}, 1 thread)",
        "notes": "Measured, not looked up: peak_flops is the best median one-thread torch.mm FLOP/s over the sizes "
                 "in extra; memory bandwidth is one thread's copy (bytes read + written / time). memory is the "
                 "machine's physical memory, shared by the ranks on it: a plan gives each rank its share (memory / "
                 "ranks on the host; --memory overrides). "
                 "Links are assumed (gloo loopback as DEFAULT_LINK; across hosts its latency plus 50 us for the "
                 "Ethernet hop; measure with `autopp profile-links`). The entry matches a profile measured on any "
                 "CPU (a profile's device string names no CPU model): its figures are this machine's.",
        "extra": {**table, "threads": 1, "torch_version": torch.__version__, "platform": platform.platform()},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,512,1024", help="matmul sizes n (default 256,512,1024)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per measurement (default 7)")
    p.add_argument("--copy-mib", type=int, default=256, help="copied tensor size in MiB (default 256)")
    p.add_argument("-o", "--output", type=Path, default=OUT,
                   help=f"device file to write (default {OUT.relative_to(ROOT)})")
    args = p.parse_args()
    torch.set_num_threads(1)
    peaks, table, bandwidth = measure([int(s) for s in args.sizes.split(",")], args.repeats, args.copy_mib)
    command = "python scripts/measure_cpu.py " + " ".join(sys.argv[1:])
    write_json(args.output, entry(peaks, table, bandwidth, command.strip()))
    spec = load_device(str(args.output)) if args.output.suffix == ".json" else None  # checks the file reads back
    print(f"wrote {args.output}" + (f": float32 {spec.peak('float32') / 1e9:.1f} GFLOP/s, bfloat16 "
                                    f"{spec.peak('bfloat16') / 1e9:.1f} GFLOP/s, copy "
                                    f"{spec.memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s, ridge (float32) "
                                    f"{spec.ridge_point('float32'):.1f} FLOP/B" if spec else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
