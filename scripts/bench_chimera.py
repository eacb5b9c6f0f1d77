"""Benchmark: Chimera (Li and Hoefler, SC'21) against the other schedules on the paper's own setup, simulated.

GPT-2 1.3B (48 layers, hidden 1600, 25 heads; examples/configs/gpt2-1.3b.json) profiled analytically in float32 for
one Tesla P100 per node on Cray Aries (scripts/devices/p100-piz-daint.json: Piz Daint, the paper's machine), one
microbatch sample per microbatch. For each pipeline depth p and microbatch count m, every schedule is planned with
the pipeline pinned (pp p, dp 1), its split and per-stage recomputation chosen by the planner (`recompute` auto:
the paper recomputes where memory runs short), and simulated; the table gives the step time (the replicas' gradient
all-reduce included for Chimera), the mean idle fraction, the largest rank's peak memory, and Chimera's speed-up
over each. The paper reports up to 50 % fewer bubbles and 1.16x-2.34x throughput over the synchronous and
asynchronous pipelines it compares with (GPipe, GEMS, DAPPLE's 1F1B, PipeDream-2BW), at scale with data parallelism.

    python scripts/bench_chimera.py [--profile DIR] [--depths 4,8,16]

The profile is made (about a minute) when DIR does not hold one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopp.data.catalog import cluster_from_catalog, load_device  # noqa: E402
from autopp.data.layout import LayoutPins  # noqa: E402
from autopp.data.profile import load_profile  # noqa: E402
from autopp.errors import AutoppError  # noqa: E402
from autopp.schedule import ScheduleName  # noqa: E402
from autopp.solve import PlanRequest, RecomputeMode, make_plan  # noqa: E402

__all__ = ["main"]

CONFIG = ROOT / "examples" / "configs" / "gpt2-1.3b.json"
DEVICE = ROOT / "scripts" / "devices" / "p100-piz-daint.json"
SEQ_LEN = 632
SCHEDULES = (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.INTERLEAVED_1F1B,
             ScheduleName.ZBV_ZERO_BUBBLE, ScheduleName.CHIMERA)


def _profile(where: Path) -> None:
    if (where / "meta.json").is_file():
        return
    subprocess.run([sys.executable, "-m", "autopp", "profile", "--hf-config", str(CONFIG), "--seq-len",
                    str(SEQ_LEN), "--analytic", str(DEVICE), "--dtype", "float32", "--microbatch-sizes", "1",
                    "-o", str(where)], check=True, cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=Path("/tmp/autopp-gpt2-1.3b-p100"))
    ap.add_argument("--depths", default="4,8,16")
    args = ap.parse_args(argv)
    _profile(args.profile)
    profile, spec = load_profile(args.profile), load_device(str(DEVICE))
    print(f"GPT-2 1.3B, seq {SEQ_LEN}, float32, analytic on {spec.name}; recompute auto; pp p, dp 1, microbatch 1")
    print(f"{'p':>3} {'m':>4}  {'schedule':<22} {'step s':>8} {'bubble':>7} {'peak GB':>8} {'recomp':>6} "
          f"{'Chimera x':>9}")
    for p in (int(x) for x in args.depths.split(",")):
        for m in (p, 2 * p):
            rows = {}
            for name in SCHEDULES:
                req = PlanRequest(cluster=cluster_from_catalog(spec, p), global_batch=m, num_microbatches=m,
                                  schedule=name, pins=LayoutPins(pp=p, dp=1), recompute=RecomputeMode.AUTO)
                try:
                    rows[name] = make_plan(profile, req)
                except AutoppError as exc:
                    print(f"{p:>3} {m:>4}  {name.value:<22} {'-':>8}  {str(exc)[:60]}")
            chimera = rows.get(ScheduleName.CHIMERA)
            for name, plan in rows.items():
                pr = plan.predicted
                recomputing = sum(s.activation.value != "keep" for s in plan.stages)
                ratio = f"{pr.step_time_s / chimera.predicted.step_time_s:9.2f}" if chimera else f"{'-':>9}"
                print(f"{p:>3} {m:>4}  {name.value:<22} {pr.step_time_s:8.3f} {pr.bubble_fraction:7.3f} "
                      f"{max(pr.peak_memory_bytes) / 1e9:8.2f} {recomputing:>6} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
