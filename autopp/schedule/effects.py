"""What each action costs its rank in time and holds in memory, written once for the simulator, the memory walks and
the bounds.

Per microbatch of a stage (`StageCost`) under its activation policy (`activation.py`), with ``o`` its per-message
overhead and ``redo`` what the policy adds to a backward (`ActivationPolicy.redo_s`: the forward again, part of it,
the part of an offload's transfer that does not hide, or 0):

======  ================================  =========================  ==================================
action  busy time (`durations`)           bytes added at its start   bytes freed at its end
======  ================================  =========================  ==================================
F       forward + o                       kept (activations, or the  -
                                          input when the policy
                                          keeps inputs only)
I       redo + backward_input + o         redone (activations when   -
                                          the policy redoes them or
                                          brings them back; one
                                          unit's, the largest, when
                                          it redoes unit by unit)
W       backward_weight                   -                          kept + redone
B       redo + backward (I + W) + o       redone                     kept + redone
======  ================================  =========================  ==================================

A microbatch is "in flight" on a stage from its F until its B or W (`inflight_peaks`). Sends and receives cost the
rank nothing: a transfer is link time between the producer's end and the consumer's start (the simulator's hops),
and each F and B/I already carries ``o``, the overhead of its messages.

TRANSIENT, the one assumption about working memory: an action also allocates temporaries that it frees before it
ends (a unit's peak during forward + backward beyond what it keeps; `StageCost.transient_bytes`, the largest over a
stage's units). The walks below track held bytes only; a rank's peak (`rank_peak`, `order_peaks`, the simulator's
`peak_memory_bytes`) is its most held bytes + the largest transient among the stages it runs (`transient_peak`), as
if that unit's action ran at the worst moment. An upper bound when the worst moment is not during that action, and
per unit only as good as the profile's peak (one unit alone, one microbatch). The split's memory checks (the DP, the
CP-SAT models) add the same largest transient per stage (`autopp.costmodel.stage.stage_transient`). A profile
without peak data has transients of 0 and the peaks are the held bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from autopp.errors import ScheduleError
from autopp.schedule.actions import COMPUTE_KINDS, Action, Kind
from autopp.schedule.activation import Activation, Figures, policy

__all__ = ["StageCost", "Footprint", "FREES", "durations", "footprint", "added_at_start", "freed_at_end",
           "live_change", "inflight_peaks", "rank_static_bytes", "transient_peak", "rank_peak", "RankWalk",
           "order_peaks", "memory_timeline"]


_NO_FIGURES = Figures()


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
    """Bytes kept per microbatch instead of activations when the stage's policy keeps inputs only (the stage input)."""
    overhead_s: float = 0.0
    """Time each F and each B or I action also keeps the rank busy: its messages to and from other ranks."""
    backward_s: float | None = None
    """Time of a full backward B when it is not I + W (None: I + W). torch's separate input and weight passes cost
    more than one backward (examples/gpt.py: I + W = 1.3 x B), so a profile gives both."""
    transient_bytes: int = 0
    """Working memory of one action: temporaries allocated and freed within it (the module docstring, TRANSIENT)."""
    forward_comm_s: float = 0.0
    """The part of forward_s that is communication inside the stage (expert parallelism's dispatch and combine
    all-to-alls): time a schedule that overlaps one microbatch's forward with another's backward (DualPipe) can
    hide under compute. Every other schedule pays it in full, as part of forward_s."""
    backward_comm_s: float = 0.0
    """The part of a full backward (backward_s, or I + W) that is communication inside the stage, as
    forward_comm_s; it belongs to the input-gradient pass I where the backward is split."""
    own: tuple[tuple[Activation, Figures], ...] = ()
    """The activation policies' own figures for this stage (`activation.Figures`: selective recomputation's bytes
    kept and time redone), each policy at most once; a policy not listed has none (0 bytes, 0 s)."""
    sync_s: float = 0.0
    """The part of each B (or I) of the stage, already in backward_s and backward_input_s, that is a collective
    every rank with such a stage joins for the same microbatch (vocabulary parallelism's output pass,
    autopp.costmodel.vocab): it runs once the last rank has reached its action (forward done), before the action
    waits for its gradient; the simulator runs it on all of them at once (`simulate`)."""
    resume_s: float = 0.0
    """Extra time of an action that starts after its rank waited for it (idle: its input had not arrived when the
    rank was free): the core wakes up and its caches are refilled, which back-to-back actions (and a profile's
    units, timed back to back) do not pay. The simulator adds it to such actions only (`simulate`); a short stage
    beside a long one waits before nearly every action (issue 29: examples/resnet.py's last block with the
    classifier ran at 1.4x its profiled F + B)."""

    recompute_s: float | None = None
    """Time of the forward a recomputing policy runs again in B (or I): the units' profiled `recompute_s` with the
    collectives a forward repeats (tensor, context and expert parallelism's), not ZeRO 3's gather (the backward's
    serves it) nor the pipelining runtime's per-action time (`redo_forward_s`); None: `forward_s` (stage costs made
    without the units' figures)."""
    output_bytes: int = 0
    """Bytes of the stage's outputs, which torch's PipelineStage keeps (`fwd_cache`, torch/distributed/pipelining/
    stage.py) from a microbatch's forward until its backward pops them: held per in-flight microbatch under every
    activation policy (`footprint`); 0 where the pipeline frees them once sent (Megatron-LM's:
    `UnitArrays.frees_outputs`). On the last stage the model's output (an LM's logits, which the schedule's loss
    reads: `autopp.costmodel.units.UnitArrays.model_output`; 0 from profiles made before 2026-12-06)."""

    scatter_s: float = 0.0
    """Per microbatch, the collective the stage's rank runs on its own stream after the microbatch's B (or W, where
    the backward splits) ends, not in its busy time: ZeRO 2's reduce-scatter of the stage's first unit's gradients,
    FSDP2's post-backward hook (autopp.costmodel.parallel.scatter_in_backward). The simulator queues it on the
    rank's reduce-scatter stream (`simulate`); the rank's compute goes on, and the step's end waits for it."""

    @property
    def microbatch_bytes(self) -> int:
        """What one microbatch holds from its F until its backward when the stage keeps its activations: them and
        the stage's outputs (`footprint` under keep; CP-SAT's synthesis and warm start count this)."""
        return self.activation_bytes + self.output_bytes

    @property
    def redo_forward_s(self) -> float:
        """The recomputed forward's time (`recompute_s`, else `forward_s`)."""
        return self.forward_s if self.recompute_s is None else self.recompute_s

    def figures(self, a: Activation) -> Figures:
        """Policy `a`'s own figures for this stage (`own`; zeros when it has none)."""
        return next((f for p, f in self.own if p is a), _NO_FIGURES)

    def __post_init__(self) -> None:
        times = (self.forward_s, self.backward_input_s, self.backward_weight_s, self.overhead_s, self.resume_s,
                 self.scatter_s,
                 0.0 if self.backward_s is None else self.backward_s, self.forward_comm_s, self.backward_comm_s,
                 self.redo_forward_s, *(f.redo_s for _, f in self.own))
        sizes = (self.static_bytes, self.activation_bytes, self.input_bytes, self.transient_bytes, self.output_bytes,
                 *(b for _, f in self.own for b in (f.kept_bytes, f.redone_bytes)))
        if min(times) < 0 or min(sizes) < 0 or not all(math.isfinite(t) for t in times):
            raise ScheduleError(f"stage costs must be finite and >= 0, got times {times} and bytes {sizes}")
        full = self.backward_input_s + self.backward_weight_s if self.backward_s is None else self.backward_s
        if self.forward_comm_s > self.forward_s or self.backward_comm_s > full:
            raise ScheduleError(f"a stage's communication ({self.forward_comm_s:g} s forward, "
                                f"{self.backward_comm_s:g} s backward) exceeds its times ({self.forward_s:g} s, "
                                f"{full:g} s)")


