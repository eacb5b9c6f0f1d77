"""Time the planner's full search on synthetic transformer profiles and print a table (median, min-max of repeats)."""

from __future__ import annotations

import argparse
import statistics
import time

from autopp.data.cluster import Cluster, Link
from autopp.schedule import ScheduleName
from autopp.solve import PlanRequest, RecomputeMode, make_plan
from autopp.solve.synthetic import synthetic_profile

GiB = 2**30
FAST = Link(latency_s=10e-6, bandwidth_bytes_per_s=50e9)
#: (units, devices, global batch, memory GiB, schedule (None = auto), dp (None = auto), recompute)
CASES = [
    (32, 8, 64, 80, ScheduleName.ONE_F_ONE_B, 1, RecomputeMode.NONE),
    (128, 64, 256, 80, None, None, RecomputeMode.AUTO),
    (1000, 1024, 2048, 80, ScheduleName.ONE_F_ONE_B, None, RecomputeMode.AUTO),
    (1000, 1024, 2048, 80, None, None, RecomputeMode.AUTO),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| units | devices | batch | schedule | dp | recompute | chosen | step s | efficiency | plan s median (min-max) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, d, batch, mem, sched, dp, rc in CASES:
        profile = synthetic_profile(n)
        req = PlanRequest(cluster=Cluster(num_devices=d, memory_bytes=mem * GiB, link=FAST), global_batch=batch,
                          schedule=sched, dp=dp, recompute=rc)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = make_plan(profile, req)
            times.append(time.perf_counter() - start)
        chosen = f"{plan.schedule.value} pp{plan.pp} dp{plan.dp} v{plan.virtual_stages} m{plan.num_microbatches}"
        print(f"| {n} | {d} | {batch} | {sched.value if sched else 'auto'} | {dp or 'auto'} | {rc.value} | {chosen} | "
              f"{plan.predicted.step_time_s:.3f} | {plan.predicted.efficiency:.1%} | "
              f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) |", flush=True)


if __name__ == "__main__":
    main()
