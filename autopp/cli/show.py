"""`autopp show`: draw a plan's simulated timeline and memory, or a run report's measured timeline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import AutoppError
from ..preflight import check_output_file

if TYPE_CHECKING:
    from ..data.plan import Plan

__all__ = ["add_parser", "PICTURE_SUFFIXES"]

#: The picture formats `show -o` writes (matplotlib's, by suffix).
PICTURE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg")


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The `show` command."""
    p = sub.add_parser("show", help="draw a plan's simulated timeline and memory, or a run's measured timeline")
    p.add_argument("file", help="plan JSON, or a run report JSON (measured drawn above predicted)")
    p.add_argument("-o", "--output", help="PNG path (default PLAN.png)")
    p.add_argument("--trace", help="also write a Chrome/Perfetto trace JSON here")
    p.set_defaults(func=_cmd_show)


def _show_report(path: Path, out: Path) -> int:
    from ..data.plan import load_plan
    from ..predict import simulate_plan
    from ..run import draw_report, load_report
    from ..run.timeline import drawn_ranks, measured_headline, predicted_headline
    report = load_report(path)
    plan_path = report.get("plan_path")
    plan = load_plan(plan_path) if plan_path and Path(plan_path).is_file() else None
    if not drawn_ranks(report) and not report.get("complete"):  # the run stopped before measurements came back
        error = str(report.get("error") or "").splitlines()
        raise AutoppError(f"{path}: the report has no per-rank measurements, so there is no timeline to draw (the "
                          f"run stopped early{': ' + error[0] if error else ''}); `autopp run` the plan again")
    if not drawn_ranks(report):  # a complete run that times no action (vocabulary parallelism's: its note says)
        if plan is None:
            raise AutoppError(f"{path}: the run recorded no per-rank actions (the report's notes say why) and its "
                              f"plan {plan_path} is not found: there is no timeline to draw")
        return _show_predicted_only(report, plan, out)
    predicted = simulate_plan(plan) if plan is not None else None
    draw_report(report, predicted, out)
    figures = f"measured {measured_headline(report)}" + (
        f"; predicted {predicted_headline(report, predicted)}" if predicted else "")
    print(f"wrote measured{' and predicted' if predicted else ''} timelines {out} ({figures})")
    if predicted is None:
        print(f"(plan {plan_path} not found: measured timeline only)", file=sys.stderr)
    return 0


def _show_predicted_only(report: dict[str, Any], plan: Plan, out: Path) -> int:
    """A complete run whose ranks timed no action: the plan's simulated timeline, titled with the measured step."""
    from ..display import format_predicted_step
    from ..predict import simulate_plan
    from ..run.timeline import measured_headline
    from ..schedule import draw_timeline
    result = simulate_plan(plan)
    measured = f"measured {measured_headline(report, drawn_step=False)}, no per-rank actions recorded"
    predicted = f"predicted {format_predicted_step(plan, result.step_time_s)}"
    draw_timeline(result, out, title=f"{_plan_title(plan)}: {measured}", headline=predicted)
    print(f"wrote the predicted timeline {out} ({measured}: the report's notes say why; {predicted})")
    return 0


def _plan_title(plan: Plan) -> str:
    """What a plan's picture draws: the model, its schedule, layout and microbatches, fused kernels where its profile
    counted them, as the plan's headline says (simulated)."""
    from ..display import format_chunks, format_grid, format_microbatches
    return (f"{Path(plan.model_path).name}: {plan.schedule.value}, {format_grid(plan.layout)}, "
            f"{format_microbatches(plan.num_microbatches, plan.microbatch_size)}"
            f"{', vocabulary parallelism ' + plan.vocab.value if plan.vocab else ''}"
            f"{', ' + format_chunks(plan) if plan.seq_chunks else ''}"
            f"{', fused kernels' if plan.kernels == 'fused' else ''} (simulated)")


def _cmd_show(args: argparse.Namespace) -> int:
    from ..jsonio import read_json
    from ..data.plan import load_plan
    path = Path(args.file)
    data = read_json(path, "plan or report file", advice="give a file written by `autopp plan` or `autopp run`")
    out = check_output_file(args.output or path.with_suffix(".png"), "-o" if args.output else None)
    if out.suffix.lower() not in PICTURE_SUFFIXES:
        given = out.suffix or "no suffix"
        raise AutoppError(f"-o {out}: a picture is written as {', '.join(PICTURE_SUFFIXES)}, not {given}; give a "
                          "path ending in .png")
    out.parent.mkdir(parents=True, exist_ok=True)  # as plan, export and run create theirs
    if args.trace:
        check_output_file(args.trace, "--trace")
    if isinstance(data, dict) and "grad_rtol" in data:
        return _show_report(path, out)
    plan = load_plan(path)
    from ..display import format_breakdown, format_predicted_step
    from ..predict import simulate_plan
    from ..schedule import draw_timeline, write_chrome_trace
    result = simulate_plan(plan)
    title = _plan_title(plan)
    headline = format_predicted_step(plan, result.step_time_s)  # the plan's stored figures, as `autopp plan` prints
    draw_timeline(result, out, title=title, headline=headline)
    print(f"wrote timeline {out} ({headline})")
    if plan.time_breakdown is not None:
        print(format_breakdown(plan))
    if args.trace:
        write_chrome_trace(result, args.trace)
        print(f"wrote trace {args.trace} (open in chrome://tracing or ui.perfetto.dev)")
    return 0
