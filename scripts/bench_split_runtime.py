"""Measured step time of autopp's split against the even and the parameter-balanced split, on CPU ranks.

For examples/gpt.py (the shipped profile profiles/gpt, the default link, 1F1B, global batch 8, dp 1) and each
--ranks count: autopp's plan (autopp.solve.make_plan), then the even split and the DeepSpeed-style
parameter-balanced split (autopp.solve.baselines.baseline_bounds "even" / "params") evaluated as plans with the same
schedule, layout, microbatches, microbatch size and per-stage activation policies
(autopp.solve.assemble.pinned.evaluate_pinned). The three run INTERLEAVED: round r runs them in an order rotated by
r, for --rounds rounds, each run with autopp.run.run_plan (--steps steps, validation on). Prints per ranks and split:
the units per stage, the predicted step (plan.predicted.step_time_s), the median over rounds of each run's median
step (steps after the first), the rounds' min-max, measured / predicted, and the measured step relative to autopp's
split in the same ranks count.

    .venv/bin/python scripts/bench_split_runtime.py                       # 2 and 4 ranks, 3 rounds
    .venv/bin/python scripts/bench_split_runtime.py --ranks 2 --rounds 5 --steps 11

Ratios are comparable within one invocation only (the machine's load changes between invocations).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from autopp.costmodel import unit_arrays
from autopp.data.cluster import DEFAULT_LINK, Cluster
from autopp.data.layout import LayoutPins
from autopp.data.plan import Plan
from autopp.data.profile import Profile, load_profile
from autopp.run import RunOptions, run_plan
from autopp.run.report import median_step_time
from autopp.schedule import ScheduleName
from autopp.sizes import parse_size
from autopp.solve import PlanRequest, make_plan
from autopp.solve.partition.baselines import baseline_bounds
from autopp.solve.assemble.pinned import Pinned, evaluate_pinned
from autopp.solve.search.judge import Candidate

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ("autopp", "even", "params")


def plans_for(profile: Profile, ranks: int, global_batch: int, memory: int) -> dict[str, Plan]:
    """autopp's 1F1B plan on `ranks` devices and the two baseline splits with everything else as in it."""
    cluster = Cluster(num_devices=ranks, memory_bytes=memory, link=DEFAULT_LINK)
    request = PlanRequest(cluster=cluster, global_batch=global_batch, schedule=ScheduleName.ONE_F_ONE_B,
                          pins=LayoutPins(pp=ranks))
    best = make_plan(profile, request)
    bounds = baseline_bounds(unit_arrays(profile, best.microbatch_size), len(best.stages))
    activations = tuple(s.activation for s in best.stages)
    out = {"autopp": best}
    for name in ("even", "params"):
        candidate = Candidate(schedule=best.schedule, layout=best.layout, microbatches=best.num_microbatches,
                              microbatch_size=best.microbatch_size, bounds=bounds[name], activations=activations)
        pinned = Pinned(candidate=candidate, source=f"{name} split")
        out[name] = evaluate_pinned(profile, cluster, pinned)
    return out


def run_rounds(plans: dict[str, Plan], rounds: int, steps: int, timeout_s: float) -> dict[str, list[float]]:
    """split -> each round's median step time; round r runs the splits in SPLITS order rotated by r."""
    measured: dict[str, list[float]] = {name: [] for name in plans}
    names = list(plans)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            report = run_plan(plans[name], RunOptions(steps=steps, timeout_s=timeout_s))
            med = median_step_time(report.step_times_s)
            measured[name].append(float("nan") if med is None else med)
            print(f"  round {r + 1} {name:<7} {measured[name][-1]:.4f} s (passed={report.passed})",
                  file=sys.stderr, flush=True)
    return measured


def _units(plan: Plan) -> str:
    return " / ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in (s.units for s in plan.stages))


def table(ranks: int, plans: dict[str, Plan], measured: dict[str, list[float]]) -> list[str]:
    """Markdown rows: ranks, split, units per stage, predicted, measured median, min-max, meas/pred, vs autopp."""
    base = statistics.median(measured["autopp"])
    rows = []
    for name, plan in plans.items():
        med, pred = statistics.median(measured[name]), plan.predicted.step_time_s
        fits = " (does not fit)" if any(n.startswith("does not fit") for n in plan.notes) else ""
        rows.append(f"| {ranks} | {name}{fits} | {_units(plan)} | {pred:.4f} | {med:.4f} | "
                    f"{min(measured[name]):.4f}-{max(measured[name]):.4f} | {med / pred:.2f} | {med / base:.3f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="SGD steps per run; the first is warm-up (default 5)")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--memory", default="1GiB", help="memory per device for planning (default 1GiB)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    args = ap.parse_args(argv)
    profile = load_profile(ROOT / "profiles" / "gpt")
    lines = ["| ranks | split | units per stage | predicted s | measured s (median) | min-max s | meas/pred "
             "| vs autopp |", "|---|---|---|---|---|---|---|---|"]
    for ranks in args.ranks:
        plans = plans_for(profile, ranks, args.global_batch, parse_size(args.memory))
        first = plans["autopp"]
        print(f"{ranks} ranks: 1F1B m {first.num_microbatches} x microbatch size {first.microbatch_size}",
              file=sys.stderr, flush=True)
        lines += table(ranks, plans, run_rounds(plans, args.rounds, args.steps, args.timeout))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
