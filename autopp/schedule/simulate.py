"""Timed, memory-aware event simulator for per-rank pipeline schedules (torch-free).

What each action costs and holds is `effects`; the run's state and what a waiting action waits for is `sim_state`;
the progress-delay delivery rule is `delivery`; a stuck order's diagnosis is `deadlock`."""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from autopp.errors import ScheduleError
from autopp.schedule.actions import COMPUTE_KINDS, Action, Kind, Order
from autopp.schedule.activation import Activation
from autopp.schedule.deadlock import deadlock_message
from autopp.schedule.delivery import delivered, next_to_force
from autopp.schedule.descriptors import (Pairing, ScheduleName, build_schedule, describe, pairing,
                                        stage_to_rank)
from autopp.schedule.effects import StageCost, memory_timeline, rank_static_bytes, transient_peak
from autopp.schedule.sim_state import Event, SimState, hidden_s, mirrored, new_state, pairs

__all__ = ["SimResult", "simulate", "simulate_named", "waited", "resumed_s"]


@dataclass(frozen=True)
class SimResult:
    """What one simulated training step did."""

    events: list[Event]
    """Every compute action with its start and end, grouped by rank in execution order."""
    step_time_s: float
    """Time from 0 until the last action ends, or a rank's reduce-scatter stream after it (`scatter_tail_s`)."""
    bubble_fraction: list[float]
    """Per rank: (step time - busy time) / step time."""
    peak_memory_bytes: list[int]
    """Per rank: the highest point of ``memory_timeline`` + the largest transient of its stages (effects, TRANSIENT)."""
    memory_timeline: list[list[tuple[float, int]]]
    """Per rank: (time, bytes held from that time on); first point at time 0, static bytes plus what starts then."""
    overlapped_s: tuple[float, ...] = ()
    """Per stage, the communication its actions hid in overlapped F + B pairs (DualPipeV; zeros otherwise): time in
    its `StageCost`s that the step did not spend (`SimState.overlapped`)."""
    scatter_tail_s: tuple[float, ...] = ()
    """Per rank, how long its reduce-scatter stream (`StageCost.scatter_s`) runs past the rank's last action, which
    the step's end on that rank waits for (empty: no stage has such a scatter); the rest of the scatters ran beside
    the rank's actions or in its idle time."""
    sync_s: tuple[float, ...] = ()
    """Per stage, the collective each of its B (or I) actions begins with (`StageCost.sync_s`: vocabulary
    parallelism's output pass), for pictures to tell it apart; empty when no stage has one."""
    mirror: int | None = None
    """The first microbatch of the up pipeline (Chimera: microbatches from it on run stage s on rank p - 1 - s's
    owner), for pictures to say which way each runs; None: one pipeline."""


def _compute_only(order: Order, num_stages: int, owner: Sequence[int], mirror: int | None) -> list[list[Action]]:
    ranks = sorted(order)
    if ranks != list(range(len(ranks))):
        raise ScheduleError(f"order must name ranks 0..{len(ranks) - 1}, got {ranks}")
    out: list[list[Action]] = []
    owner_up = mirrored(owner)
    for r in ranks:
        acts = [a for a in order[r] if a is not None and a.kind in COMPUTE_KINDS]
        for a in acts:
            up = mirror is not None and a.microbatch >= mirror
            if not 0 <= a.stage < num_stages or (owner_up if up else owner)[a.stage] != r:
                raise ScheduleError(_misplaced(a, r, num_stages, owner_up if up else owner, up))
        out.append(acts)
    return out


def _misplaced(a: Action, rank: int, num_stages: int, owner: Sequence[int], up: bool = False) -> str:
    if not 0 <= a.stage < num_stages:
        return f"{a} on rank {rank}: stage {a.stage} outside 0..{num_stages - 1}"
    replica = "'s up replica" if up else ""
    return f"{a} is on rank {rank} but stage {a.stage}{replica} lives on rank {owner[a.stage]}"


def _check_inputs(stage_costs: Sequence[StageCost], owner: Sequence[int], comm_s: Sequence[float],
                  activations: Sequence[Activation], progress_s: Sequence[float]) -> None:
    n = len(stage_costs)
    if len(owner) != n:
        raise ScheduleError(f"stage_to_rank names {len(owner)} stages but there are {n} stage costs")
    for name, values in (("comm_s", comm_s), ("progress_s", progress_s)):
        if len(values) != max(n - 1, 0):
            raise ScheduleError(f"{name} needs one entry per stage boundary ({len(values)} != {n - 1})")
        if any(not c >= 0 or not math.isfinite(c) for c in values):
            raise ScheduleError(f"{name} must be finite and >= 0, got {list(values)}")
    if len(activations) != n:
        raise ScheduleError(f"activations needs one policy per stage ({len(activations)} != {n})")