class Footprint(NamedTuple):
    """Bytes one microbatch of a stage holds beyond the stage's static bytes."""

    kept: int
    """Added when its F starts: the activations, or only the stage input under a policy that keeps inputs only."""
    redone: int
    """Added when its B or I starts: the recomputed activations (0 under a policy that redoes nothing)."""


FREES: frozenset[Kind] = frozenset({Kind.B, Kind.W})
"""Kinds whose end frees the microbatch's kept and redone bytes (the backward that finishes it)."""


def durations(c: StageCost, activation: Activation) -> dict[Kind, float]:
    """Busy time per compute kind; a policy that redoes the forward runs it again at the start of B or I."""
    redo, o = policy(activation).redo_s(c), c.overhead_s
    full = c.backward_input_s + c.backward_weight_s if c.backward_s is None else c.backward_s
    return {Kind.F: c.forward_s + o, Kind.I: redo + c.backward_input_s + o, Kind.W: c.backward_weight_s,
            Kind.B: redo + full + o}


def footprint(c: StageCost, activation: Activation) -> Footprint:
    """What one microbatch holds: keeping activations, them from F start until the freeing backward ends;
    recomputing, only the stage input after F, and the full activations again from the start of B (or I) until B
    (or W) ends, freed together with the kept input (`ActivationPolicy.kept` and `.redone`); under every policy the
    stage's outputs as well (`StageCost.output_bytes`), from F until the freeing backward."""
    p = policy(activation)
    return Footprint(p.kept(c) + c.output_bytes, p.redone(c))


