"""Human-readable tables of profiles and plans (the CLI prints these; the library never prints)."""

from __future__ import annotations

from .data.layout import Layout
from .data.plan import Plan, Prediction
from .data.profile import Profile
from .sizes import format_size, format_time

__all__ = ["format_profile", "sync_name", "format_grid", "format_plan", "format_predicted_step"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_profile(profile: Profile) -> str:
    """One row per unit at each microbatch size."""
    rows = [[str(r.unit), r.name, str(r.microbatch_size), format_time(r.forward_s), format_time(r.backward_s),
             format_size(r.param_bytes), format_size(r.activation_bytes), format_size(r.output_bytes)]
            for r in profile.units.sort_values(["microbatch_size", "unit"]).itertuples()]
    header = ["unit", "name", "mb", "forward", "backward", "params", "activations", "output"]
    return _table(header, rows)


def _summary(name: str, pred: Prediction) -> list[str]:
    return [name, format_time(pred.step_time_s), f"{pred.bubble_fraction:.1%}", format_size(max(pred.peak_memory_bytes)),
            "yes" if pred.fits else "NO", f"{pred.efficiency:.1%}", " | ".join(f"{a}-{b - 1}" for a, b in pred.stage_units)]


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def format_predicted_step(plan: Plan, pipeline_s: float | None = None) -> str:
    """The plan's stored prediction as every view prints it (the plan table, `autopp show` and its PNG): step time
    and bubble. With `pipeline_s` (the simulated pipeline a timeline draws), also what the step adds to it."""
    p = plan.predicted
    parts = [f"{name} {format_time(s)}" for name, s in (("optimizer", p.optimizer_s), (sync_name(plan), p.allreduce_s))
             if s > 0]
    split = f" (pipeline {format_time(pipeline_s)} + {' + '.join(parts)})" if pipeline_s is not None and parts else ""
    return f"step {format_time(p.step_time_s)}{split}, bubble {p.bubble_fraction:.1%}"


def sync_name(plan: Plan) -> str:
    """What the plan's data-parallel collectives after the last backward are (`Prediction.allreduce_s`)."""
    zero = plan.layout.zero
    if zero.replicated:
        return "all-reduce"
    return f"{zero} all-gather" if zero.scatters_each_microbatch else f"{zero} reduce-scatter + all-gather"


def format_grid(layout: Layout) -> str:
    """A parallel layout (a plan's, a run report's) as every view prints it: "pp 4 x dp 2", "pp 2 x dp 2 x tp 2,
    ZeRO 3"; the axes of degree 1 beyond pp and dp left out."""
    axes = [a for a in ("cp", "tp", "ep") if getattr(layout, a) > 1]
    return f"pp {layout.pp} x dp {layout.dp}" + "".join(f" x {a} {getattr(layout, a)}" for a in axes) \
        + (f", {layout.zero}" if not layout.zero.replicated else "")


def format_plan(plan: Plan) -> str:
    """The stage table, then the plan's predicted figures next to each baseline's and the ideal bound."""
    rows = [[str(s.index), str(s.rank), f"{s.units[0]}-{s.units[1] - 1} ({', '.join(s.unit_names)})",
             format_time(s.forward_s), format_time(s.backward_s), s.activation.value,
             format_size(s.memory_bytes)] for s in plan.stages]
    stages = _table(["stage", "rank", "units", "forward/mb", "backward/mb", "activations", "rank peak memory"], rows)
    own = "pinned" if "autopp" in plan.baselines else "autopp"  # --split: autopp's choice is a baseline
    summary = _table(["split", "step time", "bubble", "max memory", "fits", "efficiency", "stages (units)"],
                     [_summary(own, plan.predicted)]
                     + [_summary(k, v) for k, v in plan.baselines.items()]
                     + [["ideal", format_time(plan.ideal_step_time_s), "0.0%", "", "", "100.0%",
                         "total work / devices"]])
    head = (f"{plan.schedule.value} on {plan.num_ranks} ranks ({format_grid(plan.layout)}, "
            f"{_count(plan.layout.v, 'stage')} "
            f"per rank), {_count(plan.num_microbatches, 'microbatch', 'microbatches')} of {plan.microbatch_size} per replica (global batch "
            f"{plan.global_batch}), memory limit {format_size(plan.memory_limit_bytes)} per device")
    extra = f"\n{sync_name(plan)} {format_time(plan.predicted.allreduce_s)} at the step's end included" \
        if plan.layout.dp > 1 else ""
    unfit = [k for k, v in [(own, plan.predicted), *plan.baselines.items()] if not v.fits]
    notes = "".join(f"\nnote: {n}" for n in plan.notes)
    notes += f"\nnote: does not fit (a rank's simulated peak exceeds its device's memory): {', '.join(unfit)}" \
        if unfit else ""
    return (f"{head}\n\n{stages}\n\n{summary}\n(simulated; efficiency = ideal step time / predicted step time)"
            f"{extra}{notes}")
