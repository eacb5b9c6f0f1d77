"""Timed, memory-aware event simulator for per-rank pipeline schedules (torch-free)."""

from __future__ import annotations

import gc
import math
from bisect import bisect_right
from itertools import accumulate
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from autopp.errors import ScheduleError
from autopp.schedule.actions import COMPUTE_KINDS, Action, Kind, Order
from autopp.schedule.named import ScheduleName, build_schedule, stage_to_rank

__all__ = ["StageCost", "Event", "SimResult", "simulate", "simulate_named"]


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """Per-microbatch cost of one pipeline stage."""

    forward_s: float
    """Forward time of one microbatch."""
    backward_input_s: float
    """Input-gradient backward time (I); a full backward B takes I + W."""
    backward_weight_s: float
    """Weight-gradient backward time (W)."""
    static_bytes: int = 0
    """Bytes held all step: weights + gradients + optimizer state."""
    activation_bytes: int = 0
    """Bytes one microbatch keeps from its forward until its backward frees them."""
    input_bytes: int = 0
    """Bytes kept per microbatch instead of activations when the stage recomputes (the stage input)."""
    overhead_s: float = 0.0
    """Time each F and each B or I action also keeps the rank busy: its messages to and from other ranks."""
    backward_s: float | None = None
    """Time of a full backward B when it is not I + W (None: I + W). torch's separate input and weight passes cost
    more than one backward (examples/gpt.py: I + W = 1.3 x B), so a profile gives both."""

    def __post_init__(self) -> None:
        times = (self.forward_s, self.backward_input_s, self.backward_weight_s, self.overhead_s,
                 0.0 if self.backward_s is None else self.backward_s)
        sizes = (self.static_bytes, self.activation_bytes, self.input_bytes)
        if min(times) < 0 or min(sizes) < 0 or not all(math.isfinite(t) for t in times):
            raise ScheduleError(f"stage costs must be finite and >= 0, got times {times} and bytes {sizes}")


class Event(NamedTuple):
    """One executed compute action."""

    rank: int
    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """What one simulated training step did."""

    events: list[Event]
    """Every compute action with its start and end, grouped by rank in execution order."""
    step_time_s: float
    """Time from 0 until the last action ends."""
    bubble_fraction: list[float]
    """Per rank: (step time - busy time) / step time."""
    peak_memory_bytes: list[int]
    """Per rank: the highest point of ``memory_timeline``."""
    memory_timeline: list[list[tuple[float, int]]]
    """Per rank: (time, bytes held from that time on); first point at time 0, static bytes plus what starts then."""


@dataclass
class _Sim:
    """Mutable state of one run: per-stage tables (index = stage), finish times and per-rank cursors."""

    order: list[list[Action]]
    costs: Sequence[StageCost]
    owner: Sequence[int]
    recompute: Sequence[bool]
    hop_in: list[float]
    """Transfer time of an activation from stage s - 1 into stage s (0 on the same rank)."""
    hop_back: list[float]
    """Transfer time of a gradient from stage s + 1 back into stage s (0 on the same rank)."""
    delay_in: list[float]
    """Progress delay of the activation from stage s - 1 into stage s (0 on the same rank, or when messages move
    without the sender's CPU)."""
    delay_back: list[float]
    """Progress delay of the gradient from stage s + 1 back into stage s."""
    durations: list[dict[Kind, float]]
    fwd_end: list[dict[int, float]]
    grad_end: list[dict[int, float]]
    input_end: list[dict[int, float]]
    weight_end: list[dict[int, float]]
    position: list[int]
    clock: list[float]
    events: list[list[Event]]
    pending: dict[int, tuple[float, int]] = field(default_factory=dict)
    """Per rank blocked on a delivery whose sender is not simulated far enough: (when that message could move, the
    sender)."""
    forced: bool = False
    """One delivery may treat its unsimulated sender as idle (granted when no rank can move)."""
    prefix: list[list[float]] = field(default_factory=list)
    """Per rank, the running sum of its actions' durations (built when first needed)."""
    index: list[dict[Action, int]] = field(default_factory=list)
    """Per rank, each action's position in its order (built with `prefix`)."""


