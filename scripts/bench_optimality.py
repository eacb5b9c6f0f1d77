"""How far the planner's plan is from the simulator's optimum: for small random and adversarial profiles (<= 12 units,
<= 4 stages), plan with `make_plan` pinned to one schedule, pp, v and m (recompute auto), brute-force every
contiguous split x every per-stage activation policy under the same simulator (autopp.solve.partition.brute), and
print the gap per case, the worst and the median, and whether any baseline split that fits beats the plan.

    .venv/bin/python scripts/bench_optimality.py            # every case (about 2 minutes on 2 cores)
    .venv/bin/python scripts/bench_optimality.py --only gpt # the cases whose name contains "gpt"
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, replace

from autopp.data.cluster import DEFAULT_LINK, Cluster, Device, Link
from autopp.data.layout import Layout, LayoutPins
from autopp.costmodel import unit_arrays
from autopp.errors import InfeasibleError
from autopp.data.plan import Plan
from autopp.data.profile import Profile, load_profile
from autopp.schedule import Activation, ScheduleName
from autopp.solve import PlanRequest, RecomputeMode, make_plan
from autopp.solve.partition.baselines import baseline_bounds
from autopp.solve.partition.brute import BruteForce, brute_force
from autopp.solve.search.judge import Candidate, judge
from autopp.solve.search.runnable import schedule_refusal
from autopp.data.synthetic_profile import synthetic_profile

GiB = 2**30
AMPLE = 1 << 50
#: 33.5 MB boundary tensors of the synthetic profiles cross in 3.4 ms, against 8 ms of forward per block.
LINK = Link(latency_s=20e-6, bandwidth_bytes_per_s=10e9)
SLOW = Link(latency_s=200e-6, bandwidth_bytes_per_s=1e9)
S1F1B, GPIPE = ScheduleName.ONE_F_ONE_B, ScheduleName.GPIPE
INTER, ZBV = ScheduleName.INTERLEAVED_1F1B, ScheduleName.ZBV_ZERO_BUBBLE


@dataclass(frozen=True)
class Case:
    """One benchmark case: a profile, a cluster and the configuration both sides are pinned to."""

    name: str
    profile: Profile
    cluster: Cluster
    schedule: ScheduleName
    pp: int
    m: int
    v: int | None = None
    """Requested stages per rank (interleaved schedules); None: the schedule's own."""
    b: int = 1
    """Microbatch size (the global batch is b x m)."""
    memory: float | None = None
    """Device memory as a fraction of the peak of the time-balanced split without recomputation (None: ample)."""


def edited(profile: Profile, *, unit_scale: dict[int, dict[str, float]] | None = None,
           cut_scale: dict[int, float] | None = None, tag: str = "") -> Profile:
    """`profile` with some units' columns and some cuts' bytes (cut k: the edge into unit k) multiplied, at every
    profiled microbatch size."""
    units, edges = profile.units.copy(), profile.edges.copy()
    for u, cols in (unit_scale or {}).items():
        for col, factor in cols.items():
            rows = units.unit == u
            if col in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "recompute_s"):
                units.loc[rows, col] = units.loc[rows, col] * factor
            else:
                units.loc[rows, col] = (units.loc[rows, col] * factor).round().astype("int64")
    for k, factor in (cut_scale or {}).items():
        rows = edges.dst == k
        edges.loc[rows, "bytes"] = (edges.loc[rows, "bytes"] * factor).round().astype("int64")
    meta = replace(profile.meta, fingerprint=f"{profile.meta.fingerprint}-{tag}")
    return Profile(meta, units, edges)


def times(*cols: str, by: float) -> dict[str, float]:
    """The same factor for each column."""
    return {c: by for c in cols}


TIME = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "recompute_s")
BYTES = ("param_bytes", "grad_bytes", "optimizer_bytes")


def random_profile(n: int, seed: int) -> Profile:
    """A synthetic profile whose units' times, activations and cuts vary by up to 4x (seeded)."""
    rng = random.Random(seed)
    base = synthetic_profile(n, seed=seed, jitter=0.5)
    scale = {u: {**times(*TIME, by=rng.uniform(0.4, 2.0)), "activation_bytes": rng.uniform(0.3, 3.0)}
             for u in range(n)}
    return edited(base, unit_scale=scale, cut_scale={k: rng.uniform(0.2, 4.0) for k in range(1, n)},
                  tag=f"random{seed}")


