"""The progress-delay delivery rule: when a message whose sender computes reaches its receiver, and which blocked
delivery the simulator decides when no rank can move (torch-free)."""

from __future__ import annotations

import math
from bisect import bisect_right

from autopp.schedule.sim_state import Event, SimState, at_join, build_positions, producer

__all__ = ["delivered", "next_to_force"]


def _start(e: Event) -> float:
    return e[2]


def delivered(sim: SimState, sender: int, t: float, delay: float) -> float | None:
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


def _use_forced(sim: SimState) -> bool:
    """Take the one delivery that may treat an unsimulated sender as idle, if it is granted."""
    granted, sim.forced = sim.forced, False
    return granted


def next_to_force(sim: SimState) -> int:
    """The blocked delivery to decide next, when no rank can move: the earliest one whose sender cannot start an
    action before the sender's timeline runs out at that moment (so the sender is idle then, and the decision is
    exact; `_earliest_start`); else the earliest of two ranks waiting on each other at the same moment (either
    order is a tie); else, from the earliest one, the last rank along its chain of senders that wait on deliveries
    themselves (a sender's own delivery decides whether it computes)."""
    build_positions(sim)
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


def _earliest_start(sim: SimState, rank: int, memo: dict[int, float]) -> float:
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
        if at_join(sim, r):  # waits for other ranks to reach a collective: no later than its clock, at least
            bound = sim.clock[r]
            break
        seen.add(r)
        need = producer(sim.order[r][sim.position[r]], sim)
        q = sim.rank_of(need.stage, need.microbatch)
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
