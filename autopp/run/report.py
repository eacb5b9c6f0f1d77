"""RunReport: what a pipelined run measured and how it compared with the single-process reference (no torch here)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..cores import Oversubscribed, oversubscribed
from ..data.fields import Fields, is_number
from ..data.layout import Layout, layout_fields
from ..display import format_grid, format_microbatches
from ..errors import RunError
from ..jsonio import read_json, write_json
from ..schedule.descriptors import ScheduleName, describe
from ..sizes import format_in, format_size, time_unit

__all__ = [
    "REPORT_VERSION",
    "ParamDiff",
    "RunReport",
    "RunFailedError",
    "median_step_time",
    "relative_error",
    "format_report",
    "StageTimes",
    "load_report",
    "RankMeasure",
    "host_oversubscribed",
    "step_time_unit",
    "mirrored",
    "first_up_microbatch",
]

REPORT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class ParamDiff:
    """Difference between one parameter's pipelined and reference gradient, at the step where it is largest."""

    name: str
    stage: int
    max_abs: float
    """max |pipelined - reference| over the parameter's elements."""
    max_rel: float
    """max_abs / max(max |reference|, grad_atol / grad_rtol): at most grad_rtol when max_abs <= max(grad_rtol x
    max |reference|, grad_atol) (0 when both sides are equal, inf when they differ and the divisor is 0)."""
    step: int = 1
    """The step (from 1) of these figures: every step is compared from shared parameters (autopp.run.steps)."""


@dataclass(frozen=True, kw_only=True)
class StageTimes:
    """Measured per-microbatch action times of one stage (median over the timed steps) next to the plan's."""

    stage: int
    rank: int
    """Pipeline rank that runs the stage."""
    forward_s: float | None
    backward_s: float | None
    """A full backward: B, or I + W for split-backward schedules."""
    input_s: float | None
    """I (input-gradient backward), when the schedule splits the backward."""
    weight_s: float | None
    """W (weight-gradient backward), when the schedule splits the backward."""
    predicted_forward_s: float
    predicted_backward_s: float
    forward_error: float | None
    """(measured - predicted) / predicted; null when the prediction is not positive."""
    backward_error: float | None
    activation: str | None = None
    """The stage's activation policy in the plan (`StagePlan.activation`'s name: "keep", "recompute", ...), which
    its F and B ran under; None in reports written before it was recorded."""


@dataclass(frozen=True, kw_only=True)
class RankMeasure:
    """What one global rank measured."""

    rank: int
    replica: int
    pp_rank: int
    stages: tuple[int, ...]
    step_times_s: tuple[float, ...]
    wait_s: float
    tp_rank: int = 0
    """Tensor-parallel rank within its stage's group of tp processes (global rank = (pp_rank * dp + replica) * tp +
    tp_rank)."""
    """Median over the timed steps of the time spent waiting for sends/receives."""
    schedule_s: float | None = None
    """Median over the timed steps of the time inside the schedule's step (all F/I/W/B, sends, receives, loss)."""
    allreduce_s: float | None = None
    """Median time between the schedule's step and the optimizer: the data-parallel gradient all-reduce (0 when
    dp = 1). With ZeRO 1/3 only the tied copies' sum runs there (~0): FSDP2's reduce-scatter (and ZeRO 3's
    all-gathers) run inside the schedule's step, in `schedule_s`; the text report labels it "after step"."""
    optimizer_s: float | None = None
    """Median time of the optimizer step and zero_grad (not part of a simulated pipeline step)."""
    peak_memory_bytes: int
    predicted_peak_memory_bytes: int | None
    memory_error: float | None
    """(measured - predicted) / predicted."""
    actions: tuple[tuple[str, float, float], ...]
    """The median step's compute actions: (torch text e.g. `1I0`, start, end) in seconds from the step start."""
    device: int | None = None
    """The device (launcher process slot; LOCAL_RANK's CUDA device) it ran on: the plan's device_order[rank]."""


