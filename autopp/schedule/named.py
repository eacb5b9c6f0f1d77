"""Named pipeline schedules as per-rank compute-action lists, in the order torch.distributed.pipelining runs them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from enum import Enum

from autopp.errors import ScheduleError
from autopp.schedule.actions import Action, Kind

__all__ = ["ScheduleName", "Layout", "SPLIT_BACKWARD", "layout_of", "stages_per_rank", "stage_to_rank", "validate",
           "build_schedule"]


class ScheduleName(Enum):
    """Schedules torch.distributed.pipelining ships; values are torch's names."""

    GPIPE = "GPipe"
    ONE_F_ONE_B = "1F1B"
    INTERLEAVED_1F1B = "Interleaved1F1B"
    LOOPED_BFS = "LoopedBFS"
    INTERLEAVED_ZERO_BUBBLE = "InterleavedZeroBubble"
    ZBV_ZERO_BUBBLE = "ZBVZeroBubble"
    DUAL_PIPE_V = "DualPipeV"


class Layout(Enum):
    """How stages map to ranks."""

    LOOP = "loop"
    """Stage s on rank s % p (Megatron interleaving)."""
    V = "v"
    """Zig-zag: chunk c runs ranks 0..p-1 when c is even and p-1..0 when odd (ZB-V, DualPipeV)."""


#: Schedules of one stage per rank (torch's PipelineScheduleSingle); the others take a list of stages.
SINGLE_STAGE = frozenset({ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B})
_V_SHAPED = frozenset({ScheduleName.ZBV_ZERO_BUBBLE, ScheduleName.DUAL_PIPE_V})
_ROUNDED = frozenset({ScheduleName.INTERLEAVED_1F1B, ScheduleName.INTERLEAVED_ZERO_BUBBLE})
#: Schedules that split each backward into an input pass (I) and a weight pass (W); the others run full backwards.
SPLIT_BACKWARD = frozenset({ScheduleName.INTERLEAVED_ZERO_BUBBLE, ScheduleName.ZBV_ZERO_BUBBLE,
                            ScheduleName.DUAL_PIPE_V})


def layout_of(name: ScheduleName) -> Layout:
    """The stage-to-rank layout a schedule uses."""
    return Layout.V if name in _V_SHAPED else Layout.LOOP


def stages_per_rank(name: ScheduleName, requested_v: int = 1) -> int:
    """Stages each rank holds: 1 for GPipe/1F1B, 2 for V schedules (``requested_v`` 1 or 2), else ``requested_v``."""
    if requested_v < 1:
        raise ScheduleError(f"{name.value} needs stages per rank >= 1 ({requested_v} < 1)")
    if name in SINGLE_STAGE:
        if requested_v != 1:
            raise ScheduleError(f"{name.value} runs exactly 1 stage per rank ({requested_v} != 1)")
        return 1
    if name in _V_SHAPED:
        if requested_v not in (1, 2):
            raise ScheduleError(f"{name.value} runs exactly 2 stages per rank ({requested_v} != 2)")
        return 2
    return requested_v


