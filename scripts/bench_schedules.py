"""Benchmark: simulated step time and peak memory of every named schedule vs the CP-SAT synthesized one."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopp.errors import ScheduleError  # noqa: E402
from autopp.schedule import NAMED, ScheduleName, build_schedule, stage_to_rank, validate  # noqa: E402
from autopp.schedule.effects import StageCost  # noqa: E402
from autopp.schedule.simulate import simulate  # noqa: E402
from autopp.solve.cpsat.synthesis import synthesize  # noqa: E402

__all__ = ["Row", "stage_costs", "bench_case", "main"]

GIB = 1 << 30
COMM_S = 0.05
"""Transfer time between stages on different ranks, seconds (F = I = W = 1 s on a balanced v=1 stage)."""
STATIC = 4 * GIB
"""Weights + gradients + optimizer state of one v=1 stage."""
ACT = GIB
"""Activations of one microbatch of one v=1 stage."""


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    schedule: str
    v: int
    step_s: float
    peak_gib: float
    fits: bool
    solve_s: float | None = None
    gap: float | None = None
    status: str = ""


def stage_costs(p: int, v: int, heavy: float) -> list[StageCost]:
    """p v=1 stages of F = I = W = 1 s, the last ``heavy`` x; at v = 2 each is cut into two equal halves."""
    scale = [1.0] * (p - 1) + [heavy]
    return [StageCost(forward_s=x / v, backward_input_s=x / v, backward_weight_s=x / v, static_bytes=STATIC // v,
                      activation_bytes=int(ACT * x / v)) for x in scale for _ in range(v)]


def _named_rows(p: int, m: int, heavy: float, limit: int) -> list[Row]:
    rows = []
    for name in NAMED:
        for v in (1, 2):
            try:
                if validate(name, p, m, v) != v:
                    continue
            except ScheduleError:
                continue
            costs, owner = stage_costs(p, v, heavy), stage_to_rank(name, p, v)
            sim = simulate(build_schedule(name, p, m, v), costs, owner, [COMM_S] * (len(owner) - 1))
            peak = max(sim.peak_memory_bytes)
            rows.append(Row(name.value, v, sim.step_time_s, peak / GIB, peak <= limit))
    return rows


def _synth_row(p: int, m: int, heavy: float, limit: int, v: int, time_limit_s: float, workers: int) -> Row:
    """Synthesize on the loop layout at v = 1 or the V layout at v = 2."""
    name = ScheduleName.ONE_F_ONE_B if v == 1 else ScheduleName.ZBV_ZERO_BUBBLE
    owner = stage_to_rank(name, p, v)
    res = synthesize(stage_costs(p, v, heavy), owner, m, [COMM_S] * (len(owner) - 1), [limit] * p,
                     time_limit_s=time_limit_s, num_workers=workers)
    peak = max(res.sim.peak_memory_bytes)
    layout = "loop" if v == 1 else "V"
    return Row(f"synth ({layout}, from {res.hint_name})", v, res.sim.step_time_s, peak / GIB, peak <= limit,
               res.solve_time_s, res.gap, res.status.value)


def bench_case(p: int, m: int, heavy: float, time_limit_s: float, workers: int, vs: Sequence[int]) -> list[Row]:
    """All rows for one (p, m, costs); the memory limit is 1F1B's peak (its busiest rank), on every rank."""
    one_f_one_b = simulate(build_schedule(ScheduleName.ONE_F_ONE_B, p, m), stage_costs(p, 1, heavy),
                           stage_to_rank(ScheduleName.ONE_F_ONE_B, p), [COMM_S] * (p - 1))
    limit = max(one_f_one_b.peak_memory_bytes)
    rows = _named_rows(p, m, heavy, limit)
    return rows + [_synth_row(p, m, heavy, limit, v, time_limit_s, workers) for v in vs]