def _advance(sim: SimState, rank: int) -> bool:
    """Run ``rank`` until it blocks or finishes; return whether it ran anything.

    Start = max(rank free, inputs arrived): F(s, i) waits for F(s-1, i) + hop; B/I(s, i) for F(s, i) and
    B/I(s+1, i) + hop; W(s, i) for I(s, i). This is the simulator's hot loop, so the dependency lookups are
    written out inline rather than split into helpers (about 2x faster at 64 ranks x 256 microbatches).
    """
    acts, pos, moved, clock, out = sim.order[rank], sim.position[rank], False, sim.clock[rank], sim.events[rank]
    sim.pending.pop(rank, None)
    fwd, grad, inputs, weights = sim.fwd_end, sim.grad_end, sim.input_end, sim.weight_end
    hop_in, hop_back, durations, last = sim.hop_in, sim.hop_back, sim.durations, len(sim.costs) - 1
    delay_in, delay_back, owner, owner_up, mirror = sim.delay_in, sim.delay_back, sim.owner, sim.owner_up, sim.mirror
    sync, resume, scatter, stream = sim.sync, sim.resume, sim.scatter, sim.stream
    forward, weight, backward_input, end = Kind.F, Kind.W, Kind.I, len(acts)
    while pos < end:
        a = acts[pos]
        s, kind, mb = a
        if kind is forward:
            ready = 0.0 if s == 0 else fwd[s - 1].get(mb)
            if ready is None:
                break
            ready += hop_in[s]
            if delay_in[s]:
                ready = ready if ready > clock else clock
                moved_at = delivered(sim, owner[s - 1] if mb < mirror else owner_up[s - 1], ready, delay_in[s])
                if moved_at is None:
                    sim.pending[rank] = (ready, owner[s - 1])
                    break
                ready = moved_at
            table = fwd[s]
        elif kind is weight:
            ready = inputs[s].get(mb)
            if ready is None:
                break
            table = weights[s]
        else:
            ready = fwd[s].get(mb)
            if ready is None:
                break
            joined_at = _join(sim, rank, s, mb, clock if clock > ready else ready) if sync else 0.0
            if joined_at is None:
                break
            grad_in = 0.0 if s == last else grad[s + 1].get(mb)
            if grad_in is None:
                break
            grad_in += hop_back[s]
            if delay_back[s]:
                grad_in = grad_in if grad_in > clock else clock
                moved_at = delivered(sim, owner[s + 1] if mb < mirror else owner_up[s + 1], grad_in, delay_back[s])
                if moved_at is None:
                    sim.pending[rank] = (grad_in, owner[s + 1])
                    break
                grad_in = moved_at
            if sync and sync[s]:  # the collective [joined_at, + sync) runs before the gradient is waited for;
                grad_in = max(grad_in - sync[s], joined_at)  # the action ends at max(its end, grad_in) + the rest
            if grad_in > ready:
                ready = grad_in
            table = grad[s]
        waited = ready > clock
        start = clock if clock > ready else ready
        if sim.paired and pos in sim.paired[rank]:  # an overlapped F + B pair (`sim_state.hidden_s`)
            before = out[-1]
            saved = hidden_s(sim.costs[before[1][0]], sim.costs[s]) - (start - before[3])
            clock = start + max(0.0, durations[s][kind] - max(0.0, saved))
            _share_overlap(sim, before[1][0], s, durations[s][kind] - (clock - start))
        else:
            clock = start + durations[s][kind]
        if waited and resume:  # the rank idled until `ready`: the action runs cold (`StageCost.resume_s`)
            clock += resume[s]
        if scatter and scatter[s] and kind is not forward and kind is not backward_input:  # on the rank's stream
            stream[rank] = (clock if clock > stream[rank] else stream[rank]) + scatter[s]
        if mb in table:
            raise ScheduleError(f"{a} is scheduled twice (or both B and I/W run for it)")
        table[mb] = clock
        if kind is backward_input:
            inputs[s][mb] = clock
        out.append(_new_tuple(Event, (rank, a, start, clock)))
        pos, moved = pos + 1, True
    sim.position[rank], sim.clock[rank] = pos, clock
    return moved