def _new_sim(order: list[list[Action]], costs: Sequence[StageCost], owner: Sequence[int],
             comm_s: Sequence[float], recompute: Sequence[bool], progress_s: Sequence[float]) -> _Sim:
    n = len(costs)
    hop_in = [0.0] + [0.0 if owner[s - 1] == owner[s] else comm_s[s - 1] for s in range(1, n)]
    hop_back = hop_in[1:] + [0.0]
    delay_in = [0.0] + [0.0 if owner[s - 1] == owner[s] else progress_s[s - 1] for s in range(1, n)]
    delay_back = delay_in[1:] + [0.0]
    durations = [_durations(c, r) for c, r in zip(costs, recompute)]
    ranks = len(order)

    def table() -> list[dict[int, float]]:
        return [{} for _ in range(n)]

    return _Sim(order, costs, owner, recompute, hop_in, hop_back, delay_in, delay_back, durations, table(), table(),
                table(), table(), [0] * ranks, [0.0] * ranks, [[] for _ in range(ranks)])


def _durations(c: StageCost, recompute: bool) -> dict[Kind, float]:
    """Busy time per kind; a recomputing stage re-runs its forward at the start of B or I."""
    redo, o = (c.forward_s if recompute else 0.0), c.overhead_s
    full = c.backward_input_s + c.backward_weight_s if c.backward_s is None else c.backward_s
    return {Kind.F: c.forward_s + o, Kind.I: redo + c.backward_input_s + o, Kind.W: c.backward_weight_s,
            Kind.B: redo + full + o}


def _compute_only(order: Order, num_stages: int, owner: Sequence[int]) -> list[list[Action]]:
    ranks = sorted(order)
    if ranks != list(range(len(ranks))):
        raise ScheduleError(f"order must name ranks 0..{len(ranks) - 1}, got {ranks}")
    out: list[list[Action]] = []
    for r in ranks:
        acts = [a for a in order[r] if a is not None and a.kind in COMPUTE_KINDS]
        for a in acts:
            if not 0 <= a.stage < num_stages or owner[a.stage] != r:
                raise ScheduleError(_misplaced(a, r, num_stages, owner))
        out.append(acts)
    return out


def _misplaced(a: Action, rank: int, num_stages: int, owner: Sequence[int]) -> str:
    if not 0 <= a.stage < num_stages:
        return f"{a} on rank {rank}: stage {a.stage} outside 0..{num_stages - 1}"
    return f"{a} is on rank {rank} but stage {a.stage} lives on rank {owner[a.stage]}"


def _check_inputs(stage_costs: Sequence[StageCost], owner: Sequence[int], comm_s: Sequence[float],
                  recompute: Sequence[bool], progress_s: Sequence[float]) -> None:
    n = len(stage_costs)
    if len(owner) != n:
        raise ScheduleError(f"stage_to_rank names {len(owner)} stages but there are {n} stage costs")
    for name, values in (("comm_s", comm_s), ("progress_s", progress_s)):
        if len(values) != max(n - 1, 0):
            raise ScheduleError(f"{name} needs one entry per stage boundary ({len(values)} != {n - 1})")
        if any(not c >= 0 or not math.isfinite(c) for c in values):
            raise ScheduleError(f"{name} must be finite and >= 0, got {list(values)}")
    if len(recompute) != n:
        raise ScheduleError(f"recompute needs one flag per stage ({len(recompute)} != {n})")


