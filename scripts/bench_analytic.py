"""Analytic vs measured per-unit costs on this CPU: forward + backward time, and peak memory.

For each model: a measured profile (reused from --profiles DIR/NAME when its fingerprint is current and it records
per-unit peaks, else measured with autopp.measure.profile_model, one thread, and saved there), and the model counted
on the meta device (autopp.measure.analytic.count_model). Then per model, the median and worst relative error of the
per-unit forward + backward time (every unit at every microbatch size) of the analytic profile for the catalog's
`cpu` entry:
  uncalibrated   the documented default efficiencies (autopp.costmodel.roofline.default_efficiency)
  in-sample      efficiencies fitted to this model's own profile (`autopp calibrate`)
  leave-out      efficiencies fitted to the OTHER models' profiles only (leave-one-model-out)
and the memory truth: per unit, the peak bytes live during one forward and full backward (saved activations,
temporaries, gradients as made), counted under FakeTensorMode vs measured by the profiler (`extra.peak_bytes`), and
the unit's total (parameters + optimizer state + that peak).

    .venv/bin/python scripts/bench_analytic.py                          # 4 models, reusing /tmp/autopp-bench-analytic
    .venv/bin/python scripts/bench_analytic.py --profiles DIR --repeats 5 --models examples/gpt.py examples/mlp.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from autopp.costmodel.roofline import Efficiency, UnitError, default_efficiency
from autopp.data.catalog import DeviceSpec, load_device
from autopp.data.profile import Profile, load_profile
from autopp.measure import MeasureOptions, ProfileOptions, profile_model
from autopp.measure.analytic import ModelCounts, count_model
from autopp.measure.fitting import fit_measured, unit_errors
from autopp.model.hf import load_model

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["examples/gpt.py", "examples/mlp.py", "examples/hf_llama.py", "examples/configs/tiny-llama.json"]


def _measured(model: str, counts: ModelCounts, directory: Path, args: argparse.Namespace) -> Profile:
    """The stored profile when current, else a fresh one (saved)."""
    if (directory / "meta.json").is_file():
        p = load_profile(directory)
        if (p.meta.fingerprint == counts.fingerprint and p.unit_peak_bytes()
                and tuple(p.meta.microbatch_sizes) == counts.options.microbatch_sizes):
            return p
    print(f"measuring {model} ...", file=sys.stderr)
    source = counts.mf if model.endswith(".json") else str(counts.mf.path)  # a config: the ModelFile built from it
    measuring = MeasureOptions(warmup=args.warmup, repeats=args.repeats, compare_whole=False)
    p = profile_model(source, counts.options, measuring)
    p.save(directory)
    return load_profile(directory)


def _stats(errors: list[UnitError]) -> str:
    values = [abs(e.error) for e in errors]
    return f"{statistics.median(values):6.1%} {max(values):6.1%}"


def _fit(profiles: list[tuple[Profile, ModelCounts]], spec: DeviceSpec) -> Efficiency:
    return fit_measured(profiles, spec)


def time_table(data: dict[str, tuple[Profile, ModelCounts]], spec: DeviceSpec) -> None:
    print("\nper-unit forward + backward, analytic vs measured (relative error: median, worst)")
    print(f"{'model':<18} {'rows':>4}  {'uncalibrated':>13}  {'in-sample':>13}  {'leave-out':>13}  "
          f"{'in-sample e_c, e_m, t_op, t_call':>34}")
    everything: dict[str, list[UnitError]] = {"uncalibrated": [], "in-sample": [], "leave-out": []}
    for name, (p, c) in data.items():
        own = _fit([(p, c)], spec)
        others = [v for k, v in data.items() if k != name]
        out = _fit(others, spec) if others else own
        errs = {"uncalibrated": unit_errors(p, c, spec, default_efficiency(spec.name)),
                "in-sample": unit_errors(p, c, spec, own), "leave-out": unit_errors(p, c, spec, out)}
        for k, v in errs.items():
            everything[k] += v
        print(f"{name:<18} {len(errs['in-sample']):>4}  {_stats(errs['uncalibrated'])}  {_stats(errs['in-sample'])}  "
              f"{_stats(errs['leave-out'])}  {own.compute:8.3f} {own.memory:6.3f} {own.op_overhead_s * 1e6:7.1f} us "
              f"{own.call_overhead_s * 1e6:7.1f} us")
    pooled = _fit(list(data.values()), spec)
    print(f"{'all':<18} {len(everything['in-sample']):>4}  {_stats(everything['uncalibrated'])}  "
          f"{_stats(everything['in-sample'])}  {_stats(everything['leave-out'])}  (one fit on all: {pooled.compute:.3f}"
          f" {pooled.memory:.3f} {pooled.op_overhead_s * 1e6:.1f} us {pooled.call_overhead_s * 1e6:.1f} us)")


def memory_table(data: dict[str, tuple[Profile, ModelCounts]], all_sizes: bool) -> None:
    print("\nper-unit memory: peak live during forward + backward, and total (params + optimizer + peak), in KiB")
    print(f"{'model':<18} {'unit':<20} {'b':>3} {'saved meas':>10} {'saved pred':>10} {'peak meas':>10} "
          f"{'peak pred':>10} {'error':>7} {'total meas':>10} {'total pred':>10} {'error':>7}")
    for name, (p, c) in data.items():
        measured = p.unit_peak_bytes()
        table = p.units.set_index(["unit", "microbatch_size"])
        peak_err, total_err = [], []
        for r in sorted(c.rows, key=lambda r: (r.microbatch_size, r.unit)):
            row = table.loc[(r.unit, r.microbatch_size)]
            static = int(row["param_bytes"] + row["optimizer_bytes"])
            meas, pred = measured[r.unit][r.microbatch_size], r.counts.peak_bytes
            peak_err.append(pred / meas - 1 if meas else 0.0)
            total_err.append((static + pred) / (static + meas) - 1)
            if all_sizes or r.microbatch_size == c.options.microbatch_sizes[-1]:
                print(f"{name:<18} {c.units[r.unit].name[:20]:<20} {r.microbatch_size:>3} "
                      f"{row['activation_bytes'] / 1024:>10.1f} {r.counts.activation_bytes / 1024:>10.1f} "
                      f"{meas / 1024:>10.1f} {pred / 1024:>10.1f} {peak_err[-1]:>+7.1%} "
                      f"{(static + meas) / 1024:>10.1f} {(static + pred) / 1024:>10.1f} {total_err[-1]:>+7.1%}")
        print(f"{name:<18} {'median |error|':<20} {'':>3} {'':>10} {'':>10} {'':>10} {'':>10} "
              f"{statistics.median(abs(e) for e in peak_err):>7.1%} {'':>10} {'':>10} "
              f"{statistics.median(abs(e) for e in total_err):>7.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--profiles", type=Path, default=Path("/tmp/autopp-bench-analytic"),
                    help="measured profiles are kept (and reused) in DIR/NAME")
    ap.add_argument("--microbatch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--all-sizes", action="store_true", help="memory table: every microbatch size, not the largest")
    args = ap.parse_args()
    spec = load_device("cpu")
    data: dict[str, tuple[Profile, ModelCounts]] = {}
    for model in args.models:
        name = Path(model).stem
        start = time.perf_counter()
        counts = count_model(load_model(ROOT / model if not Path(model).is_absolute() else model),
                             ProfileOptions(microbatch_sizes=args.microbatch_sizes))
        print(f"counted {model} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        data[name] = (_measured(model, counts, args.profiles / name, args), counts)
    print(f"device: cpu catalog entry (peak {spec.peak('float32') / 1e9:.1f} GFLOP/s float32, "
          f"{spec.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s; ridge {spec.ridge_point('float32'):.2f} FLOP/B); "
          f"microbatch sizes {args.microbatch_sizes}; measured with 1 thread, {args.repeats} repeats")
    time_table(data, spec)
    memory_table(data, args.all_sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