def stage_to_rank(name: ScheduleName, num_ranks: int, v: int = 1) -> list[int]:
    """Rank of every stage (index = stage): loop layout s % p, or the V zig-zag."""
    v = stages_per_rank(name, v)
    if layout_of(name) is Layout.LOOP:
        return [s % num_ranks for s in range(num_ranks * v)]
    return [s % num_ranks if (s // num_ranks) % 2 == 0 else num_ranks - 1 - s % num_ranks for s in range(num_ranks * v)]


def _rounds(num_ranks: int, num_microbatches: int) -> int:
    return max(1, num_microbatches // num_ranks)


def validate(name: ScheduleName, num_ranks: int, num_microbatches: int, v: int = 1) -> int:
    """Check a schedule's size constraints; return its stages per rank or raise ScheduleError with the numbers."""
    v = stages_per_rank(name, v)
    if num_ranks < 1:
        raise ScheduleError(f"{name.value} needs ranks >= 1 ({num_ranks} < 1)")
    if num_microbatches < 1:
        raise ScheduleError(f"{name.value} needs microbatches >= 1 ({num_microbatches} < 1)")
    if name is ScheduleName.ONE_F_ONE_B and num_microbatches < num_ranks:
        raise ScheduleError(f"1F1B needs microbatches >= stages ({num_microbatches} < {num_ranks})")
    if name is ScheduleName.DUAL_PIPE_V and num_microbatches < 2 * num_ranks:
        raise ScheduleError(f"DualPipeV needs microbatches >= stages ({num_microbatches} < {2 * num_ranks})")
    rounds = _rounds(num_ranks, num_microbatches)
    if name in _ROUNDED and num_microbatches % rounds != 0:
        raise ScheduleError(
            f"{name.value} needs microbatches to be a multiple of rounds = max(1, microbatches // ranks)"
            f" ({num_microbatches} % {rounds} = {num_microbatches % rounds})"
        )
    return v


def build_schedule(name: ScheduleName, num_ranks: int, num_microbatches: int, v: int = 1) -> dict[int, list[Action]]:
    """Per-rank compute actions (F, B or I/W) of a named schedule, no idle slots and no communication."""
    v = validate(name, num_ranks, num_microbatches, v)
    builder = _BUILDERS[name]
    return {r: builder(r, num_ranks, num_microbatches, v) for r in range(num_ranks)}


def _gpipe(rank: int, p: int, m: int, v: int) -> list[Action]:
    """GPipe (Huang et al. 2019): all forwards, then all backwards, both in microbatch order."""
    return [Action(rank, Kind.F, i) for i in range(m)] + [Action(rank, Kind.B, i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int, v: int) -> list[Action]:
    """1F1B / PipeDream-flush (Narayanan et al. 2021): p - rank warm-up forwards, then B,F pairs, then the rest of B.

    torch's single-stage runtime does one more warm-up forward than the textbook p - rank - 1 and then runs
    "1B1F"; the resulting order is the same as textbook warm-up followed by F,B pairs.
    """
    warmup = min(m, p - rank)
    actions = [Action(rank, Kind.F, i) for i in range(warmup)]
    for b in range(m):
        actions.append(Action(rank, Kind.B, b))
        if warmup + b < m:
            actions.append(Action(rank, Kind.F, warmup + b))
    return actions


def _looped_bfs(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Breadth-first pipelining (Lamy-Poirier 2022): each local stage forwards all microbatches, then
    backwards run stage by stage from the deepest, microbatches in reverse order."""
    stages = [rank + c * p for c in range(v)]
    forwards = [Action(s, Kind.F, i) for s in stages for i in range(m)]
    return forwards + [Action(s, Kind.B, i) for s in reversed(stages) for i in reversed(range(m))]


def _chunk_stage(rank: int, p: int, v: int, per_round: int) -> Callable[[int, bool], int]:
    """Stage of the k-th forward (chunks ascend in blocks of ``per_round``) or k-th backward (chunks descend)."""

    def stage(k: int, backward: bool) -> int:
        chunk = (k // per_round) % v
        return ((v - 1 - chunk) if backward else chunk) * p + rank

    return stage


def _interleaved(rank: int, p: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    """Megatron interleaved 1F1B (Narayanan et al. 2021) and its zero-bubble variant ZB-1P (Qi et al. 2023).

    1. Microbatches go in rounds of ``per_round``; within a round each chunk gets every microbatch (depth first).
    2. Warm-up forwards: (v - 1) rounds plus ``hop`` per rank from the end (hop 2 for 1F1B, 1 for zero bubble).
    3. Steady state: one forward, then one backward (B, or I for zero bubble).
    4. Zero bubble: rank r delays each W by r backward steps, then flushes the remaining W at the end.
    """
    per_round = m // _rounds(p, m)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), m * v)
    stage = _chunk_stage(rank, p, v, per_round)
    next_mb: dict[tuple[int, bool], int] = {}
    pending_w: deque[Action] = deque()
    actions: list[Action] = []

    def emit(k: int, backward: bool) -> None:
        s = stage(k, backward)
        mb = next_mb.get((s, backward), 0)
        next_mb[(s, backward)] = mb + 1
        kind = (Kind.I if zero_bubble else Kind.B) if backward else Kind.F
        actions.append(Action(s, kind, mb))
        if kind is Kind.I:
            pending_w.append(Action(s, Kind.W, mb))
            if k >= rank:
                actions.append(pending_w.popleft())

    for k in range(m * v):
        emit(k, False)
        if k >= warmup:
            emit(k - warmup, True)
    for k in range(m * v - warmup, m * v):
        emit(k, True)
    actions.extend(pending_w)
    return actions


def _interleaved_1f1b(rank: int, p: int, m: int, v: int) -> list[Action]:
    return _interleaved(rank, p, m, v, zero_bubble=False)


def _interleaved_zero_bubble(rank: int, p: int, m: int, v: int) -> list[Action]:
    return _interleaved(rank, p, m, v, zero_bubble=True)


def _zbv(rank: int, p: int, m: int, v: int) -> list[Action]:
    """ZB-V (Qi et al. 2023, section 6): V layout, chunk 0 = stage rank, chunk 1 = stage 2p - 1 - rank.

    Built for n = max(2p - 1, m) microbatches (enough to fill the V), then microbatches >= m are dropped.
    """
    n = max(2 * p - 1, m)
    lo, hi = rank, 2 * p - 1 - rank
    count = {(s, k): 0 for s in (lo, hi) for k in (Kind.F, Kind.I, Kind.W)}
    out: list[Action] = []

    def add(s: int, kind: Kind) -> None:
        out.append(Action(s, kind, count[(s, kind)]))
        count[(s, kind)] += 1

    def add_iw(s: int) -> None:
        add(s, Kind.I)
        add(s, Kind.W)

    for _ in range(2 * (p - rank) - 1):  # warm-up: chunk 0 forwards until chunk 1 can start
        add(lo, Kind.F)
    for _ in range(rank):  # alternate chunk 1 and chunk 0 forwards
        add(hi, Kind.F)
        add(lo, Kind.F)
    for _ in range(p - rank):  # chunk 1 forward then its backward (I, W)
        add(hi, Kind.F)
        add_iw(hi)
    while count[(hi, Kind.F)] < count[(lo, Kind.F)] or count[(lo, Kind.F)] < n:  # steady V
        if count[(lo, Kind.F)] < n:
            add(lo, Kind.F)
        add_iw(lo)
        add(hi, Kind.F)
        add_iw(hi)
    for _ in range(rank):  # cool-down: input backwards first, weights deferred
        add(lo, Kind.I)
        add(hi, Kind.I)
    for _ in range(p - rank):
        add(lo, Kind.I)
        add(lo, Kind.W)
    for s in (hi, lo):
        while count[(s, Kind.W)] < count[(s, Kind.I)]:
            add(s, Kind.W)
    return [a for a in out if a.microbatch < m]


def _dual_pipe_v(rank: int, p: int, m: int, v: int) -> list[Action]:
    """DualPipeV: the V-shaped "cut in half" DualPipe of DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437).

    Eight phases per rank; an overlapped forward+backward pair is listed as its forward then its full backward
    (torch runs the two sub-actions of OVERLAP_F_B in that order). Split backwards (I) queue their W, which is
    issued later in FIFO order.
    """
    lo, hi = rank, 2 * p - 1 - rank
    fwd = {lo: 0, hi: 0}
    bwd = {lo: 0, hi: 0}
    pending_w: deque[Action] = deque()
    out: list[Action] = []

    def f(s: int) -> None:
        out.append(Action(s, Kind.F, fwd[s]))
        fwd[s] += 1

    def b(s: int, split: bool) -> None:
        out.append(Action(s, Kind.I if split else Kind.B, bwd[s]))
        if split:
            pending_w.append(Action(s, Kind.W, bwd[s]))
        bwd[s] += 1

    def w() -> None:
        if pending_w:
            out.append(pending_w.popleft())

    for _ in range(2 * (p - rank - 1)):  # 1: chunk 0 forwards
        f(lo)
    for _ in range(rank + 1):  # 2: forwards of both chunks
        f(lo)
        f(hi)
    for _ in range(p - rank - 1):  # 3: chunk 1 zero-bubble backward, then forward
        b(hi, split=True)
        w()
        f(hi)
    for i in range(m - 2 * p + rank + 1):  # 4: main overlapped phase F0+B1, F1+B0
        f(lo)
        b(hi, split=False)
        f(hi)
        b(lo, split=False)
    for _ in range(p - rank - 1):  # 5: B1 then F1+B0
        b(hi, split=False)
        f(hi)
        b(lo, split=False)
    split = False
    for i in range(rank + 1):  # 6: B1 B0, second half split into I/W
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        b(hi, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        b(lo, split)
    for _ in range(p - rank - 1):  # 7: W then chunk-0 backward
        w()
        b(lo, split)
    for _ in range(rank + 1):  # 8: drain weights
        w()
    return out


_BUILDERS: dict[ScheduleName, Callable[[int, int, int, int], list[Action]]] = {
    ScheduleName.GPIPE: _gpipe,
    ScheduleName.ONE_F_ONE_B: _one_f_one_b,
    ScheduleName.INTERLEAVED_1F1B: _interleaved_1f1b,
    ScheduleName.LOOPED_BFS: _looped_bfs,
    ScheduleName.INTERLEAVED_ZERO_BUBBLE: _interleaved_zero_bubble,
    ScheduleName.ZBV_ZERO_BUBBLE: _zbv,
    ScheduleName.DUAL_PIPE_V: _dual_pipe_v,
}