def _advance(sim: _Sim, rank: int) -> bool:
    """Run ``rank`` until it blocks or finishes; return whether it ran anything.

    Start = max(rank free, inputs arrived): F(s, i) waits for F(s-1, i) + hop; B/I(s, i) for F(s, i) and
    B/I(s+1, i) + hop; W(s, i) for I(s, i). This is the simulator's hot loop, so the dependency lookups are
    written out inline rather than split into helpers (about 2x faster at 64 ranks x 256 microbatches).
    """
    acts, pos, moved, clock, out = sim.order[rank], sim.position[rank], False, sim.clock[rank], sim.events[rank]
    sim.pending.pop(rank, None)
    fwd, grad, inputs, weights = sim.fwd_end, sim.grad_end, sim.input_end, sim.weight_end
    hop_in, hop_back, durations, last = sim.hop_in, sim.hop_back, sim.durations, len(sim.costs) - 1
    delay_in, delay_back, owner = sim.delay_in, sim.delay_back, sim.owner
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
                moved_at = _delivered(sim, owner[s - 1], ready, delay_in[s])
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
            grad_in = 0.0 if s == last else grad[s + 1].get(mb)
            if ready is None or grad_in is None:
                break
            grad_in += hop_back[s]
            if delay_back[s]:
                grad_in = grad_in if grad_in > clock else clock
                moved_at = _delivered(sim, owner[s + 1], grad_in, delay_back[s])
                if moved_at is None:
                    sim.pending[rank] = (grad_in, owner[s + 1])
                    break
                grad_in = moved_at
            if grad_in > ready:
                ready = grad_in
            table = grad[s]
        start = clock if clock > ready else ready
        clock = start + durations[s][kind]
        if mb in table:
            raise ScheduleError(f"{a} is scheduled twice (or both B and I/W run for it)")
        table[mb] = clock
        if kind is backward_input:
            inputs[s][mb] = clock
        out.append(_new_tuple(Event, (rank, a, start, clock)))
        pos, moved = pos + 1, True
    sim.position[rank], sim.clock[rank] = pos, clock
    return moved


_new_tuple = tuple.__new__
"""Builds Event tuples without NamedTuple's Python-level __new__ (hot loop)."""


def _start(e: Event) -> float:
    return e[2]


def _delivered(sim: _Sim, sender: int, t: float, delay: float) -> float | None:
    """When a message that could move at ``t`` (sent, and its receiver free) reaches the receiver: at ``t`` if
    ``sender`` is idle then; else when the sender's run of back-to-back actions ends, but no later than
    ``t + delay``. None while the sender's timeline around ``t`` is not simulated yet.

    This is how gloo behaves when every core of a host runs a rank: the sender's progress thread moves the bytes,
    and the OS lets it run when the sender's main thread blocks, or after a scheduling delay."""
    events, done = sim.events[sender], sim.position[sender] == len(sim.order[sender])
    if sim.clock[sender] <= t:
        if done or _use_forced(sim):
            return t
        return None
    i = bisect_right(events, t, key=_start) - 1
    if i < 0 or events[i][3] <= t:
        return t
    end, j, limit = events[i][3], i + 1, t + delay
    while end < limit and j < len(events) and events[j][2] <= end:
        end, j = events[j][3], j + 1
    if end >= limit:
        return limit
    if j == len(events) and not done and not _use_forced(sim):
        return None
    return end


def _use_forced(sim: _Sim) -> bool:
    """Take the one delivery that may treat an unsimulated sender as idle, if it is granted."""
    granted, sim.forced = sim.forced, False
    return granted


def _neighbours(sim: _Sim, rank: int) -> set[int]:
    stages = {a.stage for a in sim.order[rank]}
    near = {s + d for s in stages for d in (-1, 1) if 0 <= s + d < len(sim.owner)}
    return {sim.owner[s] for s in near} - {rank}


def _run(sim: _Sim) -> None:
    """Advance ranks until no rank can move; every action's start is max(rank free, inputs arrived).

    With progress delays a rank may wait on a delivery whose sender is not simulated far enough to say whether it
    computes at that moment. When no rank can move, one such delivery is decided with its sender taken as idle from
    its clock on (`_next_to_force`), and the run goes on."""
    near = [_neighbours(sim, r) for r in range(len(sim.order))]
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
        rank = _next_to_force(sim)
        sim.forced = True
        moved = _advance(sim, rank)
        sim.forced = False
        if not moved:
            return
        work, queued = [rank, *near[rank]], {rank, *near[rank]}


def _next_to_force(sim: _Sim) -> int:
    """The blocked delivery to decide next, when no rank can move: the earliest one whose sender cannot start an
    action before the sender's timeline runs out at that moment (so the sender is idle then, and the decision is
    exact; `_earliest_start`); else the earliest of two ranks waiting on each other at the same moment (either
    order is a tie); else, from the earliest one, the last rank along its chain of senders that wait on deliveries
    themselves (a sender's own delivery decides whether it computes)."""
    _build_positions(sim)
    memo: dict[int, float] = {}

    def safe(r: int) -> bool:
        t, sender = sim.pending[r]
        key = max(t, sim.clock[sender])
        return _earliest_start(sim, sender, memo) - key > 1e-12 * max(1.0, abs(key))

    first = min(sim.pending, key=lambda r: (sim.pending[r][0], r))
    if safe(first):
        return first
    order = sorted(sim.pending, key=lambda r: (sim.pending[r][0], r))
    for r in order[1:]:
        if safe(r):
            return r
    mutual = [r for r in order if sim.pending.get(sim.pending[r][1], (0.0, -1))[1] == r]
    if mutual:
        return mutual[0]
    r, seen = first, {first}
    while sim.pending[r][1] in sim.pending and sim.pending[r][1] not in seen:
        r = sim.pending[r][1]
        seen.add(r)
    return r