def _join(sim: SimState, rank: int, stage: int, mb: int, at: float) -> float | None:
    """`rank` reaches the collective of microbatch `mb` (`StageCost.sync_s`) at `at` when its stage has one: when
    every rank has (the last to join starts it), else None (the rank waits); 0.0 when the stage has none."""
    if not sim.sync[stage]:
        return 0.0
    joined = sim.joined.setdefault(mb, {})
    joined[rank] = at
    return max(joined.values()) if len(joined) == sim.sync_ranks else None


_new_tuple = tuple.__new__
"""Builds Event tuples without NamedTuple's Python-level __new__ (hot loop)."""


def _neighbours(sim: SimState, rank: int) -> set[int]:
    runs = {(a.stage, a.microbatch >= sim.mirror) for a in sim.order[rank]}
    near = {(s + d, up) for s, up in runs for d in (-1, 1) if 0 <= s + d < len(sim.owner)}
    return {sim.owner_up[s] if up else sim.owner[s] for s, up in near} - {rank}


def _run(sim: SimState) -> None:
    """Advance ranks until no rank can move; every action's start is max(rank free, inputs arrived).

    With progress delays a rank may wait on a delivery whose sender is not simulated far enough to say whether it
    computes at that moment. When no rank can move, one such delivery is decided with its sender taken as idle from
    its clock on (`delivery.next_to_force`), and the run goes on."""
    ranks = range(len(sim.order))
    near = [set(ranks) - {r} if sim.sync else _neighbours(sim, r) for r in ranks]  # a collective joins every rank
    work = list(range(len(sim.order)))
    queued = set(work)
    while True:
        while work:
            rank = work.pop()
            queued.discard(rank)
            if _advance(sim, rank):
                for q in near[rank]:
                    if q not in queued and sim.position[q] < len(sim.order[q]):
                        work.append(q)
                        queued.add(q)
        if not sim.pending:
            return
        rank = next_to_force(sim)
        sim.forced = True
        moved = _advance(sim, rank)
        sim.forced = False
        if not moved:
            return
        work, queued = [rank, *near[rank]], {rank, *near[rank]}


def _static(sim: SimState, rank: int) -> int:
    return rank_static_bytes(sim.costs, sim.owner, rank, sim.mirror != math.inf)


def _busy(events: list[Event]) -> float:
    return math.fsum(e[3] for e in events) - math.fsum(e[2] for e in events)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: a large run allocates ~10^5 small acyclic tuples, and the
    collector's repeated passes over them cost about a third of the run time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(order: Order, stage_costs: Sequence[StageCost], stage_to_rank: Sequence[int],
             comm_s: Sequence[float], activations: Sequence[Activation] | None = None,
             progress_s: Sequence[float] | None = None, pairing: Pairing | None = None,
             mirror: int | None = None) -> SimResult:
    """Simulate one training step of ``order`` (rank -> actions; idle slots and send/recv entries are ignored).

    Each rank runs its compute actions in list order, one at a time. An action starts when its rank is free
    and its inputs have arrived: F(s, i) needs F(s-1, i) plus ``comm_s[s-1]`` if the stages sit on different
    ranks; B/I(s, i) needs F(s, i) and B/I(s+1, i) plus ``comm_s[s]``; W(s, i) needs I(s, i). Transfers do not
    occupy either rank and links have no contention. With ``progress_s`` (one per stage boundary, default 0) a
    message that could move while its sender computes moves when the sender's back-to-back actions end, at most
    ``progress_s`` later (see `delivery.delivered`). An action that starts after its rank waited for its input
    takes `StageCost.resume_s` longer (back-to-back actions do not). A stage whose B (or I) holds a collective
    (`StageCost.sync_s`, vocabulary parallelism's output pass) runs it for microbatch i on every rank with such a
    stage at once, from
    when the last of them reaches its action (its forward done), before the action waits for its gradient: the
    action ends at max(its start + sync_s, gradient arrived) + the rest. With ``pairing`` (`descriptors.pairing`:
    DualPipeV's pairs, or Megatron's combined 1F1B on the interleaved order) a full backward listed right after a
    forward that the rule pairs it with runs overlapped with it (`sim_state.pairs`): it is shortened by what the
    pair hides (`sim_state.hidden_s`) less any wait between the two, so the pair ends max(Fc + Bc, Fm + Bm) after
    the forward started. With ``mirror`` (Chimera, `Descriptor.mirror`), microbatches from ``mirror`` on run the up
    pipeline: stage s on rank p - 1 - stage_to_rank[s], with the same transfer times, and each rank holds both of its
    replicas' static bytes.
    A stage with `StageCost.scatter_s` (ZeRO 2's first-unit reduce-scatter under FSDP2,
    autopp.costmodel.parallel.scatter_in_backward) queues it on its rank's reduce-scatter stream when each of its B
    (or W) actions ends: it starts at max(that end, the stream free) and takes its time, while the rank goes on
    with its next action at once; the step ends on each rank when both its actions and its stream are done
    (`SimResult.scatter_tail_s`), and what the step does after the pipeline (the DP/ZeRO collectives, the
    optimizer: autopp.costmodel.terms) comes after that.
    Raises ScheduleError on a malformed order or a deadlock.
    """
    n = len(stage_costs)
    policies = list(activations) if activations is not None else [Activation.KEEP] * n
    delays = list(progress_s) if progress_s is not None else [0.0] * max(n - 1, 0)
    _check_inputs(stage_costs, stage_to_rank, comm_s, policies, delays)
    acts = _compute_only(order, n, stage_to_rank, mirror)
    with _gc_paused():
        sim = new_state(acts, stage_costs, stage_to_rank, comm_s, policies, delays, mirror)
        if pairing is not None and any(c.forward_comm_s or c.backward_comm_s for c in stage_costs):
            sim.paired = [pairs(a, pairing) for a in acts]
        _run(sim)
        if any(sim.position[r] < len(a) for r, a in enumerate(acts)):
            raise ScheduleError(deadlock_message(sim))
        return _result(sim)


