"""Predicted vs measured step time of planned runs on 2 CPU ranks, across schedules and microbatch counts.

For each model, schedule and microbatch count: plan with the public API (autopp.solve.make_plan on the stored
profile, or with --reprofile on a fresh one and the link measured and calibrated first by autopp.measure.links and
autopp.run.calibrate; pp 2, dp 1), run it with autopp.run.run_plan for --steps SGD steps (gloo, one thread per
rank), and print the predicted step time, the median measured step time over the steps after the first (with its
spread, max - min), the relative error, and where the time went:
  F/B meas/prof  sum over stages of the run's median F (B) per microbatch / the plan's (the profile's)
  busy           the busiest rank's compute time (F, I, W, B actions) in the median step
  wait           the longest median time a rank spent waiting for sends/receives
  resim, error   the simulator's step time fed with the run's own per-stage F, I, W (with the plan's message
                 overheads, transfer times and progress delays, or --hop-latency per transfer) plus the plan's
                 optimizer step, and the measured step's error against it: what is left once the profile matches
                 the run
  in step        the slowest rank's median time inside the schedule's step (the measured step minus the
                 optimizer step, the dp all-reduce and two barriers)
  optim          the slowest rank's median optimizer step + zero_grad (in the measured step; the plan charges the
                 profile's)
  memory err     per rank, (measured peak - predicted peak) / predicted (CPU: the runner's estimate, see
                 docs/run-report-format.md)

    .venv/bin/python scripts/bench_accuracy.py --reprofile           # mlp and gpt, 4 schedules, 2 and 4 microbatches
    .venv/bin/python scripts/bench_accuracy.py --models examples/mlp.py --schedules 1F1B --microbatches 2 4 8
    .venv/bin/python scripts/bench_accuracy.py --contention          # F+B alone vs two processes at once
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from autopp.data.cluster import DEFAULT_LINK, Cluster, Link
from autopp.data.layout import LayoutPins
from autopp.measure import MeasureOptions, ProfileOptions, profile_model
from autopp.measure.links import load_link, measure_links
from autopp.data.profile import Profile, load_profile
from autopp.data.plan import Plan
from autopp.run import RunOptions, RunReport, run_plan
from autopp.run.calibrate import calibrate_links
from autopp.schedule import ScheduleName, StageCost, describe, simulate_named
from autopp.solve import PlanRequest, make_plan

ROOT = Path(__file__).resolve().parents[1]


def _profile(model: Path, args: argparse.Namespace) -> Profile:
    """The stored profile, or (--reprofile) a fresh one at the benchmark's microbatch size, under today's load, with
    --co-runners processes training the model beside it."""
    if not args.reprofile:
        return load_profile(ROOT / "profiles" / model.stem)
    return profile_model(model, ProfileOptions(microbatch_sizes=(args.microbatch_size,)),
                         MeasureOptions(repeats=7, warmup=2, co_runners=args.co_runners))


def _link(args: argparse.Namespace) -> Link:
    """--links FILE; else (--reprofile) the link measured and calibrated now, beside the fresh profiles; else the
    assumed default."""
    if args.links:
        return load_link(args.links)
    if not args.reprofile:
        return DEFAULT_LINK
    return calibrate_links(measure_links(2)).link()


def _bench(model: Path, schedule: str, m: int, args: argparse.Namespace, profile: Profile, link: Link
           ) -> dict[str, object]:
    name = ScheduleName(schedule)
    request = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**36, link=link),
                          global_batch=m * args.microbatch_size,
                          num_microbatches=m, schedule=name,
                          pins=LayoutPins(pp=2, v=None if describe(name).single_stage else 2))
    plan = make_plan(profile, request)
    report = run_plan(plan, RunOptions(steps=args.steps, timeout_s=args.timeout, check=False))
    steady = list(report.step_times_s[1:]) or list(report.step_times_s)
    measured = statistics.median(steady)
    predicted = plan.predicted.step_time_s
    f_ratio = _ratio([st.forward_s for st in report.stage_times], [st.predicted_forward_s for st in report.stage_times])
    b_ratio = _ratio([st.backward_s for st in report.stage_times],
                     [st.predicted_backward_s for st in report.stage_times])
    compute = max(sum(e - s for _, s, e in r.actions) for r in report.ranks)
    resim = resimulate(plan, report, args.hop_latency)
    return {"model": model.stem, "schedule": schedule, "m": m, "predicted": predicted, "measured": measured,
            "spread": max(steady) - min(steady), "error": (measured - predicted) / predicted,
            "f_ratio": f_ratio, "b_ratio": b_ratio, "compute": compute,
            "wait": max(r.wait_s for r in report.ranks), "passed": report.passed,
            "resim": resim, "resim_error": (measured - resim) / resim,
            "optimizer": max(r.optimizer_s or 0.0 for r in report.ranks),
            "in_step": max(r.schedule_s or 0.0 for r in report.ranks),
            "memory": "/".join(f"{m.memory_error:+.0%}" if m.memory_error is not None else "-" for m in report.ranks)}


def resimulate(plan: Plan, report: RunReport, hop_s: float | None = None) -> float:
    """The simulator's step time with the per-stage F, I, W measured in this run and the plan's message overheads,
    transfer times (or `hop_s` per transfer) and progress delays, plus the plan's optimizer step: what the prediction
    would be if the profile had matched the run's action times. B-only schedules get I = W = B / 2. (The run's
    last-stage F includes its loss since issue 29, as the profile's does.)"""
    costs = []
    for st, planned in zip(report.stage_times, plan.stages):
        f, b = st.forward_s or 0.0, st.backward_s or 0.0
        i = st.input_s if st.input_s is not None else b / 2
        costs.append(StageCost(forward_s=f, backward_input_s=i, backward_weight_s=max(b - i, 0.0),
                               overhead_s=planned.overhead_s))
    comm = [s.send_s if hop_s is None else hop_s for s in plan.stages[:-1]]
    sim = simulate_named(plan.schedule, plan.layout.pp, plan.num_microbatches, costs, comm,
                         plan.layout.v, progress_s=[s.progress_s for s in plan.stages[:-1]])
    return sim.step_time_s + plan.predicted.optimizer_s


