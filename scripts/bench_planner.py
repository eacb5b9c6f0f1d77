"""Time the planner's full search on synthetic transformer profiles and print a table (median, min-max of repeats).

The last case is issue 17's goal: 1,024 H100s (128 nodes of 8, catalog links), 128 units with tensor-parallel rows
of degrees 2, 4 and 8, everything free (tp, ZeRO stage, dp, pp, schedule, v, m, recompute): under 30 s."""

from __future__ import annotations

import argparse
import statistics
import time

from autopp.data.catalog import cluster_from_catalog, load_device
from autopp.data.cluster import Cluster, Link
from autopp.data.layout import LayoutPins
from autopp.data.zero import NO_ZERO
from autopp.schedule import ScheduleName
from autopp.solve import PlanRequest, RecomputeMode, make_plan
from autopp.data.synthetic_profile import synthetic_profile

GiB = 2**30
FAST = Link(latency_s=10e-6, bandwidth_bytes_per_s=50e9)
#: (units, devices, global batch, memory GiB, schedule (None = auto), dp (None = auto), recompute, tp (None = auto),
#: ZeRO (None = auto)); a case with tp None plans for nodes of 8 H100s from the device catalog, the others for a flat
#: cluster of FAST links.
CASES = [
    (32, 8, 64, 80, ScheduleName.ONE_F_ONE_B, 1, RecomputeMode.NONE, 1, NO_ZERO),
    (128, 64, 256, 80, None, None, RecomputeMode.AUTO, 1, NO_ZERO),
    (1000, 1024, 2048, 80, ScheduleName.ONE_F_ONE_B, None, RecomputeMode.AUTO, 1, NO_ZERO),
    (1000, 1024, 2048, 80, None, None, RecomputeMode.AUTO, 1, NO_ZERO),
    (128, 1024, 2048, 80, None, None, RecomputeMode.AUTO, None, None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=None, help="comma-separated row numbers of CASES to run, from 0 (all)")
    args = parser.parse_args()
    picked = range(len(CASES)) if args.cases is None else [int(k) for k in args.cases.split(",")]
    print("| units | devices | batch | schedule | dp | tp | zero | recompute | chosen | step s | efficiency | "
          "plan s median (min-max) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, d, batch, mem, sched, dp, rc, tp, zero in (CASES[k] for k in picked):
        profile = synthetic_profile(n, tp_degrees=(2, 4, 8) if tp is None else ())
        cluster = Cluster(num_devices=d, memory_bytes=mem * GiB, link=FAST) if tp is not None else \
            cluster_from_catalog(load_device("h100-sxm"), None, nodes=d // 8, devices_per_node=8)
        req = PlanRequest(cluster=cluster, global_batch=batch, schedule=sched, recompute=rc,
                          pins=LayoutPins(dp=dp, tp=tp, zero=zero))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = make_plan(profile, req)
            times.append(time.perf_counter() - start)
        layout = plan.layout
        chosen = f"{plan.schedule.value} pp{layout.pp} dp{layout.dp} tp{layout.tp} zero{layout.zero.stage} " \
                 f"v{layout.v} m{plan.num_microbatches}"
        auto = lambda x: "auto" if x is None else x  # noqa: E731
        stage = None if zero is None else zero.stage
        print(f"| {n} | {d} | {batch} | {sched.value if sched else 'auto'} | {auto(dp)} | {auto(tp)} | {auto(stage)} | "
              f"{rc.value} | {chosen} | "
              f"{plan.predicted.step_time_s:.3f} | {plan.predicted.efficiency:.1%} | "
              f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) |", flush=True)


if __name__ == "__main__":
    main()