def cases() -> list[Case]:
    uniform = Cluster(num_devices=4, memory_bytes=AMPLE, link=LINK)
    two = Cluster(num_devices=2, memory_bytes=AMPLE, link=LINK)
    # memory-bound first stage: the first blocks hold 3x the activations, 1F1B's stage 0 holds pp microbatches
    mem_first = edited(synthetic_profile(12), unit_scale={u: {"activation_bytes": 3.0} for u in (1, 2, 3)},
                       tag="memfirst")
    # a heavy boundary tensor at the natural cut (units 4 | 4 of 8): 20 x 33.5 MB, 67 ms on LINK
    heavy_cut = edited(synthetic_profile(8), cut_scale={4: 20.0}, tag="heavycut")
    # four stages, two slow cuts at the natural boundaries 3 and 9 of 12
    two_slow = edited(synthetic_profile(12), cut_scale={3: 8.0, 9: 8.0}, tag="twoslow")
    hetero = Cluster(num_devices=4, memory_bytes=AMPLE, link=LINK, links=(LINK, SLOW, LINK),
                     devices=(Device(memory_bytes=AMPLE, speed=1.0), Device(memory_bytes=AMPLE, speed=2.0),
                              Device(memory_bytes=AMPLE, speed=1.0), Device(memory_bytes=AMPLE, speed=0.5)))
    # head-heavy LM: a large vocabulary makes the head 4x a block's time and 6x its parameters
    head = edited(synthetic_profile(10), unit_scale={9: {**times(*TIME, by=8.0), **times(*BYTES, by=12.0)}},
                  tag="head")
    gpt = load_profile("profiles/gpt")
    gpt2, gpt4 = (Cluster(num_devices=d, memory_bytes=GiB, link=DEFAULT_LINK) for d in (2, 4))
    return [
        Case("random-0", random_profile(10, 0), uniform, S1F1B, 4, 8),
        Case("random-1", random_profile(12, 1), uniform, GPIPE, 4, 8, memory=0.8),
        Case("random-2", random_profile(10, 2), two, INTER, 2, 8, v=2),
        Case("random-3", random_profile(12, 3), two, ZBV, 2, 8),
        Case("random-4", random_profile(8, 4), uniform, S1F1B, 4, 16, memory=0.85),
        Case("random-5", random_profile(12, 5), uniform, S1F1B, 4, 8, memory=0.9),
        Case("random-6", random_profile(9, 6), two, GPIPE, 2, 4, memory=0.8),
        Case("random-7", random_profile(11, 7), two, INTER, 2, 8, v=2, memory=0.9),
        Case("random-8", random_profile(12, 8), two, ZBV, 2, 8, memory=0.9),
        Case("random-9", random_profile(7, 9), uniform, GPIPE, 4, 8),
        Case("mem-first-stage", mem_first, uniform, S1F1B, 4, 8, memory=0.75),
        Case("mem-first-stage", mem_first, uniform, GPIPE, 4, 8, memory=0.6),
        Case("heavy-cut", heavy_cut, two, S1F1B, 2, 8),
        Case("heavy-cut", heavy_cut, two, ZBV, 2, 8),
        Case("two-slow-cuts", two_slow, uniform, S1F1B, 4, 8),
        Case("two-slow-cuts", two_slow, two, INTER, 2, 8, v=2),
        Case("two-slow-cuts", two_slow, two, ZBV, 2, 8),
        Case("hetero-slow-link", edited(synthetic_profile(12), tag="h"), hetero, S1F1B, 4, 8),
        Case("hetero-slow-link", edited(synthetic_profile(12), tag="h"), hetero, GPIPE, 4, 8, memory=0.9),
        Case("head-heavy", head, uniform, S1F1B, 4, 8, memory=1.0),
        Case("head-heavy", head, uniform, GPIPE, 4, 8),
        Case("head-heavy", head, two, ZBV, 2, 8),
        Case("gpt", gpt, gpt2, S1F1B, 2, 8),
        Case("gpt", gpt, gpt4, S1F1B, 4, 8),
        Case("gpt", gpt, gpt4, S1F1B, 4, 16),
        Case("gpt", gpt, gpt2, INTER, 2, 8, v=2),
        Case("gpt-b4", gpt, gpt2, S1F1B, 2, 8, b=4),
        Case("gpt-b4", gpt, gpt4, S1F1B, 4, 8, b=4),
        Case("gpt-b4", gpt, gpt4, S1F1B, 4, 16, b=4),
    ]


def _with_memory(cluster: Cluster, memory: int) -> Cluster:
    devices = tuple(replace(d, memory_bytes=memory) for d in cluster.devices)
    return replace(cluster, memory_bytes=memory, devices=devices)


def _stages_per_rank(case: Case) -> int:
    return case.v or (2 if case.schedule in (ZBV, ScheduleName.DUAL_PIPE_V) else 1)


def sized(case: Case) -> Cluster:
    """The case's cluster, its memory set to `case.memory` x the peak of the time-balanced split (no recompute)."""
    if case.memory is None:
        return case.cluster
    a, v = unit_arrays(case.profile, case.b), _stages_per_rank(case)
    bounds = baseline_bounds(a, case.pp * v)["time"]
    verdict = judge(a, case.cluster, Candidate(schedule=case.schedule, layout=Layout(pp=case.pp, v=v),
                                               microbatches=case.m, microbatch_size=case.b, bounds=bounds,
                                               activations=(Activation.KEEP,) * len(bounds)))
    return _with_memory(case.cluster, int(case.memory * max(verdict.peak_memory)))