def _share_overlap(sim: SimState, forward_stage: int, stage: int, hid: float) -> None:
    """Book `hid` seconds a pair saved (F of `forward_stage`, then B of `stage`) to the two stages, in proportion
    to the communication each brought to the pair (`SimState.overlapped`)."""
    f, b = sim.costs[forward_stage].forward_comm_s, sim.costs[stage].backward_comm_s
    if hid > 0 and f + b > 0:
        sim.overlapped[forward_stage] += hid * f / (f + b)
        sim.overlapped[stage] += hid * b / (f + b)


def _result(sim: SimState) -> SimResult:
    ranks = range(len(sim.order))
    tails = tuple(max(0.0, sim.stream[r] - sim.clock[r]) for r in ranks) if sim.scatter else ()
    step = max((sim.clock[r] + (tails[r] if tails else 0.0) for r in ranks), default=0.0)
    bubble = [max(0.0, (step - _busy(sim.events[r])) / step) if step > 0 else 0.0 for r in ranks]  # no -1e-16
    memory = [memory_timeline(sim.events[r], sim.costs, sim.activations, _static(sim, r)) for r in ranks]
    peaks = [max(h for _, h in timeline) + transient_peak((e[1][0] for e in sim.events[r]), sim.costs)
             for r, timeline in zip(ranks, memory)]
    events = [e for r in ranks for e in sim.events[r]]
    mirror = None if sim.mirror == math.inf else int(sim.mirror)
    return SimResult(events, step, bubble, peaks, memory, tuple(sim.overlapped), tails, tuple(sim.sync), mirror)


def waited(events: Sequence[Event]) -> list[bool]:
    """Per event (grouped by rank in execution order, as `SimResult.events`), whether its action started after its
    rank waited for it (later than the rank's previous action ended, or than 0): the actions `simulate` charges their
    stage's `StageCost.resume_s`."""
    ends: dict[int, float] = {}
    out = []
    for e in events:
        out.append(e.start_s > ends.get(e.rank, 0.0))
        ends[e.rank] = e.end_s
    return out


def resumed_s(result: SimResult, stage_costs: Sequence[StageCost]) -> tuple[float, ...]:
    """Per stage, the resume time (`StageCost.resume_s`) the simulated step charged it, over all its actions."""
    out = [0.0] * len(stage_costs)
    if any(c.resume_s for c in stage_costs):
        for e, cold in zip(result.events, waited(result.events)):
            out[e.action.stage] += stage_costs[e.action.stage].resume_s if cold else 0.0
    return tuple(out)


def simulate_named(name: ScheduleName, num_ranks: int, num_microbatches: int, stage_costs: Sequence[StageCost],
                   comm_s: Sequence[float], v: int = 1, activations: Sequence[Activation] | None = None,
                   progress_s: Sequence[float] | None = None) -> SimResult:
    """Build a named schedule for ``len(stage_costs)`` stages and simulate it."""
    order = build_schedule(name, num_ranks, num_microbatches, v)
    owner = stage_to_rank(name, num_ranks, v)
    if len(owner) != len(stage_costs):
        raise ScheduleError(f"{name.value} with {num_ranks} ranks x v={v} has {len(owner)} stages, "
                            f"but {len(stage_costs)} stage costs were given")
    return simulate(order, stage_costs, owner, comm_s, activations, progress_s, pairing(name, False, v),
                    describe(name).mirror(num_microbatches))
