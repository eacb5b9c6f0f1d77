"""Turn the ranks' raw measurements into report entries: per-stage action times and per-rank figures (no torch)."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from ..data.plan import Plan
from ..predict import simulate_plan
from ..schedule import Kind, parse_action, policy, waited
from .report import RankMeasure, StageTimes, relative_error

__all__ = ["timed_steps", "median_step_index", "stage_times", "rank_measures"]


def timed_steps(n: int) -> list[int]:
    """Steps whose timings count: all after the first (warm-up), or the only one."""
    return list(range(1, n)) if n > 1 else list(range(n))


def median_step_index(step_times: Sequence[float]) -> int | None:
    """The timed step whose time is the (lower) median: its actions are the report's timeline."""
    steps = timed_steps(len(step_times))
    if not steps:
        return None
    ordered = sorted(steps, key=lambda i: step_times[i])
    return ordered[(len(ordered) - 1) // 2]


def _durations(results: Sequence[dict[str, Any]], replica: int = 0) -> dict[tuple[int, Kind], list[float]]:
    """Per (stage, kind), every measured duration of one replica's ranks over the timed steps."""
    out: dict[tuple[int, Kind], list[float]] = {}
    for r in results:
        if r["replica"] != replica:
            continue
        for step in timed_steps(len(r["actions"])):
            for text, start, end in r["actions"][step]:
                a = parse_action(text)
                out.setdefault((a.stage, a.kind), []).append(end - start)
    return out


def _median(values: list[float] | None) -> float | None:
    return float(statistics.median(values)) if values else None


def _waited(plan: Plan) -> dict[tuple[int, Kind], float]:
    """Per (stage, kind), the median over the plan's simulated actions of whether each starts after its rank waited
    (1) or right after its rank's previous action (0): such an action takes the stage's `resume_s` more
    (`StageCost.resume_s`). Empty when no stage has a resume cost."""
    if not any(s.resume_s for s in plan.stages):
        return {}
    out: dict[tuple[int, Kind], list[float]] = {}
    events = simulate_plan(plan).events
    for e, cold in zip(events, waited(events)):
        out.setdefault((e.action.stage, e.action.kind), []).append(float(cold))
    return {k: statistics.median(v) for k, v in out.items()}


def stage_times(plan: Plan, results: Sequence[dict[str, Any]]) -> tuple[StageTimes, ...]:
    """Median F, B (or I + W) per stage, with the relative error against the plan's forward_s and backward_s (a
    sequence-chunked plan's actions are chunks: against 1/k of them), each plus the stage's `resume_s` where the
    median of its simulated actions starts after a wait (`_waited`); the backward's prediction includes what the
    stage's activation policy redoes in it (a recomputed forward: `ActivationPolicy.redo_s`), as the simulator's
    does (a tester: a recomputing stage's B measured +41 % against its prediction without it)."""
    d, waited = _durations(results), _waited(plan)
    out = []
    unit = 1 / len(plan.seq_chunks.lengths) if plan.seq_chunks else 1.0  # Seq1F1B's actions: chunks, 1/k on average
    for s in plan.stages:
        fwd, full = _median(d.get((s.index, Kind.F))), _median(d.get((s.index, Kind.B)))
        i_s, w_s = _median(d.get((s.index, Kind.I))), _median(d.get((s.index, Kind.W)))
        back = full if full is not None else (i_s + w_s if i_s is not None and w_s is not None else None)
        predicted = s.backward_s
        if full is None and back is not None and s.backward_input_s is not None and s.backward_weight_s is not None:
            predicted = s.backward_input_s + s.backward_weight_s  # split passes run: compare with their prediction
        resumed = waited.get((s.index, Kind.B), waited.get((s.index, Kind.I), 0.0)) * s.resume_s  # per action
        forward = s.forward_s * unit + waited.get((s.index, Kind.F), 0.0) * s.resume_s
        redo = policy(s.activation).redo_s(s.cost())  # a recomputing stage's B (or I) runs its forward again first
        predicted = (predicted + redo) * unit + resumed
        out.append(StageTimes(stage=s.index, rank=s.rank, forward_s=fwd, backward_s=back, input_s=i_s, weight_s=w_s,
                              predicted_forward_s=forward, predicted_backward_s=predicted,
                              forward_error=relative_error(fwd, forward)[1],
                              backward_error=relative_error(back, predicted)[1], activation=s.activation.value))
    return tuple(out)


def rank_measures(plan: Plan, results: Sequence[dict[str, Any]], step: int | None, one_host: bool = False
                  ) -> tuple[RankMeasure, ...]:
    """One entry per global rank, with the predicted peak memory of its pipeline rank and the error. Each rank's
    actions are timed from its own start of the step, after a barrier that releases the ranks up to a few ms apart
    when they outnumber the cores; on `one_host` they share the clock (`time.perf_counter`, the system's monotonic
    clock), so each rank's actions are shifted by its start's lag behind the earliest rank's (`origin_s`)."""
    out = []
    predicted = plan.predicted.peak_memory_bytes
    origins = {r["rank"]: r["phases"][step].get("origin_s") for r in results} if step is not None and one_host \
        and all(len(r.get("phases", [])) > step for r in results) else {}
    first = min(origins.values()) if origins and None not in origins.values() else None
    for r in sorted(results, key=lambda r: r["rank"]):
        pred = int(predicted[r["pp_rank"]]) if r["pp_rank"] < len(predicted) else None
        waits = [r["wait_s"][i] for i in timed_steps(len(r["wait_s"]))]
        lag = origins[r["rank"]] - first if first is not None else 0.0
        actions = tuple((str(t), float(a) + lag, float(b) + lag) for t, a, b in r["actions"][step]) \
            if step is not None else ()
        phases = [r["phases"][i] for i in timed_steps(len(r.get("phases", [])))]
        out.append(RankMeasure(rank=r["rank"], replica=r["replica"], pp_rank=r["pp_rank"],
                               tp_rank=int(r.get("tp_rank", 0)), stages=tuple(r["stages"]),
                               step_times_s=tuple(r["step_times_s"]), wait_s=_median(waits) or 0.0,
                               schedule_s=_median([ph["schedule_s"] for ph in phases]),
                               allreduce_s=_median([ph["allreduce_s"] for ph in phases]),
                               optimizer_s=_median([ph["optimizer_s"] for ph in phases]),
                               peak_memory_bytes=int(r["peak_memory_bytes"]), predicted_peak_memory_bytes=pred,
                               memory_error=relative_error(r["peak_memory_bytes"], pred or 0)[1],
                               actions=actions, device=r.get("device")))
    return tuple(out)
