"""Human-readable tables of profiles and plans (the CLI prints these; the library never prints)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Sequence

from .data.axes import AXES
from .data.layout import Layout
from .data.plan import Plan, Prediction
from .sizes import format_in, format_size, format_time, size_unit, time_unit

if TYPE_CHECKING:  # pandas and networkx stay out of a rank's imports (autopp.run.worker)
    from .data.profile import Profile

__all__ = ["unit_span", "stage_sizes", "format_profile", "sync_name", "format_grid", "format_plan", "format_chunks",
           "format_breakdown", "format_predicted_step", "format_microbatches"]


def _table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    """Columns `left` aligned left (names), the others right (figures)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i in left else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _times(values: Sequence[float]) -> list[str]:
    """A column of durations in one unit (`time_unit`): 9595 ms and 11200 ms, never 9595 ms and 11.2 s."""
    unit = time_unit(values)
    return [format_in(v, unit) for v in values]


def _sizes(values: Sequence[float]) -> list[str]:
    """A column of byte counts in the binary unit of its largest (`size_unit`): 0.5 GiB and 45.6 GiB."""
    unit = size_unit(max(values, default=0))
    return [format_in(v, unit) for v in values]


def _columns(*columns: list[str]) -> list[list[str]]:
    return [list(row) for row in zip(*columns)]


_NUMBERED = re.compile(r"(.*?)(\d+)")


def unit_span(names: Sequence[str]) -> str:
    """Unit names as ranges: runs of numbered siblings collapsed (`model.layers.0-7`), and beyond three parts the
    first and the last only (`conv1 ... layer2.1`), so a stage of 40 layers reads in one short line."""
    parts: list[tuple[str, int, int] | str] = []
    for name in names:
        m = _NUMBERED.fullmatch(name)
        last = parts[-1] if parts else None
        if m and isinstance(last, tuple) and last[0] == m.group(1) and last[2] + 1 == int(m.group(2)):
            parts[-1] = (last[0], last[1], int(m.group(2)))
        else:
            parts.append((m.group(1), int(m.group(2)), int(m.group(2))) if m else name)
    text = [p if isinstance(p, str) else f"{p[0]}{p[1]}" + (f"-{p[2]}" if p[2] > p[1] else "") for p in parts]
    return ", ".join(text) if len(text) <= 3 else f"{text[0]} ... {text[-1]}"


def _stage_units(units: tuple[int, int], names: Sequence[str]) -> str:
    """`3-5 (model.layers.2-4)`; the names left out where they are the indices (an nn.Sequential's `0-3`)."""
    span, names_span = f"{units[0]}-{units[1] - 1}", unit_span(names)
    return span if names_span in (span, str(units[0])) else f"{span} ({names_span})"


def stage_sizes(stage_units: Sequence[tuple[int, int]]) -> str:
    """Units per stage with repeats counted, as Megatron writes layouts: `1 x6, 2, 3 x24, 2` (six stages of one
    unit, one of two, ...)."""
    runs: list[list[int]] = []
    for a, b in stage_units:
        if runs and runs[-1][0] == b - a:
            runs[-1][1] += 1
        else:
            runs.append([b - a, 1])
    return ", ".join(f"{n} x{k}" if k > 1 else str(n) for n, k in runs)


def format_profile(profile: Profile) -> str:
    """One row per unit at each microbatch size; each column of times and of sizes in one unit."""
    rows = list(profile.units.sort_values(["microbatch_size", "unit"]).itertuples())
    cols = [[str(r.unit) for r in rows], [r.name for r in rows], [str(r.microbatch_size) for r in rows],
            _times([r.forward_s for r in rows]), _times([r.backward_s for r in rows]),
            *(_sizes([getattr(r, c) for r in rows]) for c in ("param_bytes", "activation_bytes", "output_bytes"))]
    header = ["unit", "name", "mb", "forward", "backward", "params", "activations", "output"]
    return _table(header, _columns(*cols), left=(0, 1))


_RANGES_WIDTH = 60
"""Widest list of stage ranges (`0-2 | 3-5 | ...`) the summary prints; beyond it, units per stage (`3 x18, 2 x14`)."""


