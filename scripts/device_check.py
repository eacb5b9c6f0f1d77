"""Helpers of scripts/device_check.sh (issue 29, item 5): this machine's device, a few op rates against its catalog
entry, and the check's summary table.

    python scripts/device_check.py probe DIR [--cpu]   # DIR/env.json: torch, the device, its catalog entry, memory
                                                        # DIR/ops.json: matmuls (bf16, fp8 where it runs), attention,
                                                        # copy, GELU against the catalog
    python scripts/device_check.py summary DIR         # the table of everything DIR holds

The probe times each op as the profiler times a unit (autopp.measure.timing: CUDA events on a GPU, a warm-up first,
the median of the timed runs) and divides its rate by the catalog's datasheet figure (docs/devices.md): the
fraction reached is what the analytic roofline's efficiencies e_c (matmul), e_a (attention) and e_m (copy, GELU)
stand for (docs/analytic.md), measured here op by op where `autopp calibrate` fits e_c and e_m to whole units.
FLOP counts: matmul 2 n^3; causal attention forward 4 b h s^2 d (QK^T and PV) x the share of the pairs its kernel
computes, as the analytic count has it (autopp.measure.counting.causal_computed: a GPU's 128 x 128 blocks up to the
diagonal, 0.531 at s 2,048; the CPU flash kernel's); bytes: copy and GELU read and write each element once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn import functional as F

from autopp.data.catalog import DeviceSpec, identify_device, load_device
from autopp.jsonio import write_json
from autopp.measure.counting import CPU_TILES, GPU_TILES, causal_computed
from autopp.measure.timing import Budget, Timer

#: Sizes per device kind: (matmul n, attention (b, h, s, d), elements of the memory-bound ops, timed runs).
SIZES = {"cuda": (8192, (4, 32, 2048, 128), 2**28, 10), "cpu": (256, (1, 4, 128, 32), 2**22, 3)}


def _device(cpu: bool) -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")


def _device_string(device: torch.device) -> str:
    """The device as a profile names it (autopp.measure.profiler), which the catalog recognises."""
    return f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu (x86_64)"


def _spec(device: torch.device) -> DeviceSpec | None:
    name = identify_device(_device_string(device))
    return load_device(name) if name else None


def env(out: Path, cpu: bool) -> dict[str, Any]:
    """torch's version, the device, its catalog entry and memory, the GPUs seen."""
    device = _device(cpu)
    spec = _spec(device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    memory = torch.cuda.get_device_properties(device).total_memory if gpus else (spec.memory_bytes if spec else 0)
    data = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": _device_string(device),
            "kind": device.type, "gpus": gpus, "catalog": spec.name if spec else None, "memory_bytes": memory,
            "capability": list(torch.cuda.get_device_capability(device)) if gpus else None}
    write_json(out, data)
    return data


def _median_s(device: torch.device, fn: Callable[[], Any], repeats: int) -> float:
    timer = Timer(device)
    return statistics.median(t for timed in Budget(warmup=2, repeats=repeats).runs()
                             for _, t in [timer.time(fn)] if timed)


def _row(op: str, dtype: str, shape: str, seconds: float, work: float, unit: str, peak: float | None
         ) -> dict[str, Any]:
    rate = work / seconds
    return {"op": op, "dtype": dtype, "shape": shape, "seconds": seconds, "rate": rate, "unit": unit,
            "peak": peak, "fraction": rate / peak if peak else None}


def _peak(spec: DeviceSpec | None, dtype: str) -> float | None:
    return spec.peak_flops.get(dtype) if spec else None


