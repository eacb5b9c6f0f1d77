"""The user's configuration beside autopp's plan: step time, bubble, memory, and how much faster autopp's is."""

from __future__ import annotations

from typing import Sequence

from ..data.plan import Plan
from ..display import format_grid, stage_sizes
from ..schedule import policy
from ..sizes import format_in, size_unit, time_unit

__all__ = ["format_comparison"]


def _describe(p: Plan) -> str:
    stages = stage_sizes([s.units for s in p.stages])
    rc = sum(policy(s.activation).redoes_forward for s in p.stages)
    return (f"{p.schedule.value} {format_grid(p.layout)}, v {p.layout.v}, "
            f"{p.num_microbatches} x {p.microbatch_size}, "
            f"units per stage {stages}" + (f", recompute {rc} stages" if rc else ""))


def format_comparison(yours: Plan, ours: Plan, source: str, notes: Sequence[str] = ()) -> str:
    """A table of both plans' predicted figures (the same simulator) and the speed-up of autopp's."""
    lines = [f"\nyour configuration ({source}) beside autopp's plan, both predicted by the same simulator:",
             f"  yours:  {_describe(yours)}", f"  autopp: {_describe(ours)}",
             f"  {'':<12} {'yours':>12} {'autopp':>12}"]
    steps = (yours.predicted.step_time_s, ours.predicted.step_time_s)  # each row in one unit: 9595 ms, 11200 ms
    peaks = (max(yours.predicted.peak_memory_bytes), max(ours.predicted.peak_memory_bytes))
    t, m = time_unit(steps), size_unit(max(peaks))
    for label, a, b in (("step time", format_in(steps[0], t), format_in(steps[1], t)),
                        ("bubble", f"{yours.predicted.bubble_fraction:.1%}", f"{ours.predicted.bubble_fraction:.1%}"),
                        ("peak memory", format_in(peaks[0], m), format_in(peaks[1], m))):
        lines.append(f"  {label:<12} {a:>12} {b:>12}")
    speedup = yours.predicted.step_time_s / ours.predicted.step_time_s if ours.predicted.step_time_s else 1.0
    verdict = (f"autopp's plan is predicted {speedup:.2f}x as fast as yours "
               f"({(1 - 1 / speedup):.0%} less time per step)" if speedup > 1.0005 else
               "your configuration is predicted as fast as autopp's plan" if speedup > 0.9995 else
               f"your configuration is predicted {1 / speedup:.2f}x as fast as autopp's plan (it lies outside "
               "autopp's search, e.g. more memory than --memory allows)")
    lines.append(f"  {verdict}")
    lines += [f"  note: {n}" for n in (*notes, *yours.notes[1:])]
    return "\n".join(lines)