def _summary(plan: Plan, own: str) -> str:
    """The plan's predicted figures next to each baseline's and the ideal bound; times in one unit, memory in GiB."""
    rows = [(own, plan.predicted), *plan.baselines.items()]
    ranges = [" | ".join(f"{a}-{b - 1}" for a, b in p.stage_units) for _, p in rows]
    short = max(map(len, ranges)) <= _RANGES_WIDTH
    splits = ranges if short else [stage_sizes(p.stage_units) for _, p in rows]
    if plan.vocab is not None:  # the baselines split the plain model: a tester saw one split at two step times
        splits[0] += f" + {plan.vocab.value} (the baselines without)"
    times = _times([p.step_time_s for _, p in rows] + [plan.ideal_step_time_s])
    peaks = _sizes([max(p.peak_memory_bytes) for _, p in rows])
    body = [[name, times[i], f"{p.bubble_fraction:.1%}", peaks[i], "yes" if p.fits else "NO", f"{p.efficiency:.1%}",
             splits[i]] for i, (name, p) in enumerate(rows)]
    body.append(["ideal", times[-1], "0.0%", "", "", "100.0%", "unsharded work / devices"])
    return _table(["split", "step time", "bubble", "max memory", "fits", "efficiency",
                   "stages (units)" if short else "units per stage"], body, left=(0, 6))


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def format_microbatches(count: int, size: int) -> str:
    """"1 microbatch of 8", "4 microbatches of 2": a plan's microbatches per replica and their size, as every view
    says them."""
    return f"{_count(count, 'microbatch', 'microbatches')} of {size}"


def format_predicted_step(plan: Plan, pipeline_s: float | None = None) -> str:
    """The plan's stored prediction as every view prints it (the plan table, `autopp show` and its PNG): step time
    and bubble. With `pipeline_s` (the simulated pipeline a timeline draws), also what the step adds to it."""
    p = plan.predicted
    parts = [f"{name} {format_time(s)}" for name, s in (("optimizer", p.optimizer_s), (sync_name(plan), p.allreduce_s))
             if s > 0]
    split = f" (pipeline {format_time(pipeline_s)} + {' + '.join(parts)})" if pipeline_s is not None and parts else ""
    return f"step {format_time(p.step_time_s)}{split}, bubble {p.bubble_fraction:.1%}"


def format_breakdown(plan: Plan) -> str:
    """Where the predicted step goes (`Plan.time_breakdown`): each term's time on the critical path (the stages'
    averaged over the pipeline ranks, so that the rows add up to the step), its share of the step, and what overlap
    hides; "" for a plan without one."""
    b = plan.time_breakdown
    if b is None:
        return ""
    rows = [(f"{sync_name(plan)} at the step's end" if plan.mirrored and name == b.SYNC else name, exposed, hidden)
            for name, exposed, hidden in b.rows(plan.layout.pp)
            if exposed > 0 or hidden > 0 or name == "pipeline bubble"]  # a bubble of 0 is worth saying
    total = sum(exposed for _, exposed, _ in rows) or 1.0
    both = _times([*(e for _, e, _ in rows), *(h for _, _, h in rows)])  # one unit for the time and hidden columns
    times, hiddens = both[:len(rows)], both[len(rows):]
    table = _table(["where the step goes", "time", "share", "hidden by overlap"],
                   [[name, times[i], f"{exposed / total:.1%}", hiddens[i] if hidden else ""]
                    for i, (name, exposed, hidden) in enumerate(rows)])
    return f"{table}\n(per pipeline rank on average: the times add up to the predicted step)"


def sync_name(plan: Plan) -> str:
    """What the plan's data-parallel collectives after the last backward are (`Prediction.allreduce_s`); under a
    bidirectional schedule (Chimera: dp 1), each rank's sum of its two replicas' gradients."""
    if plan.mirrored:
        return "replicas' gradient sum"
    zero = plan.layout.zero
    if zero.replicated:
        return "all-reduce"
    return f"{zero} all-gather" if zero.scatters_each_microbatch else f"{zero} reduce-scatter + all-gather"


def format_grid(layout: Layout) -> str:
    """A parallel layout (a plan's, a run report's) as every view prints it: "pp 4 x dp 2", "pp 2 x dp 2 x tp 2,
    ZeRO 3", "pp 1 x dp 16, ZeRO 3 HSDP 2 x 8" (replicate x shard), "pp 2 x tp 2 + SP" (sequence parallelism); the
    axes of degree 1 beyond pp and dp left out (every axis of `AXES`: "pp 1 x dp 4 x ep 2 x etp 2")."""
    axes = [a for a in AXES if a not in ("pp", "dp") and getattr(layout, a) > 1]
    return f"pp {layout.pp} x dp {layout.dp}" + "".join(
        f" x {a} {getattr(layout, a)}" + (" + SP" if a == "tp" and layout.sp else "") for a in axes) \
        + (f", {layout.zero}" if not layout.zero.replicated else "") \
        + (f" HSDP {layout.dp_replicate} x {layout.dp // layout.dp_replicate}" if layout.dp_replicate > 1 else "")


