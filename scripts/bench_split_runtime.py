"""Realized gains: autopp's split against the even and the parameter-balanced split, measured on CPU ranks.

Issue 29, item 2. For each model (default: examples/gpt.py, examples/hf_llama.py, and the head-light
examples/resnet.py, whose head is a pooling and a 64 x 10 classifier; examples/mlp.py on request, whose three
splits coincide at 2 ranks) and each --ranks count: autopp's 1F1B plan (autopp.solve.make_plan, default link,
global batch 8, dp 1), then the even split and the DeepSpeed-style parameter-balanced split
(autopp.solve.partition.baselines.baseline_bounds "even" / "params") evaluated as plans with the same schedule,
layout, microbatches, microbatch size and per-stage activation policies (evaluate_pinned). Splits with the same
stages are one plan, run once (the table says "= even"). The runs are INTERLEAVED: round r runs every model's
splits in an order rotated by r, each with autopp.run.run_plan (--steps steps, validation on), so a change of the
machine's load falls on every split alike.

Per model and split it prints the units per stage, the predicted step, the median over rounds of each run's median
step (steps after the first) with the rounds' min-max, measured / predicted, each stage's measured / predicted F + B
(from the run report: which stage, e.g. the head's, the profile misjudges), and against each baseline: the
predicted gain (baseline predicted / autopp predicted - 1), the re-simulated gain (the same, each step simulated
with its run's own per-stage F and B: scripts/bench_accuracy.py's `resimulate`; near the measured gain when the
profile's stage times are what is off, near the predicted one when the error lies outside the stages' compute), and
the measured gain, the median over rounds of that round's baseline / autopp step - 1 (paired within a round), with
its min-max. "ok" when the measured gain is >= 0 (autopp at least as fast) and within 5 points of the predicted one.

    .venv/bin/python scripts/bench_split_runtime.py --reprofile     # 3 models, 2 ranks, 5 rounds: 10-20 min quiet
    .venv/bin/python scripts/bench_split_runtime.py --models gpt --rounds 1 --steps 4      # a quick check

Profiles: profiles/<model> where shipped (gpt, mlp), the model profiled now otherwise (hf_llama, resnet); --reprofile
profiles every model now, beside one co-runner, with scripts/reprofile.sh's settings (do it on a quiet machine).
A progress line with the run count and an ETA goes to stderr before each run; the table to stdout. Ratios are
comparable within one invocation only (the machine's load changes between invocations).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from autopp.costmodel import unit_arrays
from autopp.data.cluster import DEFAULT_LINK, Cluster
from autopp.data.layout import LayoutPins
from autopp.data.plan import Plan
from autopp.data.profile import Profile, load_profile
from autopp.measure import MeasureOptions, ProfileOptions, profile_model
from autopp.run import RunOptions, RunReport, run_plan
from autopp.run.report import median_step_time
from autopp.schedule import ScheduleName
from autopp.sizes import parse_size
from autopp.solve import PlanRequest, make_plan
from autopp.solve.assemble.pinned import Pinned, evaluate_pinned
from autopp.solve.partition.baselines import baseline_bounds
from autopp.solve.search.judge import Candidate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_accuracy import resimulate  # noqa: E402  (a sibling script: the simulator fed the run's action times)

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ("autopp", "even", "params")
BASELINES = SPLITS[1:]
MODELS = {"gpt": "examples/gpt.py", "hf_llama": "examples/hf_llama.py", "resnet": "examples/resnet.py",
          "mlp": "examples/mlp.py"}
DEFAULT_MODELS = ("gpt", "hf_llama", "resnet")
TOLERANCE = 0.05
"""How far (in fractions: 5 points) the measured gain may lie from the predicted one (issue 29, item 2)."""


@dataclass
class Split:
    """One split's plan and what its runs measured."""

    plan: Plan
    same_as: str | None = None
    """The earlier split with the same stages, whose runs this one shares."""
    steps: list[float] = field(default_factory=list)
    """Each round's median step time (nan when a run gave none)."""
    stage_ratios: list[list[float]] = field(default_factory=list)
    """Each round's measured / predicted F + B per stage."""
    resims: list[float] = field(default_factory=list)
    """Each round's step re-simulated with that run's measured per-stage F, I, W (bench_accuracy.resimulate)."""


