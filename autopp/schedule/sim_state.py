"""The simulator's mutable state of one run, and what a waiting action waits for (torch-free)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

from autopp.schedule.actions import Action, Kind
from autopp.schedule.activation import Activation
from autopp.schedule.descriptors import Pairing
from autopp.schedule.effects import StageCost, durations

__all__ = ["Event", "SimState", "new_state", "at_join", "producer", "build_positions", "pairs", "hidden_s", "mirrored"]


class Event(NamedTuple):
    """One executed compute action."""

    rank: int
    action: Action
    start_s: float
    end_s: float


@dataclass
class SimState:
    """Mutable state of one run: per-stage tables (index = stage), finish times and per-rank cursors."""

    order: list[list[Action]]
    costs: Sequence[StageCost]
    owner: Sequence[int]
    activations: Sequence[Activation]
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
    """Per stage, each compute kind's busy time (`effects.durations`)."""
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
    paired: list[frozenset[int]] = field(default_factory=list)
    """Per rank, the positions of the full backwards that run overlapped with the forward before them (`pairs`;
    empty unless the schedule overlaps them)."""
    mirror: float = math.inf
    """The first microbatch of the up pipeline (Chimera: it runs stage s on `owner_up[s]`); inf: none."""
    owner_up: Sequence[int] = ()
    """Per stage, the rank of its up replica (`mirror`): p - 1 - owner."""
    sync: list[float] = field(default_factory=list)
    """Per stage, `StageCost.sync_s` (empty: none has one)."""
    sync_ranks: int = 0
    """Ranks that join each microbatch's collective (those holding a stage with `sync`)."""
    joined: dict[int, dict[int, float]] = field(default_factory=dict)
    """Per microbatch, when each rank reached its collective (`sync`)."""
    resume: list[float] = field(default_factory=list)
    """Per stage, `StageCost.resume_s`, added to an action that starts after its rank waited (empty: none has one)."""
    scatter: list[float] = field(default_factory=list)
    """Per stage, `StageCost.scatter_s`, queued on the rank's reduce-scatter stream after each B or W (empty: none
    has one)."""
    stream: list[float] = field(default_factory=list)
    """Per rank, when its reduce-scatter stream is free (`scatter`; 0 until a scatter is queued)."""
    overlapped: list[float] = field(default_factory=list)
    """Per stage, the communication seconds its actions hid in overlapped F + B pairs (`hidden_s`), each pair's
    saving shared between its forward's and its backward's stage in proportion to their communication."""

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs `stage` for `microbatch` (its up replica's from `mirror` on)."""
        return self.owner_up[stage] if microbatch >= self.mirror else self.owner[stage]


def new_state(order: list[list[Action]], costs: Sequence[StageCost], owner: Sequence[int],
              comm_s: Sequence[float], activations: Sequence[Activation], progress_s: Sequence[float],
              mirror: int | None = None) -> SimState:
    """The state before any action ran: hops and delays per stage boundary, busy times per stage. With `mirror`,
    microbatches from it on run the up pipeline (stage s on rank p - 1 - owner[s]) with the same hops and delays:
    the mirrored links are taken to be as fast as the down ones (true on one node and on nodes of equal size
    dividing p)."""
    n = len(costs)
    hop_in = [0.0] + [0.0 if owner[s - 1] == owner[s] else comm_s[s - 1] for s in range(1, n)]
    hop_back = hop_in[1:] + [0.0]
    delay_in = [0.0] + [0.0 if owner[s - 1] == owner[s] else progress_s[s - 1] for s in range(1, n)]
    delay_back = delay_in[1:] + [0.0]
    busy = [durations(c, a) for c, a in zip(costs, activations)]
    ranks = len(order)

    def table() -> list[dict[int, float]]:
        return [{} for _ in range(n)]

    sync = [c.sync_s for c in costs] if any(c.sync_s for c in costs) else []
    return SimState(order, costs, owner, activations, hop_in, hop_back, delay_in, delay_back, busy, table(), table(),
                    table(), table(), [0] * ranks, [0.0] * ranks, [[] for _ in range(ranks)],
                    mirror=math.inf if mirror is None else mirror, owner_up=mirrored(owner), sync=sync,
                    sync_ranks=len({owner[s] for s, t in enumerate(sync) if t}),
                    resume=[c.resume_s for c in costs] if any(c.resume_s for c in costs) else [],
                    scatter=[c.scatter_s for c in costs] if any(c.scatter_s for c in costs) else [],
                    stream=[0.0] * ranks, overlapped=[0.0] * len(costs))


def mirrored(owner: Sequence[int]) -> list[int]:
    """The up pipeline's ranks of Chimera's stages: p - 1 - owner[s] (p = the pipeline's ranks)."""
    p = max(owner, default=-1) + 1
    return [p - 1 - o for o in owner]


def build_positions(sim: SimState) -> None:
    """Fill `sim.prefix` and `sim.index` once (they depend only on the orders and durations)."""
    if not sim.index:
        sim.prefix = [[0.0, *accumulate(sim.durations[a.stage][a.kind] for a in acts)] for acts in sim.order]
        sim.index = [{a: i for i, a in enumerate(acts)} for acts in sim.order]


def at_join(sim: SimState, rank: int) -> bool:
    """Whether `rank` waits at a collective (`sync`) for the ranks that have not reached it yet."""
    if not sim.sync or sim.position[rank] == len(sim.order[rank]):
        return False
    a = sim.order[rank][sim.position[rank]]
    return (a.kind in (Kind.B, Kind.I) and bool(sim.sync[a.stage]) and a.microbatch in sim.fwd_end[a.stage]
            and len(sim.joined.get(a.microbatch, {})) < sim.sync_ranks)


def producer(a: Action, sim: SimState) -> Action:
    """The first unfinished action that ``a`` waits for (at a collective: the next action of the first rank that
    has not reached it)."""
    s, mb = a.stage, a.microbatch
    if a.kind is Kind.F:
        return Action(s - 1, Kind.F, mb)
    if a.kind is Kind.W:
        return Action(s, Kind.I, mb)
    if mb not in sim.fwd_end[s]:
        return Action(s, Kind.F, mb)
    if sim.sync and sim.sync[s] and len(sim.joined.get(mb, {})) < sim.sync_ranks:
        late = min(sim.owner[t] for t, x in enumerate(sim.sync) if x and sim.owner[t] not in sim.joined.get(mb, {}))
        return sim.order[late][sim.position[late]] if sim.position[late] < len(sim.order[late]) else a
    build_positions(sim)
    where = sim.index[sim.rank_of(s + 1, mb)]
    found = [(where[x], x) for x in (Action(s + 1, Kind.B, mb), Action(s + 1, Kind.I, mb)) if x in where]
    return min(found)[1] if found else Action(s + 1, Kind.B, mb)


def pairs(acts: Sequence[Action], rule: Pairing) -> frozenset[int]:
    """The positions in one rank's `acts` of each full backward B listed right after a forward F that `rule` pairs
    it with: of another stage (`Pairing.STAGES`: DualPipe's overlapped pairs, torch's OVERLAP_F_B, which DualPipeV's
    order lists as its F then its B; autopp.schedule.named.dual_pipe_v), or of another microbatch
    (`Pairing.MICROBATCHES`: Megatron-Core's combined 1F1B)."""
    def paired(f: Action, b: Action) -> bool:
        return f.stage != b.stage if rule is Pairing.STAGES else f.microbatch != b.microbatch
    return frozenset(i for i in range(1, len(acts)) if acts[i].kind is Kind.B and acts[i - 1].kind is Kind.F
                     and paired(acts[i - 1], acts[i]))


def hidden_s(forward: StageCost, backward: StageCost) -> float:
    """What an overlapped pair saves against running its forward then its backward: each one's communication runs
    under the other's compute (DeepSeek-V3, arXiv 2412.19437 s.3.2.1: two streams, the all-to-alls of one
    microbatch beside the other's computation), so the pair takes max(Fc + Bc, Fm + Bm) instead of their sum:
    it saves min(Fc + Bc, Fm + Bm) (c: compute, m: communication inside the stage)."""
    b = backward
    full = b.backward_input_s + b.backward_weight_s if b.backward_s is None else b.backward_s
    compute = forward.forward_s - forward.forward_comm_s + full - backward.backward_comm_s
    return min(compute, forward.forward_comm_s + backward.backward_comm_s)