def format_chunks(plan: Plan) -> str:
    """A sequence-chunked plan's chunks in words ("each sequence in 4 chunks of 10704, 8453, 7213, 6398 tokens")."""
    lengths = plan.seq_chunks.lengths if plan.seq_chunks is not None else ()
    return f"each sequence in {len(lengths)} chunks of {', '.join(map(str, lengths))} tokens"


#: What the plan table's bubble and efficiency are, under it.
_LEGEND = ("(simulated; bubble: the ranks' idle share of the pipeline (the breakdown's: of the whole step);\n"
           " efficiency = ideal / predicted step; ideal = unsharded work / devices, so tensor parallelism's\n"
           " extra work and collectives count against it)")


def format_plan(plan: Plan) -> str:
    """The stage table, then the plan's predicted figures next to each baseline's and the ideal bound."""
    st, last = plan.stages, plan.layout.pp - 1
    split = plan.splits_backward and all(s.backward_input_s is not None and s.backward_weight_s is not None
                                         for s in st)
    backward = [(s.backward_input_s or 0.0) + (s.backward_weight_s or 0.0) if split else s.backward_s for s in st]
    cols = [[str(s.index) for s in st], [f"{s.rank} and {last - s.rank}" if plan.mirrored else str(s.rank) for s in st],
            [_stage_units(s.units, s.unit_names) for s in st],
            _times([s.forward_s for s in st]), _times(backward), [s.activation.value for s in st],
            _sizes([s.memory_bytes for s in st])]
    stages = _table(["stage", "pp ranks (down and up)" if plan.mirrored else "pp rank", "units", "forward/mb",
                     "backward/mb (I + W)" if split else "backward/mb", "activations", "rank peak memory"],
                    _columns(*cols), left=(0, 2))
    own = "pinned" if "autopp" in plan.baselines else "autopp"  # --split: autopp's choice is a baseline
    summary = _summary(plan, own)
    ways = " in each of 2 pipelines running opposite ways" if plan.mirrored else ""
    head = (f"{plan.schedule.value} on {_count(plan.num_ranks, 'rank')} ({format_grid(plan.layout)}, "
            f"{_count(plan.layout.v, 'stage')} per rank{ways}), "
            f"{format_microbatches(plan.num_microbatches, plan.microbatch_size)} per replica (global batch "
            f"{plan.global_batch}), memory limit {format_size(plan.memory_limit_bytes)} per device"
            + (f", {plan.precision} recipe" if plan.precision else "")  # a tester: bf16, bf16-pure or fp8 unsaid
            + (", fused kernels" if plan.kernels == "fused" else ""))
    if plan.seq_chunks is not None:
        head += f"\nsequence pipelining: {format_chunks(plan)} run one after another as units"
    if plan.vocab is not None:
        head += (f"\nvocabulary parallelism {plan.vocab.value}: embedding and head split along the vocabulary over "
                 f"all {plan.layout.pp} ranks (their passes in the stages' times and memory)")
    extra = f"\n{sync_name(plan)} {format_time(plan.predicted.allreduce_s)} at the step's end included" \
        if plan.layout.dp > 1 and plan.predicted.allreduce_s > 0 else ""  # none exposed: nothing to include
    unfit = [k for k, v in [(own, plan.predicted), *plan.baselines.items()] if not v.fits]
    notes = "".join(f"\nnote: {n}" for n in plan.notes)
    notes += f"\nnote: does not fit (a rank's simulated peak exceeds its device's memory): {', '.join(unfit)}" \
        if unfit else ""
    breakdown = format_breakdown(plan)
    return (f"{head}\n\n{stages}\n\n{summary}\n{_LEGEND}"
            f"{extra}{_band_line(plan)}" + (f"\n\n{breakdown}" if breakdown else "") + notes)


def _band_line(plan: Plan) -> str:
    """The step's band from the profile's spreads, and whether the plan's margin over the others lies inside it
    (without a band, which others predict the very same step)."""
    if plan.step_band_s is None:
        return ""
    low, high = plan.step_band_s
    many = len(plan.tied) > 1
    others = f"{len(plan.tied)} other configuration{'s' if many else ''} predict{'' if many else 's'}"
    if high <= low:
        same = f"; {others} the same step ({'; '.join(plan.tied)})" if plan.tied else ""
        return f"\nstep band: none (the profile has no spreads: counted analytically, or timed once){same}"
    unit = time_unit([low, high])
    line = f"\nstep band {format_in(low, unit)} to {format_in(high, unit)} (every unit at the low or high end of its " \
        "profiled spread)"
    if not plan.tied:
        return line + ": no other configuration predicts inside it"
    return line + (f"; the margin is inside it: {others} inside it ({'; '.join(plan.tied)}), the plan kept by the "
                   "tie rule in the notes, even over one that predicts faster")