def added_at_start(kind: Kind, f: Footprint) -> int:
    """Bytes an action of ``kind`` allocates when it starts."""
    if kind is Kind.F:
        return f.kept
    return 0 if kind is Kind.W else f.redone


def freed_at_end(kind: Kind, f: Footprint) -> int:
    """Bytes an action of ``kind`` frees when it ends."""
    return f.kept + f.redone if kind in FREES else 0


def live_change(kind: Kind) -> int:
    """+1 when ``kind`` puts a microbatch in flight on its stage (F), -1 when it finishes one (B or W), else 0."""
    return (kind is Kind.F) - (kind in FREES)


def inflight_peaks(actions: Iterable[Action]) -> dict[int, int]:
    """Per stage, the most microbatches in flight at once while ``actions`` run in list order (other kinds
    count 0)."""
    live: dict[int, int] = {}
    top: dict[int, int] = {}
    for stage, kind, _ in actions:
        live[stage] = live.get(stage, 0) + live_change(kind)
        top[stage] = max(top.get(stage, 0), live[stage])
    return top


class _ByteTable(dict[int, dict[Kind, tuple[int, int]]]):
    """Per stage and compute kind: (bytes added at the start, bytes freed at the end), looked up in the walks' loops
    and built on first use, so a walk of one rank's actions pays only for that rank's stages."""

    def __init__(self, costs: Sequence[StageCost], activations: Sequence[Activation]) -> None:
        super().__init__()
        self.costs, self.activations = costs, activations

    def __missing__(self, stage: int) -> dict[Kind, tuple[int, int]]:
        f = footprint(self.costs[stage], self.activations[stage])
        row = self[stage] = {k: (added_at_start(k, f), freed_at_end(k, f)) for k in COMPUTE_KINDS}
        return row


def rank_static_bytes(costs: Sequence[StageCost], owner: Sequence[int], rank: int, mirrored: bool = False) -> int:
    """Bytes `rank` holds all step: the parameters, gradients and optimizer state of its stages; `mirrored`
    (Chimera's two pipelines): also of the up replicas it holds, stage s on rank p - 1 - owner[s], so a rank holds
    two stages' weights, gradients and optimizer state."""
    p = max(owner, default=-1) + 1
    return sum(c.static_bytes * ((o == rank) + (mirrored and p - 1 - o == rank)) for c, o in zip(costs, owner))