def plans_for(profile: Profile, ranks: int, global_batch: int, memory: int) -> dict[str, Plan]:
    """autopp's 1F1B plan on `ranks` devices and the two baseline splits with everything else as in it."""
    cluster = Cluster(num_devices=ranks, memory_bytes=memory, link=DEFAULT_LINK)
    request = PlanRequest(cluster=cluster, global_batch=global_batch, schedule=ScheduleName.ONE_F_ONE_B,
                          pins=LayoutPins(pp=ranks))
    best = make_plan(profile, request)
    bounds = baseline_bounds(unit_arrays(profile, best.microbatch_size), len(best.stages))
    activations = tuple(s.activation for s in best.stages)
    out = {"autopp": best}
    for name in BASELINES:
        candidate = Candidate(schedule=best.schedule, layout=best.layout, microbatches=best.num_microbatches,
                              microbatch_size=best.microbatch_size, bounds=bounds[name], activations=activations)
        out[name] = evaluate_pinned(profile, cluster, Pinned(candidate=candidate, source=f"{name} split"))
    return out


def splits_of(plans: dict[str, Plan]) -> dict[str, Split]:
    """One Split per plan; a split whose stages equal an earlier one's shares its runs (`same_as`)."""
    out: dict[str, Split] = {}
    for name, plan in plans.items():
        twin = next((n for n, s in out.items() if s.same_as is None and _bounds(s.plan) == _bounds(plan)), None)
        out[name] = Split(plan=plan, same_as=twin)
    return out


def _bounds(plan: Plan) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(s.units) for s in plan.stages)  # type: ignore[misc]


def stage_ratios(report: RunReport) -> list[float]:
    """Measured / predicted F + B of each stage (nan where the run measured none or predicted 0)."""
    out = []
    for st in report.stage_times:
        pred = st.predicted_forward_s + st.predicted_backward_s
        got = (st.forward_s or 0.0) + (st.backward_s or 0.0)
        out.append(got / pred if pred > 0 and st.forward_s is not None else math.nan)
    return out


def round_gains(base: list[float], autopp: list[float]) -> list[float]:
    """Each round's measured gain of autopp over a baseline: baseline step / autopp step - 1 (paired by round)."""
    return [b / a - 1 for b, a in zip(base, autopp)]


def verdict(predicted_gain: float, measured_gain: float, tolerance: float = TOLERANCE) -> str:
    """"ok" when autopp measured at least as fast (gain >= 0) and its gain is within `tolerance` of the predicted
    one; otherwise what failed."""
    if math.isnan(measured_gain):
        return "no measurement"
    fails = []
    if not measured_gain >= 0:
        fails.append("slower")
    if not abs(measured_gain - predicted_gain) <= tolerance:
        fails.append(f"off by {100 * (measured_gain - predicted_gain):+.1f} pts")
    return "ok" if not fails else ", ".join(fails)


def _units(plan: Plan) -> str:
    return " / ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in (s.units for s in plan.stages))


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