@dataclass(frozen=True, kw_only=True)
class RunReport:
    """Measured vs predicted figures of one `run_plan` call, and its validation verdict."""

    plan_path: str | None
    model_path: str
    fingerprint: str
    schedule: str
    layout: Layout
    """The plan's parallel layout (autopp.data.layout); in JSON as the plan's layout fields (`LAYOUT_FIELDS`)."""
    num_microbatches: int
    microbatch_size: int
    steps: int
    lr: float
    backend: str
    """"gloo" (CPU) or "nccl" (one CUDA device per rank)."""
    backend_reason: str = ""
    """How the backend was chosen (autopp.run.resolve), e.g. "the plan is for h100-sxm (one GPU per rank)"."""
    optimizer: str = "sgd"
    """The optimizer the ranks trained with (the plan's unless overridden)."""
    validated: bool = True
    """False: measured only (`--no-validate`): no single-process reference ran, `passed` is false and says nothing."""
    losses: tuple[float, ...] = ()
    """Pipelined loss per step: the mean of the microbatch losses."""
    reference_losses: tuple[float, ...] = ()
    """Single-process loss per step on the whole global batch, from the pipeline's parameters before that step."""
    failed_steps: tuple[int, ...] = ()
    """Steps (from 1) whose loss or gradients are out of tolerance."""
    loss_max_abs_diff: float | None = None
    loss_max_rel_diff: float | None = None
    grad_diffs: tuple[ParamDiff, ...] = ()
    """One entry per parameter of the model, in the model's named_parameters() order."""
    grad_max_abs_diff: float | None = None
    grad_max_rel_diff: float | None = None
    worst_param: str | None = None
    """The parameter with the largest relative gradient difference."""
    grad_rtol: float
    grad_atol: float = 0.0
    """The largest stage's absolute floor: gradient differences up to eps(dtype) x the largest reference gradient
    element of a parameter's stage pass whatever the parameter's own scale (rounding noise; see validate.py)."""
    loss_rtol: float
    passed: bool = False
    step_times_s: tuple[float, ...] = ()
    """Wall time of each step (barrier to barrier), the slowest rank's."""
    measured_step_time_s: float | None = None
    """Median of steps after the first (of all steps when only one ran)."""
    predicted_step_time_s: float
    step_time_ratio: float | None = None
    """measured / predicted."""
    relative_error: float | None = None
    """(measured - predicted) / predicted."""
    ranks: tuple[RankMeasure, ...] = ()
    """One per global rank (numbered as `Layout.rank` numbers them)."""
    stage_times: tuple[StageTimes, ...] = ()
    memory_method: str | None = None
    """"cuda.max_memory_allocated", or "estimate" on CPU (parameters + gradients + optimizer state + peak saved)."""
    timeline_step: int | None = None
    """Index of the step whose actions `ranks[*].actions` holds (the median step)."""
    launcher: str = "local"
    """"local" (one process per rank started here) or "torchrun"."""
    ranks_per_host: int | None = None
    """Ranks started on this host (every rank when local; this node's share with torchrun); None with NCCL."""
    host_cores: int | None = None
    """Cores those ranks could run on (autopp.cores.usable_cores: the affinity mask); None with NCCL. More ranks
    than cores: compute is serialised, which the prediction does not model (`oversubscribed`)."""
    notes: tuple[str, ...] = ()
    complete: bool = False
    """True when every rank finished every step."""
    error: str | None = None
    """Why the run or its validation failed."""
    version: int = field(default=REPORT_VERSION)

    @property
    def num_ranks(self) -> int:
        return self.layout.world

    @property
    def oversubscribed(self) -> Oversubscribed | None:
        """Whether this host's ranks outnumbered its cores (then the measured step exceeds the prediction)."""
        return host_oversubscribed({"ranks_per_host": self.ranks_per_host, "host_cores": self.host_cores})

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["layout"]
        data.update(layout_fields(self.layout))
        return {"version": data.pop("version"), **{k: _finite(v) for k, v in data.items()}}

    def save(self, path: str | Path) -> Path:
        """Write the report JSON atomically."""
        return write_json(path, self.to_json())


_AGAIN = "run the plan again with `autopp run PLAN`"
#: Integer fields of a report's per-rank entries that its timeline reads, and their least values.
_RANK_INTS = {"rank": 0, "replica": 0, "pp_rank": 0, "tp_rank": 0, "peak_memory_bytes": 0}


def load_report(path: str | Path) -> dict[str, Any]:
    """A saved report's JSON object (for measured_timeline and draw_report), the fields they read checked."""
    f = Fields(str(path), RunError, _AGAIN)
    data = f.obj(read_json(path, "run report JSON", RunError, _AGAIN))
    _check_report(data, f)
    return data