def transient_peak(stages: Iterable[int], costs: Sequence[StageCost]) -> int:
    """What a rank running actions of ``stages`` adds to its most held bytes: their largest transient (TRANSIENT)."""
    return max((costs[s].transient_bytes for s in set(stages)), default=0)


def rank_peak(actions: Sequence[Action], costs: Sequence[StageCost], activations: Sequence[Activation],
              static: int) -> int:
    """Peak memory of one rank running compute ``actions`` in list order (one at a time, so its allocations and frees
    happen in that order: the simulator's peak without timing), its largest transient included (TRANSIENT).
    ``static``: the rank's parameter/gradient/optimizer bytes."""
    table = _ByteTable(costs, activations)
    held = peak = static
    for s, kind, _ in actions:
        added, freed = table[s][kind]
        held += added
        peak = max(peak, held)
        held -= freed
    return peak + transient_peak((a[0] for a in actions), costs)


_KINDS = tuple(sorted(COMPUTE_KINDS, key=lambda k: k.value))


class RankWalk:
    """One rank's compute actions, kept as arrays to take `rank_peak` under many policy choices (the memory walks of
    the search and the refinement try one policy after another on the same order): the same peak, in integers, with
    numpy's cumulative sums instead of a Python loop over the actions."""

    def __init__(self, actions: Sequence[Action]) -> None:
        self.actions = actions
        self.stages = np.fromiter((a[0] for a in actions), dtype=np.int64, count=len(actions))
        self.used = sorted(set(self.stages.tolist()))
        slot = {s: k for k, s in enumerate(self.used)}
        self.rows = np.fromiter((slot[a[0]] * len(_KINDS) + _KINDS.index(a[1]) for a in actions), dtype=np.int64,
                                count=len(actions))

    def peak(self, costs: Sequence[StageCost], activations: Sequence[Activation], static: int) -> int:
        """`rank_peak(actions, costs, activations, static)`."""
        if not self.used:
            return static
        table = _ByteTable(costs, activations)
        pairs = [table[s][k] for s in self.used for k in _KINDS]
        if not all(type(x) is int for pair in pairs for x in pair):
            return rank_peak(self.actions, costs, activations, static)  # exact integers only
        added, freed = np.array(pairs, dtype=np.int64)[self.rows].T
        held = np.cumsum(added) - np.cumsum(freed) + freed  # after each action's allocation, before its free
        return max(static, static + int(held.max())) + transient_peak(self.used, costs)


def order_peaks(order: Mapping[int, Sequence[Action | None]], costs: Sequence[StageCost], owner: Sequence[int],
                activations: Sequence[Activation], mirrored: bool = False) -> list[int]:
    """Per-rank peak memory from the order alone (`rank_peak` of every rank; idle slots and sends/receives hold
    nothing; `mirrored`: `rank_static_bytes`'s)."""
    return [rank_peak([a for a in order[r] if a is not None and a.kind in COMPUTE_KINDS], costs, activations,
                      rank_static_bytes(costs, owner, r, mirrored)) for r in sorted(order)]


def memory_timeline(events: Iterable[tuple[int, Action, float, float]], costs: Sequence[StageCost],
                    activations: Sequence[Activation], static: int) -> list[tuple[float, int]]:
    """(time, bytes held from then on) of one rank whose compute actions ran as ``events`` (rank, action, start,
    end): first point (0, ``static``); allocations at starts, frees at ends, frees first at equal times. Held bytes
    only: the rank's peak adds `transient_peak` to their highest point (TRANSIENT)."""
    table, forward = _ByteTable(costs, activations), Kind.F
    deltas: list[tuple[float, int]] = []
    for _, (s, kind, _mb), start, end in events:
        added, freed = table[s][kind]
        if added or kind is forward:
            deltas.append((start, added))
        if kind in FREES:
            deltas.append((end, -freed))
    deltas.sort()
    held, timeline = static, [(0.0, static)]
    for t, d in deltas:
        held += d
        if timeline[-1][0] == t:
            timeline[-1] = (t, held)
        else:
            timeline.append((t, held))
    return timeline