def _build_positions(sim: _Sim) -> None:
    """Fill `sim.prefix` and `sim.index` once (they depend only on the orders and durations)."""
    if not sim.index:
        sim.prefix = [[0.0, *accumulate(sim.durations[a.stage][a.kind] for a in acts)] for acts in sim.order]
        sim.index = [{a: i for i, a in enumerate(acts)} for acts in sim.order]


def _earliest_start(sim: _Sim, rank: int, memo: dict[int, float]) -> float:
    """A lower bound on when blocked ``rank`` starts its next action: when its pending delivery could move, or
    (blocked on an action X not yet run on rank q) when q can start plus q's actions up to and including X; its
    clock at least; infinity when it has finished. Follows the chain of blocked ranks iteratively."""
    chain: list[tuple[int, float]] = []
    seen: set[int] = set()
    r, bound = rank, 0.0
    while True:
        if r in memo:
            bound = memo[r]
            break
        if sim.position[r] == len(sim.order[r]):
            bound = math.inf
            break
        if r in sim.pending:
            bound = sim.pending[r][0]
            break
        seen.add(r)
        need = _producer(sim.order[r][sim.position[r]], sim)
        q = sim.owner[need.stage]
        i = sim.index[q].get(need)
        if q == r or q in seen or i is None or i < sim.position[q]:
            bound = sim.clock[r]
            break
        chain.append((r, sim.prefix[q][i + 1] - sim.prefix[q][sim.position[q]]))
        r = q
    memo[r] = bound
    for c, work in reversed(chain):
        bound = max(sim.clock[c], bound + work)
        memo[c] = bound
    return bound


def _producer(a: Action, sim: _Sim) -> Action:
    """The first unfinished action that ``a`` waits for."""
    s, mb = a.stage, a.microbatch
    if a.kind is Kind.F:
        return Action(s - 1, Kind.F, mb)
    if a.kind is Kind.W:
        return Action(s, Kind.I, mb)
    if mb not in sim.fwd_end[s]:
        return Action(s, Kind.F, mb)
    _build_positions(sim)
    where = sim.index[sim.owner[s + 1]]
    found = [(where[x], x) for x in (Action(s + 1, Kind.B, mb), Action(s + 1, Kind.I, mb)) if x in where]
    return min(found)[1] if found else Action(s + 1, Kind.B, mb)


def _deadlock_message(sim: _Sim) -> str:
    """Name what every stuck rank waits for; root causes (missing or self-blocked producers) come first."""
    where = {a: (r, i) for r, acts in enumerate(sim.order) for i, a in enumerate(acts)}
    parts: list[tuple[bool, str]] = []
    for r, acts in enumerate(sim.order):
        if sim.position[r] == len(acts):
            continue
        head = acts[sim.position[r]]
        need = _producer(head, sim)
        if need not in where:
            root, why = True, "not scheduled on any rank"
        else:
            q, i = where[need]
            root = q == r
            why = f"rank {q} has it at position {i} but is stuck at position {sim.position[q]}"
        parts.append((not root, f"rank {r} waits for {need} before {head} at position {sim.position[r]} ({why})"))
    return "deadlock: " + "; ".join(text for _, text in sorted(parts))


def _memory_plan(c: StageCost, recompute: bool) -> tuple[int, int, int]:
    """Bytes (added at F start, added at B/I start, freed when B or W ends) for one microbatch of a stage.

    Without recomputation the activations live from F start until the freeing backward ends. With it only the
    stage input is kept after F; the backward re-runs the forward, so the full activations are held from the
    start of B (or I) until B (or W) ends, and are freed together with the kept input.
    """
    if recompute:
        return c.input_bytes, c.activation_bytes, c.input_bytes + c.activation_bytes
    return c.activation_bytes, 0, c.activation_bytes