def _check_report(data: dict[str, Any], f: Fields) -> None:
    """The step times and the per-rank entries (step times, actions, memory) that the timeline and its headlines
    read: a RunError naming the file, the entry and the field instead of a KeyError while drawing."""
    f.number(data.get("predicted_step_time_s", 0.0), "predicted_step_time_s")
    if data.get("measured_step_time_s") is not None:
        f.number(data["measured_step_time_s"], "measured_step_time_s")
    f.numbers(data.get("step_times_s", []), "step_times_s")
    for name in ("timeline_step", "ranks_per_host", "host_cores"):
        if data.get(name) is not None:
            f.integer(data[name], name, 0 if name == "timeline_step" else 1)
    for i, r in enumerate(f.entries(data.get("ranks", []), "ranks")):
        at = f.at(f"ranks[{i}]")
        at.keys(r, None, [n for n in _RANK_INTS if n != "tp_rank"] + ["step_times_s", "actions"])
        for name, least in _RANK_INTS.items():
            at.integer(r.get(name, 0), name, least)
        at.numbers(r["step_times_s"], "step_times_s")
        if not isinstance(r["actions"], list) or not all(
                isinstance(a, list) and len(a) == 3 and isinstance(a[0], str) and all(map(is_number, a[1:]))
                for a in r["actions"]):
            at.bad("actions", "a list of [action, start, end] like [\"0F0\", 0.0, 0.01]", r["actions"])


def host_oversubscribed(data: dict[str, Any]) -> Oversubscribed | None:
    """A report's (its JSON's) ranks on one host against the host's cores: None when they fit or were not recorded
    (NCCL runs, reports that predate the fields)."""
    ranks, cores = data.get("ranks_per_host"), data.get("host_cores")
    return oversubscribed(ranks, cores) if isinstance(ranks, int) and isinstance(cores, int) and cores > 0 else None


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings ("inf"), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


class RunFailedError(RunError):
    """A RunError that carries the (partial) report, so the caller can still save it, and the directory where the
    ranks' logs were kept (None when the ranks finished)."""

    def __init__(self, message: str, report: RunReport, logs: Path | None = None) -> None:
        super().__init__(message)
        self.report = report
        self.logs = logs


def median_step_time(step_times: list[float] | tuple[float, ...]) -> float | None:
    """Median of the steps after the first (warm-up); of all steps when there is only one; None for none."""
    if not step_times:
        return None
    steady = step_times[1:] if len(step_times) > 1 else step_times
    return float(statistics.median(steady))


def relative_error(measured: float | None, predicted: float) -> tuple[float | None, float | None]:
    """(measured / predicted, (measured - predicted) / predicted); Nones when either is missing or predicted <= 0."""
    if measured is None or predicted <= 0:
        return None, None
    return measured / predicted, (measured - predicted) / predicted


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def step_time_unit(measured: float | None, predicted: float, steps: Sequence[float]) -> tuple[str, float]:
    """The one unit (autopp.sizes.time_unit) of a report's step times, measured, predicted and per step: its text
    and `autopp show`'s titles write them all in it."""
    return time_unit([measured or 0.0, predicted, *steps])


def _in(value: float | None, unit: tuple[str, float]) -> str:
    """A duration in its column's `unit` (autopp.sizes.time_unit), as the plan's tables write them; "-" for none."""
    return "-" if value is None else format_in(value, unit)


def mirrored(schedule: str) -> bool:
    """Whether the run's schedule runs two pipelines whose replicas' gradients each rank sums inside the schedule's
    step (Chimera: autopp.run.bidirectional), so the per-rank time after the step holds no gradient sum (a tester
    compared it with the plan's all-reduce)."""
    return schedule in {m.value for m in ScheduleName} and describe(ScheduleName(schedule)).mirrored


def first_up_microbatch(schedule: str, num_microbatches: int) -> int | None:
    """The first microbatch of a `mirrored` schedule's up pipeline (`Descriptor.mirror`); None for one pipeline."""
    return describe(ScheduleName(schedule)).mirror(num_microbatches) if mirrored(schedule) else None


