"""Order builders of the named schedules: rank r's compute actions, in the order torch.distributed.pipelining runs
them (each schedule's other properties live in its descriptor, `descriptors.py`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import lru_cache

from autopp.schedule.actions import Action, Kind

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dual_pipe_v",
           "chimera", "seq_1f1b"]


def gpipe(rank: int, p: int, m: int, v: int) -> list[Action]:
    """GPipe (Huang et al. 2019): all forwards, then all backwards, both in microbatch order."""
    return [Action(rank, Kind.F, i) for i in range(m)] + [Action(rank, Kind.B, i) for i in range(m)]


def one_f_one_b(rank: int, p: int, m: int, v: int) -> list[Action]:
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


def seq_1f1b(rank: int, p: int, m: int, v: int, chunks: int = 1) -> list[Action]:
    """Seq1F1B (Sun et al., NAACL 2025; TeraPipe, Li et al., ICML 2021 pipelines the same chunks GPipe-style): 1F1B
    over (microbatch, chunk) units, each microbatch split along the sequence into ``chunks`` pieces.

    Unit u = microbatch * chunks + chunk is the action's "microbatch". Forwards run in unit order (a chunk after the
    earlier chunks of its sequence, whose K/V it reads); backwards run microbatch by microbatch, chunks in reverse
    (chunk c's K/V receives gradient from every later chunk, so its backward comes after theirs). Warm-up: 1F1B's
    p - rank forwards plus chunks - 1, so the last stage holds a whole sequence before its first backward; then one
    backward and one forward in turn. With one chunk this is `one_f_one_b` exactly.
    """
    units = m * chunks
    backwards = [mb * chunks + c for mb in range(m) for c in reversed(range(chunks))]
    warmup = min(units, p - rank + chunks - 1)
    actions = [Action(rank, Kind.F, u) for u in range(warmup)]
    for j, u in enumerate(backwards):
        actions.append(Action(rank, Kind.B, u))
        if warmup + j < units:
            actions.append(Action(rank, Kind.F, warmup + j))
    return actions


def looped_bfs(rank: int, p: int, m: int, v: int) -> list[Action]:
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
    per_round = m // max(1, m // p)  # microbatches per round (torch: rounds = max(1, m // p))
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


def interleaved_1f1b(rank: int, p: int, m: int, v: int) -> list[Action]:
    return _interleaved(rank, p, m, v, zero_bubble=False)


def interleaved_zero_bubble(rank: int, p: int, m: int, v: int) -> list[Action]:
    return _interleaved(rank, p, m, v, zero_bubble=True)


def zbv(rank: int, p: int, m: int, v: int) -> list[Action]:
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


def dual_pipe_v(rank: int, p: int, m: int, v: int) -> list[Action]:
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


def chimera(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Chimera (Li and Hoefler, SC'21): two pipelines over the same p ranks, "down" (stage s on rank s) and "up"
    (stage s on rank p - 1 - s); microbatches 0..m/2-1 go down and m/2..m-1 go up, so the bubbles of one direction
    fill with the other's work. Rank r runs stage r of the down microbatches and stage p - 1 - r of the up ones.

    The order is derived rather than copied from the paper's figures: a unit-time list schedule (F 1, B 2, the
    paper's assumption) in which a free rank runs, among its ready actions, (1) a backward before a forward
    (1F1B's rule, which bounds the activations held), (2) the earliest microbatch of its direction, (3) down before
    up; and (4) a replica holds at most p forwards without their backward. Unit-time steps against 1F1B (p, m:
    Chimera / 1F1B): 4, 4: 16 / 21; 8, 8: 36 / 45; 8, 32: 110 / 117, at most 2p microbatches of activations per
    rank (1F1B: p) besides the two replicas' weights. For m > p the paper's basic units (p microbatches) follow each
    other without a flush between them. Pipelines with p even only (`descriptors` checks it).
    """
    return list(_chimera_orders(p, m)[rank])


@lru_cache(maxsize=32)
def _chimera_orders(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    half = m // 2
    cost = {Kind.F: 1, Kind.B: 2}
    done: dict[tuple[int, Kind, int], int] = {}  # (stage, kind, microbatch) -> end time
    inflight = {(s, up): 0 for s in range(p) for up in (False, True)}
    busy_until = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    # Each (stage, kind, direction) runs its microbatches in order (by induction over the stages: a later one is
    # ready only once the earlier one is, and the rule prefers the earlier), so a rank's candidates are the next
    # microbatch of each of its two stages' F and B: `following` holds it (the end of the direction: none left).
    following = {(s, k, up): half if up else 0 for s in range(p) for k in (Kind.F, Kind.B) for up in (False, True)}
    stop = {False: half, True: m}
    left = 2 * p * m

    def ready(s: int, k: Kind, i: int, t: int) -> bool:
        if k is Kind.F:
            return (s == 0 or done.get((s - 1, Kind.F, i), t + 1) <= t) and inflight[(s, i >= half)] < p
        return done.get((s, Kind.F, i), t + 1) <= t and (s == p - 1 or done.get((s + 1, Kind.B, i), t + 1) <= t)

    t = 0
    while left:
        for r in range(p):
            if busy_until[r] > t:
                continue
            mine = [(s, k, i) for s, up in ((r, False), (p - 1 - r, True)) for k in (Kind.F, Kind.B)
                    for i in [following[(s, k, up)]] if i < stop[up] and ready(s, k, i, t)]
            if not mine:
                continue
            s, k, i = min(mine, key=lambda x: (x[1] is Kind.F, x[2] % half, x[2] >= half))
            following[(s, k, i >= half)] += 1
            left -= 1
            busy_until[r] = t + cost[k]
            done[(s, k, i)] = t + cost[k]
            inflight[(s, i >= half)] += 1 if k is Kind.F else -1
            orders[r].append(Action(s, k, i))
        t += 1
    return tuple(tuple(o) for o in orders)
