"""Warm starts for schedule synthesis: memory floors, named, sequential and list-scheduling orders, and the best
of them by the simulator (autopp.solve.cpsat.synthesis hands the winner to CP-SAT as a complete hint)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopp.errors import InfeasibleError, ScheduleError
from autopp.schedule.actions import Action, Kind, Order
from autopp.schedule.activation import Activation
from autopp.schedule.descriptors import NAMED, build_schedule, describe, stage_to_rank, validate
from autopp.schedule.effects import StageCost, durations, rank_static_bytes, transient_peak
from autopp.schedule.simulate import SimResult, simulate

__all__ = ["Hint", "GREEDY_PRIORITIES", "SPLIT_KINDS", "kind_time", "fits", "min_memory_bytes", "split_backward",
           "sequential_order", "greedy_order", "named_orders", "best_hint"]

SPLIT_KINDS = (Kind.F, Kind.I, Kind.W)


def kind_time(c: StageCost, kind: Kind) -> float:
    """Duration of a compute action of this kind on a stage of cost `c` (with its message overhead)."""
    return durations(c, Activation.KEEP)[kind]


GREEDY_PRIORITIES = ((Kind.I, Kind.F, Kind.W), (Kind.F, Kind.I, Kind.W))
"""Tie-break orders of the list-scheduling warm starts tried next to the named schedules."""


@dataclass(frozen=True)
class Hint:
    name: str
    order: dict[int, list[Action]]
    sim: SimResult


# ---------------------------------------------------------------- helpers: memory floor, orders, hints


def min_memory_bytes(stage_costs: Sequence[StageCost], owner: Sequence[int]) -> list[int]:
    """Per rank: static bytes + one microbatch's activations and stage outputs on all its stages + its largest
    transient, the least any schedule needs.

    Running microbatches one at a time through the whole pipeline needs exactly this, so it is also enough.
    """
    need = [0] * (max(owner, default=-1) + 1)
    for c, r in zip(stage_costs, owner):
        need[r] += c.static_bytes + c.microbatch_bytes
    return [x + transient_peak((s for s, q in enumerate(owner) if q == r), stage_costs) for r, x in enumerate(need)]


def split_backward(order: Order) -> dict[int, list[Action]]:
    """Replace every full backward B by I then W (same time and memory in the simulator); drop idle slots."""
    out: dict[int, list[Action]] = {}
    for r, acts in order.items():
        out[r] = []
        for a in acts:
            if a is None:
                continue
            if a.kind is Kind.B:
                out[r] += [Action(a.stage, Kind.I, a.microbatch), Action(a.stage, Kind.W, a.microbatch)]
            elif a.kind in SPLIT_KINDS:
                out[r].append(a)
    return out


def sequential_order(owner: Sequence[int], num_microbatches: int) -> dict[int, list[Action]]:
    """One microbatch at a time: every forward, then I and W from the last stage back; fits ``min_memory_bytes``."""
    n = len(owner)
    order: dict[int, list[Action]] = {r: [] for r in range(max(owner) + 1)}
    for mb in range(num_microbatches):
        for s in range(n):
            order[owner[s]].append(Action(s, Kind.F, mb))
        for s in reversed(range(n)):
            order[owner[s]] += [Action(s, Kind.I, mb), Action(s, Kind.W, mb)]
    return order


def greedy_order(stage_costs: Sequence[StageCost], owner: Sequence[int], num_microbatches: int,
                 comm_s: Sequence[float], memory_limits: Sequence[float],
                 priority: Sequence[Kind] = (Kind.I, Kind.F, Kind.W)) -> dict[int, list[Action]] | None:
    """Non-delay list scheduling: repeatedly start the action that can start earliest on any rank.

    Per stage, each kind runs its microbatches in order; among actions that can start at the same time,
    ``priority`` decides. Memory is reserved per microbatch: its forward on the rank's first stage reserves the
    activations of all the rank's stages, and each W releases its stage's share, so an admitted microbatch can
    always finish (with a V layout the same microbatch comes back to the rank). Returns None if it stalls.
    """
    n, m, ranks = len(owner), num_microbatches, max(owner) + 1
    cap = [float(memory_limits[r]) - rank_static_bytes(stage_costs, owner, r)
           - transient_peak((s for s, q in enumerate(owner) if q == r), stage_costs) for r in range(ranks)]
    hop = [0.0 if owner[s] == owner[s + 1] else comm_s[s] for s in range(n - 1)]
    first = {r: owner.index(r) for r in range(ranks)}
    footprint = [sum(c.microbatch_bytes for c, q in zip(stage_costs, owner) if q == r) for r in range(ranks)]
    done: dict[Action, float] = {}
    nxt = {(s, k): 0 for s in range(n) for k in SPLIT_KINDS}
    free = [0.0] * ranks
    order: dict[int, list[Action]] = {r: [] for r in range(ranks)}
    rank_of = {k: i for i, k in enumerate(priority)}

    def ready(s: int, k: Kind) -> float | None:
        mb = nxt[(s, k)]
        if mb >= m:
            return None
        if k is Kind.F:
            if first[owner[s]] == s and footprint[owner[s]] > cap[owner[s]]:
                return None
            return 0.0 if s == 0 else _after(done, Action(s - 1, Kind.F, mb), hop[s - 1])
        if k is Kind.W:
            return done.get(Action(s, Kind.I, mb))
        own = done.get(Action(s, Kind.F, mb))
        down = own if s == n - 1 else _after(done, Action(s + 1, Kind.I, mb), hop[s])
        return None if own is None or down is None else max(own, down)

    for _ in range(3 * n * m):
        options = [(max(free[owner[s]], t), rank_of[k], s, k) for s in range(n) for k in SPLIT_KINDS
                   if (t := ready(s, k)) is not None]
        if not options:
            return None
        begin, _, s, k = min(options)
        a, c = Action(s, k, nxt[(s, k)]), stage_costs[s]
        done[a] = free[owner[s]] = begin + kind_time(c, k)
        if k is Kind.W or (k is Kind.F and first[owner[s]] == s):
            cap[owner[s]] += c.microbatch_bytes if k is Kind.W else -footprint[owner[s]]
        nxt[(s, k)] += 1
        order[owner[s]].append(a)
    return order


def _after(done: dict[Action, float], a: Action, delay: float) -> float | None:
    end = done.get(a)
    return None if end is None else end + delay


def named_orders(owner: Sequence[int], m: int) -> list[tuple[str, dict[int, list[Action]]]]:
    """Every named schedule whose stage layout is ``owner`` and whose size constraints hold, B split into I, W."""
    p = max(owner) + 1
    v, rest = divmod(len(owner), p)
    out: list[tuple[str, dict[int, list[Action]]]] = []
    if rest:
        return out
    for name in NAMED:
        if describe(name).mirrored:  # Chimera's up half runs on other ranks than ``owner`` says
            continue
        try:
            validate(name, p, m, v)
            if stage_to_rank(name, p, v) == list(owner):
                out.append((name.value, split_backward(build_schedule(name, p, m, v))))
        except ScheduleError:
            continue
    return out


def fits(sim: SimResult, limits: Sequence[float]) -> bool:
    """Whether every rank's simulated peak memory is within its limit."""
    return all(peak <= limit for peak, limit in zip(sim.peak_memory_bytes, limits))


def best_hint(candidates: list[tuple[str, dict[int, list[Action]]]], costs: Sequence[StageCost],
               owner: Sequence[int], comm_s: Sequence[float], limits: Sequence[float]) -> Hint:
    """The fastest candidate (simulated in seconds) that fits every rank's memory limit."""
    best: Hint | None = None
    for name, order in candidates:
        sim = simulate(order, costs, owner, comm_s)
        if fits(sim, limits) and (best is None or sim.step_time_s < best.sim.step_time_s):
            best = Hint(name, order, sim)
    if best is None:
        raise InfeasibleError("no warm start fits the memory limits (the sequential order should always fit)")
    return best
