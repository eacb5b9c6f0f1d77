"""Check: models whose values skip stages, planned for every named schedule (and auto) and run validated.

For each model file: one quick profile, then per schedule the planner's plan for `--ranks` devices (pp = ranks,
dp 1, `--microbatches` microbatches of one sample; "auto" lets the planner choose schedule, stages per rank and
microbatches, and synthesize an order, as `autopp plan --schedule auto` does), run on that many local CPU ranks
and validated against one process as `autopp run` does. Prints one row per model x schedule: verdict (PASSED,
FAILED, ERROR with the first line of the error, or n/a when the planner has no plan for it) and the worst gradient
error relative to the reference.

    .venv/bin/python scripts/check_models.py                      # the matrix: 7-18 min on 2 cores, by load
    .venv/bin/python scripts/check_models.py --models tests/models/unet.py --schedules 1F1B,GPipe
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopp.data.cluster import Cluster  # noqa: E402
from autopp.data.layout import LayoutPins  # noqa: E402
from autopp.errors import AutoppError  # noqa: E402
from autopp.measure import MeasureOptions, ProfileOptions, profile_model  # noqa: E402
from autopp.data.plan import Plan  # noqa: E402
from autopp.data.profile import Profile  # noqa: E402
from autopp.run import RunOptions, run_plan  # noqa: E402
from autopp.schedule import NAMED, ScheduleName  # noqa: E402
from autopp.solve import PlanRequest, make_plan  # noqa: E402

__all__ = ["Row", "MODELS", "plan_for", "check", "format_rows", "main"]

MODELS = ("tests/models/unet.py", "tests/models/hf_qwen2.py", "tests/models/hf_neox.py")
"""Models whose values skip stages: a U-Net's long skips, HF decoders' rotary tables and masks."""
AUTO = "auto"
MEMORY = 1 << 34
"""Bytes per device: ample, so memory never excludes a schedule here."""


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    model: str
    schedule: str
    ranks: int
    verdict: str
    worst_rel: float | None = None
    planned: str = ""
    """What the planner chose: schedule, stages per rank and microbatches."""
    seconds: float = 0.0


def plan_for(profile: Profile, schedule: str, ranks: int, microbatches: int) -> Plan:
    """The planner's plan for `schedule` (or auto) on `ranks` identical CPU devices, one sample per microbatch."""
    auto = schedule == AUTO
    request = PlanRequest(cluster=Cluster(num_devices=ranks, memory_bytes=MEMORY), global_batch=microbatches,
                          num_microbatches=None if auto else microbatches,
                          schedule=None if auto else ScheduleName(schedule), pins=LayoutPins(pp=ranks),
                          synthesize=auto)
    return make_plan(profile, request)


def check(profile: Profile, model: str, schedule: str, ranks: int, microbatches: int, steps: int,
          timeout_s: float) -> Row:
    """Plan and run one model x schedule; errors become the row's verdict."""
    start = time.perf_counter()
    try:
        plan = plan_for(profile, schedule, ranks, microbatches)
    except AutoppError as exc:
        return Row(model, schedule, ranks, f"n/a: {_first_line(exc)}")
    planned = f"{plan.schedule.value} v{plan.layout.v} m{plan.num_microbatches}"
    try:
        report = run_plan(plan, RunOptions(steps=steps, timeout_s=timeout_s, check=False))
    except AutoppError as exc:
        return Row(model, schedule, ranks, f"ERROR: {_first_line(exc)}", planned=planned,
                   seconds=time.perf_counter() - start)
    verdict = "PASSED" if report.passed else f"FAILED: {report.error}"
    return Row(model, schedule, ranks, verdict, report.grad_max_rel_diff, planned, time.perf_counter() - start)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else type(exc).__name__


def format_rows(rows: list[Row]) -> str:
    """A Markdown table."""
    lines = ["| model | schedule | ranks | planned | verdict | worst gradient error | seconds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        worst = "" if r.worst_rel is None else f"{r.worst_rel:.1e}"
        lines.append(f"| {Path(r.model).stem} | {r.schedule} | {r.ranks} | {r.planned} | {r.verdict} | {worst} | "
                     f"{r.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated model files")
    parser.add_argument("--schedules", default=",".join([s.value for s in NAMED] + [AUTO]),
                        help="comma-separated schedule names, 'auto' included")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8,
                        help="per step for the named schedules (DualPipeV needs 2 x ranks)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="check-models-") as tmp:
        for model in args.models.split(","):
            profile = profile_model(ROOT / model, ProfileOptions(microbatch_sizes=(1,)),
                                    MeasureOptions(warmup=1, repeats=1, compare_whole=False))
            profile.save(Path(tmp) / Path(model).stem)
            for schedule in args.schedules.split(","):
                rows.append(check(profile, model, schedule, args.ranks, args.microbatches, args.steps, args.timeout))
                print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print(format_rows(rows))
    return 0 if all(r.verdict == "PASSED" or r.verdict.startswith("n/a") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