HEADER = ["| model | ranks | split | units per stage | predicted s | measured s (median) | min-max s | meas/pred "
          "| stage meas/pred F+B | predicted gain | re-simulated gain | measured gain (median, min-max) | verdict |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def table(model: str, ranks: int, splits: dict[str, Split]) -> list[str]:
    """Markdown rows, one per split (HEADER's columns); gains are autopp's over that row's split."""
    ours = splits["autopp"].steps
    rows = []
    for name, split in splits.items():
        runs = splits[split.same_as] if split.same_as else split
        med, pred = statistics.median(runs.steps), split.plan.predicted.step_time_s
        stages = " / ".join(f"{statistics.median(r):.2f}" for r in zip(*runs.stage_ratios)) or "-"
        label = name + (f" (= {split.same_as})" if split.same_as else "")
        gain = ["-", "-", "-", "-"]
        if name != "autopp":
            pred_gain = pred / splits["autopp"].plan.predicted.step_time_s - 1
            gains = round_gains(runs.steps, ours)
            got = statistics.median(gains)
            resim = statistics.median(round_gains(runs.resims, splits["autopp"].resims))
            gain = [_pct(pred_gain), _pct(resim), f"{_pct(got)} ({_pct(min(gains))} to {_pct(max(gains))})",
                    verdict(pred_gain, got)]
        rows.append(f"| {model} | {ranks} | {label} | {_units(split.plan)} | {pred:.4f} | {med:.4f} | "
                    f"{min(runs.steps):.4f}-{max(runs.steps):.4f} | {med / pred:.2f} | {stages} | "
                    + " | ".join(gain) + " |")
    return rows


def rotated(names: list[str], r: int) -> list[str]:
    """`names` rotated left by r (round r's order)."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def run_rounds(benches: dict[tuple[str, int], dict[str, Split]], rounds: int, steps: int, timeout_s: float) -> None:
    """Every bench's distinct splits, `rounds` times, interleaved; a progress line with an ETA before each run."""
    todo = [(key, name) for r in range(rounds) for key, splits in benches.items()
            for name in rotated([n for n, s in splits.items() if s.same_as is None], r)]
    start = time.perf_counter()
    for done, ((model, ranks), name) in enumerate(todo):
        elapsed = time.perf_counter() - start
        eta = f", ETA {elapsed / done * (len(todo) - done) / 60:.1f} min" if done else ""
        print(f"[{done + 1}/{len(todo)}] {model} {ranks} ranks {name}: {elapsed / 60:.1f} min elapsed{eta}, "
              f"load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
        split = benches[(model, ranks)][name]
        report = run_plan(split.plan, RunOptions(steps=steps, timeout_s=timeout_s))
        med = median_step_time(report.step_times_s)
        split.steps.append(math.nan if med is None else med)
        split.stage_ratios.append(stage_ratios(report))
        split.resims.append(resimulate(split.plan, report) if report.stage_times else math.nan)
        print(f"    {split.steps[-1]:.4f} s (validation passed: {report.passed})", file=sys.stderr, flush=True)


def _profile(model: str, reprofile: bool) -> Profile:
    """profiles/<model> when shipped (unless `reprofile`), else a fresh profile beside one co-runner with
    scripts/reprofile.sh's settings (microbatch sizes 1 and 4, 2 warm-up and 5 timed runs)."""
    shipped = ROOT / "profiles" / model
    if shipped.is_dir() and not reprofile:
        return load_profile(shipped)
    print(f"profiling {MODELS[model]} beside one co-runner ...", file=sys.stderr, flush=True)
    return profile_model(ROOT / MODELS[model], ProfileOptions(microbatch_sizes=(1, 4)),
                         MeasureOptions(warmup=2, repeats=5, co_runners=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(DEFAULT_MODELS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="SGD steps per run; the first is warm-up (default 8)")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--memory", default="1GiB", help="memory per device for planning (default 1GiB)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    ap.add_argument("--reprofile", action="store_true", help="profile every model now (on a quiet machine)")
    args = ap.parse_args(argv)
    benches: dict[tuple[str, int], dict[str, Split]] = {}
    for model in args.models:
        profile = _profile(model, args.reprofile)
        for ranks in args.ranks:
            splits = splits_of(plans_for(profile, ranks, args.global_batch, parse_size(args.memory)))
            plan = splits["autopp"].plan
            print(f"{model}, {ranks} ranks: 1F1B m {plan.num_microbatches} x microbatch size {plan.microbatch_size}",
                  file=sys.stderr, flush=True)
            benches[(model, ranks)] = splits
    run_rounds(benches, args.rounds, args.steps, args.timeout)
    lines = list(HEADER)
    for (model, ranks), splits in benches.items():
        lines += table(model, ranks, splits)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