def _measure_lines(r: RunReport) -> list[str]:
    """Per stage measured vs predicted F and B under its activation policy; per rank its step's parts and peak
    memory vs predicted. Each kind of figure in one unit (ms, or s from 10 s), as the plan writes them."""
    lines = []
    stage_unit = time_unit([t or 0.0 for st in r.stage_times for t in (st.forward_s, st.backward_s,
                                                                       st.predicted_forward_s,
                                                                       st.predicted_backward_s)])
    for st in r.stage_times:
        split = f" (I {_in(st.input_s, stage_unit)} + W {_in(st.weight_s, stage_unit)})" \
            if st.input_s is not None else ""
        policy = f"   activations {st.activation}" if st.activation else ""
        lines.append(f"  stage {st.stage:<3d}   F {_in(st.forward_s, stage_unit)} ({_err(st.forward_error)})   "
                     f"B {_in(st.backward_s, stage_unit)} ({_err(st.backward_error)}){split}   vs predicted "
                     f"{_in(st.predicted_forward_s, stage_unit)} / {_in(st.predicted_backward_s, stage_unit)}"
                     f"{policy}")
    rank_unit = time_unit([t or 0.0 for m in r.ranks for t in (m.schedule_s, m.wait_s, m.allreduce_s,
                                                               m.optimizer_s)])
    for m in r.ranks:
        pred = "-" if m.predicted_peak_memory_bytes is None else format_size(m.predicted_peak_memory_bytes)
        on = "" if m.device in (None, m.rank) else f" on device {m.device}"
        on += f" (tp rank {m.tp_rank})" if r.layout.tp > 1 else ""
        sync = "after step (the replicas' gradient sum is in step)" if mirrored(r.schedule) else \
            "all-reduce" if r.layout.zero.replicated else "after step (ZeRO reduce-scatter is in step)"
        lines.append(f"  rank {m.rank:<4d}{on}   stages {list(m.stages)}   in step {_in(m.schedule_s, rank_unit)} "
                     f"(waits {_in(m.wait_s, rank_unit)})   {sync} {_in(m.allreduce_s, rank_unit)}   optimizer "
                     f"{_in(m.optimizer_s, rank_unit)}")
        lines.append(f"  {'':<9}   peak memory "
                     f"{format_size(m.peak_memory_bytes)} vs predicted {pred} ({_err(m.memory_error)}, "
                     f"{r.memory_method})")
    return lines + [f"  note        {n}" for n in r.notes]


#: A series longer than this is shown as its first and last values around an ellipsis.
_SERIES = 10


def _series(values: tuple[float, ...], spec: str | tuple[str, float]) -> str:
    """Values side by side, each `format(v, spec)` or, given a time unit, in it without repeating the unit's name
    (the caller writes it once); a long series (a 300-step run) as its first 6 and last 3, with how many are left
    out."""
    def one(v: float) -> str:
        return format(v, spec) if isinstance(spec, str) else format_in(v, spec).removesuffix(f" {spec[0]}")

    if not values:
        return "-"
    if len(values) <= _SERIES:
        return " ".join(one(v) for v in values)
    head, tail = " ".join(one(v) for v in values[:6]), " ".join(one(v) for v in values[-3:])
    return f"{head} ... ({len(values) - 9} more) ... {tail}"


def format_report(report: RunReport) -> str:
    """A short human-readable table: timing, loss and gradient differences, verdict."""
    r = report
    step_unit = step_time_unit(r.measured_step_time_s, r.predicted_step_time_s, r.step_times_s)
    lines = [
        f"run of {r.model_path} ({r.schedule}, {r.num_ranks} ranks = {format_grid(r.layout)}, "
        f"{format_microbatches(r.num_microbatches, r.microbatch_size)}, {r.steps} steps, {r.optimizer} lr {r.lr:g}, "
        f"{r.backend})",
        f"  step time   measured {_in(r.measured_step_time_s, step_unit)}   predicted "
        f"{format_in(r.predicted_step_time_s, step_unit)}"
        f"   ratio {_fmt(r.step_time_ratio, '.2f')}" + (f"   ({r.oversubscribed})" if r.oversubscribed else ""),
        f"  per step    {_series(r.step_times_s, step_unit)} {step_unit[0]}",
        f"  loss        pipelined {_series(r.losses, '.6f')}",
    ]
    if r.validated:
        lines += [
            f"              reference {_series(r.reference_losses, '.6f')} (each step from the pipeline's parameters)",
            f"              max diff abs {_fmt(r.loss_max_abs_diff, '.2e')} rel {_fmt(r.loss_max_rel_diff, '.2e')}"
            f" (tolerance rel {r.loss_rtol:.0e})",
            f"  gradients   max diff abs {_fmt(r.grad_max_abs_diff, '.2e')} rel {_fmt(r.grad_max_rel_diff, '.2e')}"
            f" (worst {r.worst_param or '-'}; tolerance rel {r.grad_rtol:.0e} or abs {r.grad_atol:.1e};"
            f" {len(r.grad_diffs)} parameters, every step)"]
    lines += _measure_lines(r)
    verdict = "PASSED" if r.passed else ("FAILED: " + (r.error or "validation failed"))
    if not r.validated and r.error is None:
        verdict = "NOT VALIDATED: measured only (--no-validate): no single-process reference ran"
    lines.append(f"  verdict     {verdict}")
    return "\n".join(lines)