def _summary(p: int, m: int, heavy: float, rows: list[Row]) -> str:
    """One line: 1F1B, the best named schedule that fits, and the synthesized ones (step s, gap, solve s)."""
    base = next(r.step_s for r in rows if r.schedule == "1F1B")
    named = min((r for r in rows if r.fits and not r.schedule.startswith("synth")), key=lambda r: r.step_s)
    synth = [r for r in rows if r.schedule.startswith("synth")]
    best = min(synth, key=lambda r: r.step_s)
    cells = " | ".join(f"{r.step_s:.2f} ({100 * (r.gap or 0):.1f}%, {r.solve_s or 0:.1f} s)" for r in synth)
    return (f"| {'balanced' if heavy == 1 else f'last {heavy}x'} | {p} | {m} | {base:.2f} | {named.step_s:.2f} "
            f"{named.schedule} v={named.v} | {cells} | {100 * (1 - best.step_s / named.step_s):+.1f}% "
            f"| {100 * (1 - best.step_s / base):+.1f}% |")


def _print(p: int, m: int, heavy: float, rows: list[Row]) -> None:
    base = next(r.step_s for r in rows if r.schedule == "1F1B")
    best_named = min((r.step_s for r in rows if r.fits and not r.schedule.startswith("synth")), default=float("nan"))
    limit = max(r.peak_gib for r in rows if r.schedule == "1F1B")
    print(f"\n### p={p} m={m} {'balanced' if heavy == 1 else f'last stage {heavy}x'}, limit {limit:.2f} GiB per rank")
    print("| schedule | v | step s | vs 1F1B | peak GiB | fits | solve s | gap | status |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        solve = "" if r.solve_s is None else f"{r.solve_s:.1f}"
        gap = "" if r.gap is None else f"{100 * r.gap:.1f}%"
        print(f"| {r.schedule} | {r.v} | {r.step_s:.2f} | {100 * (1 - r.step_s / base):+.1f}% | {r.peak_gib:.2f} "
              f"| {'yes' if r.fits else 'NO'} | {solve} | {gap} | {r.status} |")
    synth = min(r.step_s for r in rows if r.schedule.startswith("synth"))
    print(f"best named that fits: {best_named:.2f} s; synthesized: {synth:.2f} s "
          f"({100 * (1 - synth / best_named):+.1f}% vs best named, {100 * (1 - synth / base):+.1f}% vs 1F1B)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--p", type=int, nargs="+", default=[4, 8], help="ranks")
    parser.add_argument("--m-factors", type=int, nargs="+", default=[1, 2, 4], help="microbatches = factor x p")
    parser.add_argument("--heavy", type=float, nargs="+", default=[1.0, 1.5], help="last-stage cost multiplier")
    parser.add_argument("--v", type=int, nargs="+", default=[1, 2], choices=[1, 2], help="synthesize at v=1 / V v=2")
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds per synthesis")
    parser.add_argument("--workers", type=int, default=2, help="CP-SAT workers")
    parser.add_argument("--quick", action="store_true", help="p=4, m in {4, 8}, 3 s per solve")
    args = parser.parse_args(argv)
    if args.quick:
        args.p, args.m_factors, args.time_limit = [4], [1, 2], 3.0
    print(f"F = I = W = 1 s per v=1 stage (last stage x heavy), comm {COMM_S} s, static {STATIC // GIB} GiB and "
          f"{ACT // GIB} GiB activations per microbatch per v=1 stage; v=2 halves each stage.")
    summary = []
    for heavy in args.heavy:
        for p in args.p:
            for factor in args.m_factors:
                rows = bench_case(p, factor * p, heavy, args.time_limit, args.workers, args.v)
                _print(p, factor * p, heavy, rows)
                summary.append(_summary(p, factor * p, heavy, rows))
    synth = " | ".join(f"synth {'loop v=1' if v == 1 else 'V v=2'} s (gap, solve)" for v in args.v)
    print(f"\n## Summary (step time in s; limit = 1F1B's peak)\n| stages | p | m | 1F1B | best named that fits | "
          f"{synth} | synth vs best named | synth vs 1F1B |")
    print("|---" * (7 + len(args.v)) + "|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