def plan_case(case: Case, cluster: Cluster) -> tuple[Plan | None, float]:
    req = PlanRequest(cluster=cluster, global_batch=case.b * case.m, num_microbatches=case.m, schedule=case.schedule,
                      pins=LayoutPins(pp=case.pp, dp=1, v=case.v), recompute=RecomputeMode.AUTO)
    start = time.perf_counter()
    try:
        plan: Plan | None = make_plan(case.profile, req)
    except InfeasibleError:
        plan = None
    return plan, time.perf_counter() - start


def brute_case(case: Case, cluster: Cluster, v: int) -> BruteForce:
    live = case.profile.meta.live_values
    return brute_force(unit_arrays(case.profile, case.b), cluster, case.schedule, layout=Layout(pp=case.pp, v=v),
                       m=case.m, microbatch_size=case.b,
                       admissible=lambda b: schedule_refusal(live, case.schedule, b) is None)


def _fits(cluster: Cluster, peaks: tuple[int, ...]) -> bool:
    return all(p <= cluster.device(r).memory_bytes for r, p in enumerate(peaks))


def _split(bounds: tuple[tuple[int, int], ...]) -> str:
    return ",".join(str(i) for i, _ in bounds[1:])


def _flags(activations: tuple[Activation, ...]) -> str:
    return "".join("R" if a is Activation.RECOMPUTE else "-" for a in activations)


def run_case(case: Case) -> tuple[str, float | None, list[str]]:
    """The table row, the gap (None: autopp found no plan) and the baselines that fit and beat the plan."""
    cluster = sized(case)
    plan, plan_s = plan_case(case, cluster)
    v = plan.layout.v if plan is not None else _stages_per_rank(case)
    if plan is not None and plan.device_order:
        cluster = cluster.reordered(plan.device_order)
    start = time.perf_counter()
    brute = brute_case(case, cluster, v)
    brute_s = time.perf_counter() - start
    b = brute.best
    mem = "ample" if case.memory is None else f"{cluster.memory_bytes / 2**20:.0f} MiB"
    gap = None
    beaten: list[str] = []
    if plan is not None:
        auto = plan.predicted.step_time_s
        gap = (auto - b.step_s) / b.step_s if b is not None else float("inf")
        beaten = [f"{name} {p.step_time_s:.4g} s" for name, p in plan.baselines.items()
                  if _fits(cluster, p.peak_memory_bytes) and p.step_time_s < auto * (1 - 1e-12)]
        split = _split(tuple(s.units for s in plan.stages))
        flags = _flags(tuple(s.activation for s in plan.stages))
        auto_cols = f"{auto:.5g} | {_yes(_fits(cluster, plan.predicted.peak_memory_bytes))} | {split} | {flags}"
    else:
        auto_cols = "infeasible | - | - | -"
    brute_cols = f"{b.step_s:.5g} | {_split(b.candidate.bounds)} | {_flags(b.candidate.activations)}" \
        if b is not None else "none fits | - | -"
    gap_col = "-" if gap is None else f"{gap:+.1%}"
    row = (f"| {case.name} | {case.schedule.value} | {case.pp} | {v} | {case.m} | {case.b} | {mem} | {auto_cols} | "
           f"{brute_cols} | {gap_col} | {plan_s:.2f} | {brute.judged} / {brute_s:.1f} |")
    return row, gap, beaten


def _yes(x: bool) -> str:
    return "yes" if x else "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
    args = parser.parse_args()
    print("| case | schedule | pp | v | m | b | memory | autopp step s | autopp fits | autopp split | autopp recompute "
          "| brute step s | brute split | brute recompute | gap | plan s | brute judged / s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    gaps, beaten_all, no_plan = [], [], 0
    start = time.perf_counter()
    for case in cases():
        if args.only not in case.name:
            continue
        row, gap, beaten = run_case(case)
        print(row, flush=True)
        no_plan += gap is None
        if gap is not None:
            gaps.append(gap)
        beaten_all += [f"{case.name} {case.schedule.value} pp{case.pp} m{case.m}: {b}" for b in beaten]
    print()
    print("split: unit indices where stages 1.. begin; recompute: R = the stage recomputes, - = it does not")
    if gaps:
        print(f"worst gap {max(gaps):+.1%}, median gap {statistics.median(gaps):+.1%} over {len(gaps)} cases"
              + (f" ({no_plan} without a plan)" if no_plan else ""))
        below = sum(g < -1e-9 for g in gaps)
        print(f"cases where autopp beats the brute force (a bug in one of them; should be 0): {below}")
    print("baselines that fit and beat autopp's plan: " + ("; ".join(beaten_all) if beaten_all else "none"))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