def _ratio(measured: list[float | None], predicted: list[float]) -> float:
    """sum measured / sum predicted over stages (how much slower the actions ran than profiled)."""
    got = sum(x for x in measured if x is not None)
    return got / sum(predicted) if sum(predicted) > 0 else float("nan")


_LOOP = """
import sys, time, torch
from autopp.model import load_model_file
torch.set_num_threads(1)
mf = load_model_file(sys.argv[1])
model = mf.build(0)
inputs, target = mf.sample_batch(int(sys.argv[2]), seed=0)
end = time.perf_counter() + float(sys.argv[3])
n, wall, cpu = 0, time.perf_counter(), time.process_time()
while time.perf_counter() < end:
    mf.loss_fn(model(*inputs), target).backward()
    n += 1
print((time.perf_counter() - wall) / n, (time.process_time() - cpu) / n)
"""


def _contention(model: Path, batch: int, seconds: float, rounds: int) -> None:
    """F+B of the whole model on one microbatch: one process alone vs two at once (alternating, median of rounds).

    The profiler times units in one process; a pipeline runs pp processes at once on the machine's cores."""
    import subprocess

    def run(n: int) -> tuple[float, float]:
        procs = [subprocess.Popen([sys.executable, "-c", _LOOP, str(model), str(batch), str(seconds)],
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                 for _ in range(n)]
        times = [tuple(float(x) for x in p.communicate()[0].split()) for p in procs]
        return statistics.mean(t[0] for t in times), statistics.mean(t[1] for t in times)

    alone, pair = [], []
    for _ in range(rounds):
        alone.append(run(1))
        pair.append(run(2))
    (a, a_cpu), (b, b_cpu) = [tuple(statistics.median(x[i] for x in xs) for i in range(2)) for xs in (alone, pair)]
    print(f"{model.stem}: F+B of batch {batch}: alone {a * 1e3:.2f} ms (cpu {a_cpu * 1e3:.2f} ms), two processes at "
          f"once {b * 1e3:.2f} ms each (cpu {b_cpu * 1e3:.2f} ms), wall ratio {b / a:.2f}, cpu ratio "
          f"{b_cpu / a_cpu:.2f} (median of {rounds} alternating rounds of {seconds:g} s; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["examples/mlp.py", "examples/gpt.py"])
    parser.add_argument("--schedules", nargs="+", default=["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
    parser.add_argument("--microbatches", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--microbatch-size", type=int, default=2, help="samples per microbatch (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first is left out (default 6)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--reprofile", action="store_true",
                        help="profile each model first at --microbatch-size instead of loading profiles/MODEL")
    parser.add_argument("--co-runners", type=int, default=1, metavar="N",
                        help="with --reprofile: processes training the model beside the profiler (default 1: the "
                             "other rank of the 2 sharing this host; 0 profiles alone)")
    parser.add_argument("--hop-latency", type=float, metavar="S",
                        help="communication time per stage-to-stage transfer in the re-simulation (default: the "
                             "plan's)")
    parser.add_argument("--links", help="plan with this links file from `autopp profile-links` (default: with "
                                        "--reprofile, measure and calibrate the link first; else assumed)")
    parser.add_argument("--contention", action="store_true",
                        help="instead: time the whole model's F+B alone vs two processes at once")
    args = parser.parse_args(argv)
    if args.contention:
        for model in args.models:
            _contention(ROOT / model, args.microbatch_size, 3.0, 5)
        return 0
    header = (f"{'model':<6} {'schedule':<16} {'m':>2} {'predicted':>10} {'measured':>10} {'spread':>8} "
              f"{'error':>7} {'F meas/prof':>11} {'B meas/prof':>11} {'busy':>8} {'wait':>8} {'resim':>8} "
              f"{'error':>7} {'in step':>8} {'optim':>7} {'memory err':>11} valid")
    link = _link(args)
    print(f"link: latency {link.latency_s * 1e6:.3g} us, bandwidth {link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, "
          f"per-message overhead {link.overhead_s * 1e6:.3g} us, progress delay {link.progress_s * 1e3:.3g} ms "
          f"({'from ' + args.links if args.links else 'measured now' if args.reprofile else 'assumed'})\n")
    print(header)
    errors, resim_errors = [], []
    for model in args.models:
        profile = _profile(ROOT / model, args)
        for schedule in args.schedules:
            for m in args.microbatches:
                try:
                    row = _bench(ROOT / model, schedule, m, args, profile, link)
                except Exception as exc:  # noqa: BLE001 - a benchmark row that fails is reported, not fatal
                    print(f"{Path(model).stem:<6} {schedule:<16} {m:>2} failed: {type(exc).__name__}: {exc}")
                    continue
                errors.append(abs(float(row["error"])))  # type: ignore[arg-type]
                resim_errors.append(abs(float(row["resim_error"])))  # type: ignore[arg-type]
                print(f"{row['model']:<6} {row['schedule']:<16} {row['m']:>2} {row['predicted']:>10.4f} "
                      f"{row['measured']:>10.4f} {row['spread']:>8.4f} {row['error']:>+7.0%} "
                      f"{row['f_ratio']:>11.2f} {row['b_ratio']:>11.2f} {row['compute']:>8.4f} {row['wait']:>8.4f} "
                      f"{row['resim']:>8.4f} {row['resim_error']:>+7.0%} {row['in_step']:>8.4f} {row['optimizer']:>7.4f} {row['memory']:>11} "
                      f"{'yes' if row['passed'] else 'NO'}", flush=True)
    if errors:
        print(f"\nmedian |error| {statistics.median(errors):.0%} over {len(errors)} runs (max {max(errors):.0%}); "
              f"re-simulated with the run's own action times: median |error| {statistics.median(resim_errors):.0%} "
              f"(max {max(resim_errors):.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