def _fp8_matmul(device: torch.device, n: int, repeats: int, spec: DeviceSpec | None) -> dict[str, Any] | str:
    """torch._scaled_mm on float8_e4m3fn (bf16 out), or why it was not timed."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return "fp8 matmul: needs a CUDA device of compute capability >= 8.9 (H100/H200, L40S)"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"fp8 matmul: torch {torch.__version__} has no torch._scaled_mm"
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants it
    one = torch.tensor(1.0, device=device)
    seconds = _median_s(device, lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), repeats)
    return _row("matmul", "float8", f"{n}x{n}x{n}", seconds, 2 * n**3, "FLOP/s", _peak(spec, "float8"))


def ops(out: Path, cpu: bool) -> dict[str, Any]:
    """Matmuls (float32, bfloat16, float8 where it runs), causal attention, copy and GELU; rates against the
    catalog entry."""
    device = _device(cpu)
    spec = _spec(device)
    n, (b, h, s, d), elements, repeats = SIZES[device.type]
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16} if device.type == "cuda" else \
        {"float32": torch.float32}  # this CPU's bfloat16 runs ~60x slower than float32 (docs/devices.md)
    for name, dtype in dtypes.items():
        x, y = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        rows.append(_row("matmul", name, f"{n}x{n}x{n}", _median_s(device, lambda: x @ y, repeats), 2 * n**3,
                         "FLOP/s", _peak(spec, name)))
    fp8 = _fp8_matmul(device, n, repeats, spec)
    if isinstance(fp8, str):
        skipped.append(fp8)
    else:
        rows.append(fp8)
    attn = "bfloat16" if device.type == "cuda" else "float32"
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtypes[attn]) for _ in range(3))
    seconds = _median_s(device, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)
    tiles = GPU_TILES if device.type == "cuda" else CPU_TILES  # the blocks it computes, as the analytic count has them
    rows.append(_row("attention fwd (causal)", attn, f"b{b} h{h} s{s} d{d}", seconds,
                     4 * b * h * s * s * d * causal_computed(s, s, tiles), "FLOP/s", _peak(spec, attn)))
    src = torch.randn(elements, device=device)
    dst = torch.empty_like(src)
    bandwidth = spec.memory_bandwidth_bytes_per_s if spec else None
    for op, fn in (("copy", lambda: dst.copy_(src)), ("gelu", lambda: F.gelu(src))):
        seconds = _median_s(device, fn, repeats)
        rows.append(_row(op, "float32", f"{elements} elements", seconds, 2 * src.nbytes, "B/s", bandwidth))
    data = {"device": _device_string(device), "catalog": spec.name if spec else None, "rows": rows,
            "skipped": skipped}
    write_json(out, data)
    for line in _ops_lines(data):
        print(line)
    return data


def _ops_lines(data: dict[str, Any]) -> list[str]:
    lines = [f"{'op':<24} {'dtype':<9} {'shape':<22} {'time':>10} {'rate':>14} {'of catalog':>10}"]
    for r in data["rows"]:
        scale, unit = (1e12, "TFLOP/s") if r["unit"] == "FLOP/s" else (1e9, "GB/s")
        frac = "-" if r["fraction"] is None else f"{r['fraction']:.0%}"
        lines.append(f"{r['op']:<24} {r['dtype']:<9} {r['shape']:<22} {r['seconds'] * 1e3:>7.3f} ms "
                     f"{r['rate'] / scale:>6.3g} {unit:<7} {frac:>10}")
    return lines + [f"skipped: {s}" for s in data["skipped"]]


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _calibration_lines(folder: Path) -> list[str]:
    lines = [f"{'calibration':<22} {'dtype':<9} {'e_c':>6} {'e_m':>6} {'t_op us':>8} {'t_call us':>9} "
             f"{'median err':>10} {'worst':>7}"]
    for path in sorted(folder.glob("*.json")):
        c = _read(path)
        lines.append(f"{path.stem:<22} {c['dtype']:<9} {c['compute_efficiency']:>6.3f} {c['memory_efficiency']:>6.3f} "
                     f"{c['op_overhead_s'] * 1e6:>8.3g} {c.get('call_overhead_s', 0) * 1e6:>9.3g} "
                     f"{c['median_error']:>10.1%} {c['worst_error']:>7.1%}")
    return lines


def _report_lines(folder: Path) -> list[str]:
    lines = [f"{'run':<16} {'backend':<7} {'ranks':>5} {'step meas.':>10} {'pred.':>8} {'ratio':>5} "
             f"{'peak memory meas. / pred. per rank':<40} {'verdict':<7}"]
    for path in sorted(folder.glob("*.report.json")):
        r = _read(path)
        mem = ", ".join(f"{m['peak_memory_bytes'] / 2**20:.0f}/"
                        f"{(m['predicted_peak_memory_bytes'] or 0) / 2**20:.0f} MiB" for m in r.get("ranks", []))
        how = f" ({r['memory_method']})" if r.get("memory_method") else ""
        meas = r.get("measured_step_time_s")
        lines.append(f"{path.name.removesuffix('.report.json'):<16} {r['backend']:<7} {r['num_ranks']:>5} "
                     f"{'-' if meas is None else f'{meas:.4f} s':>10} {r['predicted_step_time_s']:>6.4f} s "
                     f"{r.get('step_time_ratio') or 0:>5.2f} {mem + how:<40} "
                     f"{'PASSED' if r.get('passed') else 'FAILED'}")
    return lines


def summary(folder: Path) -> None:
    """Every step's status and time, then the op rates, calibrations and runs the folder holds."""
    e = _read(folder / "env.json") or {}
    print(f"device check of {e.get('device', '?')} (catalog {e.get('catalog')}, {e.get('gpus', 0)} GPUs, torch "
          f"{e.get('torch', '?')}) in {folder}")
    steps = (folder / "steps.tsv").read_text().splitlines() if (folder / "steps.tsv").is_file() else []
    for line in steps:
        name, status, seconds = line.split("\t")
        print(f"  {status:<7} {float(seconds):>6.1f} s  {name}")
    for title, lines in (("ops", _ops_lines(_read(folder / "ops.json")) if (folder / "ops.json").is_file() else []),
                         ("calibration", _calibration_lines(folder / "calibration")),
                         ("runs", _report_lines(folder / "reports"))):
        if len(lines) > (0 if title == "ops" else 1):
            print(f"\n{title}:")
            print("\n".join(f"  {x}" for x in lines))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["probe", "summary"])
    p.add_argument("folder", type=Path)
    p.add_argument("--cpu", action="store_true", help="use the CPU even when CUDA is available")
    args = p.parse_args()
    if args.what == "summary":
        summary(args.folder)
        return 0
    e = env(args.folder / "env.json", args.cpu)
    print(f"device: {e['device']}, catalog {e['catalog']}, {e['gpus']} GPUs, torch {e['torch']}")
    ops(args.folder / "ops.json", args.cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
