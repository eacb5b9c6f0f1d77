"""Each pipeline stage of a split timed in context, as its rank runs it, against the profile's per-unit sums.

Issue 29, item 1. For examples/gpt.py's 2-rank 1F1B plans of scripts/bench_split_runtime.py (autopp's split, the
even and the parameter-balanced one), this cuts the model where each plan cuts it (autopp.model.split.split_model:
the pieces the runner builds), feeds each stage piece its real input, and runs the stage's own actions in its rank's
1F1B order (the last stage with its loss after each forward, as torch's schedules do), --rounds times, timing each F
and B on the thread's CPU clock (time.thread_time: the time the code computed, without the time other processes
held the core; run it with --wall on a quiet machine). It prints per split and stage the median F and B in context
against the plan's (the profile's per-unit sums), and the step re-simulated with the in-context times (the plan's
links and schedule) next to the predicted step; then the gains over autopp's split both ways. What is absent: the
other rank's process (one co-runner slowed the head 5-7 % and a block not measurably on the CPU clock, docs/splits.md)
and the messages.

    .venv/bin/python scripts/bench_stage_context.py                  # 3 splits, 10 rounds: ~1 min
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from autopp.data.plan import Plan
from autopp.data.profile import load_profile
from autopp.model.contract import load_model_file
from autopp.model.split import split_model
from autopp.schedule import Kind, StageCost, build_schedule, simulate_named

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_split_runtime import plans_for  # noqa: E402  (a sibling script: the plans it runs)

ROOT = Path(__file__).resolve().parents[1]


def stage_times(plan: Plan, names: list[str], rounds: int, clock: Callable[[], float]) -> list[tuple[float, float]]:
    """Per stage, the median F (with the loss on the last stage) and B over rounds and microbatches, in context."""
    mf = load_model_file(ROOT / "examples" / "gpt.py")
    torch.manual_seed(0)
    inputs, target = mf.sample_batch(plan.microbatch_size, seed=0)
    pipe = split_model(mf.build(0), tuple(inputs), [names[a] for a, _ in (s.units for s in plan.stages[1:])])
    pieces = [pipe.get_stage_module(i) for i in range(len(plan.stages))]
    feeds: list[Any] = [tuple(inputs)]
    with torch.no_grad():
        for piece in pieces[:-1]:
            feeds.append((piece(*feeds[-1]),))
    order = build_schedule(plan.schedule, len(pieces), plan.num_microbatches)
    out = []
    for s, piece in enumerate(pieces):
        last, times = s == len(pieces) - 1, {Kind.F: [], Kind.B: []}  # type: dict[Kind, list[float]]
        for _ in range(rounds + 1):
            pending: dict[int, Any] = {}
            for action in order[s]:
                t0 = clock()
                if action.kind is Kind.F:
                    args = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in feeds[s])
                    y = piece(*args)
                    pending[action.microbatch] = mf.loss_fn(y, target) if last else y
                else:
                    y = pending.pop(action.microbatch)
                    y.backward(None if last else torch.ones_like(y))
                times[action.kind].append(clock() - t0)
            piece.zero_grad(set_to_none=True)
        m = plan.num_microbatches
        out.append((statistics.median(times[Kind.F][m:]), statistics.median(times[Kind.B][m:])))  # round 0: warm-up
    return out


def resimulated(plan: Plan, times: list[tuple[float, float]]) -> float:
    """The plan's step simulated with `times` as its stages' F and B (I = W = B / 2), with its links and optimizer."""
    costs = [StageCost(forward_s=f, backward_input_s=b / 2, backward_weight_s=b / 2, overhead_s=s.overhead_s)
             for (f, b), s in zip(times, plan.stages)]
    sim = simulate_named(plan.schedule, plan.layout.pp, plan.num_microbatches, costs,
                         [s.send_s for s in plan.stages[:-1]], plan.layout.v,
                         progress_s=[s.progress_s for s in plan.stages[:-1]])
    return sim.step_time_s + plan.predicted.optimizer_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--wall", action="store_true", help="time on the wall clock (time.perf_counter)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    clock = time.perf_counter if args.wall else time.thread_time
    profile = load_profile(ROOT / "profiles" / "gpt")
    names = [str(n) for n in profile.units.drop_duplicates("unit").sort_values("unit").name]
    plans = plans_for(profile, 2, 8, 1 << 30)
    print(f"gpt, 2 ranks, {args.rounds} rounds, {'wall' if args.wall else 'CPU'} clock, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| split | stage | units | F in context / plan ms | B in context / plan ms | step predicted | "
          "step re-simulated in context |\n|---|---|---|---|---|---|---|")
    steps: dict[str, tuple[float, float]] = {}
    for name, plan in plans.items():
        times = stage_times(plan, names, args.rounds, clock)
        steps[name] = (plan.predicted.step_time_s, resimulated(plan, times))
        for (f, b), s in zip(times, plan.stages):
            print(f"| {name} | {s.index} | {s.units[0]}-{s.units[1] - 1} | {1e3 * f:.2f} / {1e3 * s.forward_s:.2f} | "
                  f"{1e3 * b:.2f} / {1e3 * s.backward_s:.2f} | {1e3 * steps[name][0]:.1f} | "
                  f"{1e3 * steps[name][1]:.1f} |")
    ours = steps["autopp"]
    for name in list(plans)[1:]:
        print(f"gain over {name}: predicted {100 * (steps[name][0] / ours[0] - 1):+.1f} %, in context "
              f"{100 * (steps[name][1] / ours[1] - 1):+.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
