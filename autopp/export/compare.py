"""The user's configuration beside autopp's plan: step time, bubble, memory, and how much faster autopp's is."""

from __future__ import annotations

from typing import Sequence

from ..data.axes import AXES
from ..data.layout import LayoutPins
from ..data.plan import Plan
from ..display import format_grid, stage_sizes
from ..schedule import policy
from ..sizes import format_in, size_unit, time_unit

__all__ = ["format_comparison", "time_terms"]


def _describe(p: Plan) -> str:
    stages = stage_sizes([s.units for s in p.stages])
    rc = sum(policy(s.activation).redoes_forward for s in p.stages)
    how = f", {p.stages[0].activation.value} recompute" if rc == len(p.stages) and rc else \
        f", recompute {rc} stages" if rc else ""
    return (f"{p.schedule.value} {format_grid(p.layout)}, v {p.layout.v}, "
            f"{p.num_microbatches} x {p.microbatch_size}, units per stage {stages}{how}")


def time_terms(plan: Plan) -> list[tuple[str, float]]:
    """Where a plan's predicted step goes, terms that add up to its step time: the pipeline's busy time (per rank,
    on average: forward, backward, recomputation, tensor-parallel collectives, sends), its idle time (the bubble),
    then what the step adds after the pipeline drains (the data-parallel synchronisation and the optimizer step:
    `Prediction.allreduce_s`, `optimizer_s`). A new term of the prediction is one more entry here."""
    p = plan.predicted
    pipeline = max(0.0, p.step_time_s - p.allreduce_s - p.optimizer_s)
    return [("compute and sends", pipeline * (1 - p.bubble_fraction)),
            ("pipeline bubble", pipeline * p.bubble_fraction),
            ("data-parallel sync", p.allreduce_s), ("optimizer step", p.optimizer_s)]


def _time_rows(yours: Plan, ours: Plan, unit: tuple[str, float]) -> list[tuple[str, str, str]]:
    """`time_terms` of both plans, each as time in `unit` and share of its step; terms 0 in both left out."""
    def cell(seconds: float, step: float) -> str:
        return f"{format_in(seconds, unit)} ({seconds / step:.0%})" if step > 0 else format_in(seconds, unit)
    return [(f"  {label}", cell(a, yours.predicted.step_time_s), cell(b, ours.predicted.step_time_s))
            for (label, a), (_, b) in zip(time_terms(yours), time_terms(ours)) if a > 0 or b > 0]


def _held(yours: Plan, pins: LayoutPins | None) -> str:
    """The pins of autopp's search that your configuration does not keep ("`pp` 4 (yours 8)"); "" for none."""
    if pins is None:
        return ""
    held = [f"`{a}` {getattr(pins, a)} (yours {getattr(yours.layout, a)})" for a in ("v", *AXES)
            if getattr(pins, a) is not None and getattr(pins, a) != getattr(yours.layout, a)]
    if pins.zero is not None and pins.zero != yours.layout.zero:
        held.append(f"`zero` {pins.zero.stage} (yours {yours.layout.zero.stage})")
    return ", ".join(held)


def format_comparison(yours: Plan, ours: Plan, source: str, notes: Sequence[str] = (),
                      pins: LayoutPins | None = None) -> str:
    """A table of both plans' predicted figures (the same simulator), where each one's step goes, and the speed-up
    of autopp's; where yours is faster, why autopp's search did not find it: the `pins` it was held to that yours
    does not keep, else that it lies outside the search."""
    lines = [f"\nyour configuration ({source}) beside autopp's plan, both predicted by the same simulator:",
             f"  yours:  {_describe(yours)}", f"  autopp: {_describe(ours)}",
             f"  {'':<20} {'yours':>16} {'autopp':>16}"]
    steps = (yours.predicted.step_time_s, ours.predicted.step_time_s)  # each row in one unit: 9595 ms, 11200 ms
    peaks = (max(yours.predicted.peak_memory_bytes), max(ours.predicted.peak_memory_bytes))
    t, m = time_unit(steps), size_unit(max(peaks))
    rows = [("step time", format_in(steps[0], t), format_in(steps[1], t)), *_time_rows(yours, ours, t),
            ("bubble", f"{yours.predicted.bubble_fraction:.1%}", f"{ours.predicted.bubble_fraction:.1%}"),
            ("peak memory", format_in(peaks[0], m), format_in(peaks[1], m)),
            ("fits", "yes" if yours.predicted.fits else "NO", "yes" if ours.predicted.fits else "NO")]
    lines += [f"  {label:<20} {a:>16} {b:>16}" for label, a, b in rows]
    speedup = yours.predicted.step_time_s / ours.predicted.step_time_s if ours.predicted.step_time_s else 1.0
    verdict = (f"autopp's plan is predicted {speedup:.2f}x as fast as yours "
               f"({(1 - 1 / speedup):.0%} less time per step)" if speedup > 1.0005 else
               "your configuration is predicted as fast as autopp's plan" if speedup > 0.9995 else
               f"your configuration is predicted {1 / speedup:.2f}x as fast as autopp's plan ("
               + (f"autopp's search was held to {held}" if (held := _held(yours, pins)) else
                  "it lies outside autopp's search, e.g. more memory than `memory_bytes` allows") + ")")
    lines.append(f"  {verdict}")
    lines += [f"  note: {n}" for n in (*notes, *yours.notes[1:])]
    return "\n".join(lines)