def _memory_deltas(sim: _Sim, rank: int) -> list[tuple[float, int]]:
    """(time, +/- bytes) for every allocation and free on ``rank``, sorted (frees first at equal times)."""
    plans = [_memory_plan(c, r) for c, r in zip(sim.costs, sim.recompute)]
    forward, weight, backward_input = Kind.F, Kind.W, Kind.I
    deltas: list[tuple[float, int]] = []
    for _, (s, kind, _mb), start, end in sim.events[rank]:
        at_forward, at_backward, freed = plans[s]
        if kind is forward:
            deltas.append((start, at_forward))
            continue
        if kind is not weight and at_backward:
            deltas.append((start, at_backward))
        if kind is not backward_input:
            deltas.append((end, -freed))
    deltas.sort()
    return deltas


def _memory(sim: _Sim, rank: int) -> list[tuple[float, int]]:
    held = sum(c.static_bytes for s, c in enumerate(sim.costs) if sim.owner[s] == rank)
    timeline = [(0.0, held)]
    for t, d in _memory_deltas(sim, rank):
        held += d
        if timeline[-1][0] == t:
            timeline[-1] = (t, held)
        else:
            timeline.append((t, held))
    return timeline


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
             comm_s: Sequence[float], recompute: Sequence[bool] | None = None,
             progress_s: Sequence[float] | None = None) -> SimResult:
    """Simulate one training step of ``order`` (rank -> actions; idle slots and send/recv entries are ignored).

    Each rank runs its compute actions in list order, one at a time. An action starts when its rank is free
    and its inputs have arrived: F(s, i) needs F(s-1, i) plus ``comm_s[s-1]`` if the stages sit on different
    ranks; B/I(s, i) needs F(s, i) and B/I(s+1, i) plus ``comm_s[s]``; W(s, i) needs I(s, i). Transfers do not
    occupy either rank and links have no contention. With ``progress_s`` (one per stage boundary, default 0) a
    message that could move while its sender computes moves when the sender's back-to-back actions end, at most
    ``progress_s`` later (see `_delivered`). Raises ScheduleError on a malformed order or a deadlock.
    """
    n = len(stage_costs)
    flags = list(recompute) if recompute is not None else [False] * n
    delays = list(progress_s) if progress_s is not None else [0.0] * max(n - 1, 0)
    _check_inputs(stage_costs, stage_to_rank, comm_s, flags, delays)
    acts = _compute_only(order, n, stage_to_rank)
    with _gc_paused():
        sim = _new_sim(acts, stage_costs, stage_to_rank, comm_s, flags, delays)
        _run(sim)
        if any(sim.position[r] < len(a) for r, a in enumerate(acts)):
            raise ScheduleError(_deadlock_message(sim))
        return _result(sim)


def _result(sim: _Sim) -> SimResult:
    ranks = range(len(sim.order))
    step = max((sim.clock[r] for r in ranks), default=0.0)
    bubble = [(step - _busy(sim.events[r])) / step if step > 0 else 0.0 for r in ranks]
    memory = [_memory(sim, r) for r in ranks]
    peaks = [max(h for _, h in timeline) for timeline in memory]
    events = [e for r in ranks for e in sim.events[r]]
    return SimResult(events, step, bubble, peaks, memory)


def simulate_named(name: ScheduleName, num_ranks: int, num_microbatches: int, stage_costs: Sequence[StageCost],
                   comm_s: Sequence[float], v: int = 1, recompute: Sequence[bool] | None = None,
                   progress_s: Sequence[float] | None = None) -> SimResult:
    """Build a named schedule for ``len(stage_costs)`` stages and simulate it."""
    order = build_schedule(name, num_ranks, num_microbatches, v)
    owner = stage_to_rank(name, num_ranks, v)
    if len(owner) != len(stage_costs):
        raise ScheduleError(f"{name.value} with {num_ranks} ranks x v={v} has {len(owner)} stages, "
                            f"but {len(stage_costs)} stage costs were given")
    return simulate(order, stage_costs, owner, comm_s, recompute, progress_s)
