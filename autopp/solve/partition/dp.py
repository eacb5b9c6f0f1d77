"""Exact dynamic programs for contiguous stage boundaries: the pipeline (Alpa/DAPPLE) objective and plain min-max.

Pipeline objective (1F1B-like schedules; DAPPLE, Fan et al. 2021; Alpa, Zheng et al. 2022 section 5.2):
    sum_s (T_s + 2 c_s) + (m - 1) max_s T_s,
T_s = work of stage s / speed of its device, c_s = time to send its output to stage s + 1. The max term makes it
not a plain sum, so, as Alpa does, we enumerate the bottleneck t: for each candidate t a DP minimises the additive
part g(t) with every T_s <= t, and the answer is min_t g(t) + (m - 1) t. It is exact because the optimum's own
bottleneck is one of the candidates. Speed-ups (results unchanged):
  1. The feasible start i of a stage ending at unit j is an interval [L(j), j - 1] (time and memory grow with the
     stage), so each DP layer is a range minimum, vectorised with a sparse table: O(S n log n) numpy work per t.
  2. t starts at the min-max bottleneck (binary search with a reachability DP) and stops once
     g(inf) + (m - 1) t >= the best objective found, since g(t) >= g(inf).
Every cost comes from the cost model (autopp.costmodel): per-unit work (`UnitArrays.work`, and what a stage adds
at its first unit, `UnitArrays.starts`: non-decreasing, so the feasible starts stay an interval), a stage's memory
(`memory_prefix`: static bytes + the activation bytes its policy charges for its in-flight count from the
schedule's order (`ActivationPolicy.unit_bytes`), + `stage_transient`, its units' largest working memory, + its
outputs per in-flight microbatch, `stage_outputs`, which depend on where it ends only), and
the send time of each cut (`send_times`), under a per-stage budget.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ...data.cluster import Link
from ...costmodel import UnitArrays, memory_prefix, send_times, stage_outputs, stage_transient
from ...schedule import Activation

__all__ = ["Objective", "PipeSpec", "Bounds", "pipeline_bounds", "min_max_bounds", "pipeline_objective",
           "min_memory", "fits", "balanced_bounds", "even_bounds", "feasible", "DpMemo"]

INF = float("inf")
_ARANGE = np.arange(1 << 14)
_LOG2 = np.concatenate(([0], np.floor(np.log2(np.arange(1, 1 << 14))).astype(np.int64)))
Bounds = tuple[tuple[int, int], ...]


class Objective(enum.Enum):
    """What a split minimises."""

    PIPELINE = "pipeline"
    """sum_s (T_s + 2 c_s) + (m - 1) max_s T_s."""
    MIN_MAX = "min-max"
    """max_s T_s (the time-balanced split)."""


@dataclass(frozen=True, kw_only=True)
class PipeSpec:
    """The stages to cut: how many, on what devices, with which memory budgets and in-flight microbatches."""

    num_stages: int
    microbatches: int = 1
    activation: Activation = Activation.KEEP
    """Every stage's activation policy."""
    speed: tuple[float, ...] = ()
    """Relative speed of the device running each stage (empty: all 1)."""
    memory: tuple[float, ...] = ()
    """Memory budget of each stage in bytes (empty: unlimited)."""
    inflight: tuple[int, ...] = ()
    """Microbatches of activations each stage holds at its peak (empty: 1)."""
    links: tuple[Link | None, ...] = ()
    """Link after each stage but the last (None: same device, free; empty: all free)."""
    uncut: tuple[int, ...] = ()
    """Unit boundaries where no stage may end (the model's ends, 0 and n, are ignored): a cut the runner cannot
    make, e.g. right after the embedding under vocabulary parallelism, where the first stage would be empty."""

    def __post_init__(self) -> None:
        s = self.num_stages
        for name in ("speed", "memory", "inflight"):
            got = len(getattr(self, name))
            if got not in (0, s):
                raise ValueError(f"{name} needs one entry per stage ({got} != {s})")
        if len(self.links) not in (0, s - 1):
            raise ValueError(f"links needs one entry per stage boundary ({len(self.links)} != {s - 1})")


@dataclass
class _Tables:
    """Per-stage vectors over unit boundaries 0..n derived from a PipeSpec."""

    work: np.ndarray  # prefix sums of per-unit work
    start: np.ndarray  # as a stage's start sees them (`UnitArrays.starts`): T of [i, j) = work[j] - start[i]
    speed: list[float]
    mem: list[np.ndarray]  # prefix sums of per-unit memory at each stage
    budget: list[float]
    comm: list[np.ndarray]  # comm[k][j]: send time after stage k ending at j
    m: int
    uncut: np.ndarray  # unit boundaries no stage may end at (spec.uncut inside 1..n-1)
    out: list[np.ndarray] = field(default_factory=list)  # out[k][j]: stage k ending at j keeps its outputs
    mem_left: list[np.ndarray | None] = field(default_factory=list)  # per stage: first start within the budget
    transient: np.ndarray | None = None  # sparse max table of the units' transients (None: all 0)


def _tables(a: UnitArrays, spec: PipeSpec, values: np.ndarray | None = None) -> _Tables:
    s = spec.num_stages
    unit = values if values is not None else a.work(spec.activation)
    work = a.prefix(unit)
    # non-decreasing (UnitArrays.stage_start); the running max only irons out rounding
    start = work if values is not None else np.maximum.accumulate(a.starts(unit))
    inflight = spec.inflight or (1,) * s
    mem = [memory_prefix(a, inflight[k], spec.activation) for k in range(s)]
    comm = [send_times(a, lk) for lk in spec.links or (None,) * (s - 1)]
    comm.append(send_times(a, None))  # the last stage sends nothing
    uncut = np.array(sorted({b for b in spec.uncut if 0 < b < a.n}), dtype=np.int64)
    tb = _Tables(work, start, list(spec.speed or (1.0,) * s), mem, list(spec.memory or (INF,) * s), comm,
                 spec.microbatches, uncut, [stage_outputs(a, inflight[k]) for k in range(s)])
    transient = a.transient_bytes()
    tb.transient = _max_table(transient) if transient.any() else None
    _set_budgets(tb, tb.budget)
    return tb


def _set_budgets(tb: _Tables, budget: list[float]) -> None:
    """Memory budgets do not depend on the bottleneck t: find each stage's first feasible start once."""
    tb.budget = budget
    tb.mem_left = [None if not np.isfinite(b) else
                   np.searchsorted(m, m + out - b * (1 + 1e-12), side="left")
                   for m, out, b in zip(tb.mem, tb.out, budget)]
    if tb.transient is not None:
        tb.mem_left = [None if lo is None else _first_fit(m, tb.transient, b * (1 + 1e-12) - out, lo)
                       for m, out, b, lo in zip(tb.mem, tb.out, budget, tb.mem_left)]


def _max_table(values: np.ndarray) -> np.ndarray:
    """Sparse table of `values` (length n) padded with one 0: table[l, i] = max(values[i : i + 2^l])."""
    n1 = len(values) + 1
    table = np.zeros((max(1, n1.bit_length()), n1))
    table[0, :-1] = values
    width = 1
    for level in range(1, len(table)):
        table[level, :n1 - width] = np.maximum(table[level - 1, :n1 - width], table[level - 1, width:])
        width *= 2
    return table


def _range_max(table: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """max(values[i:j]) per pair (0 for an empty range), from `_max_table`."""
    length = np.maximum(j - i, 1)
    level = np.floor(np.log2(length)).astype(np.int64)
    out = np.maximum(table[level, np.minimum(i, table.shape[1] - 1)], table[level, np.maximum(j - (1 << level), 0)])
    return np.where(j > i, out, 0.0)


def _first_fit(m: np.ndarray, table: np.ndarray, budget: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Per end j, the first start i >= lo[j] with m[j] - m[i] + the largest transient of [i, j) within `budget[j]`
    (a binary search for all j at once: both terms shrink as i grows)."""
    j = np.arange(len(m))
    lo, hi = lo.copy(), np.maximum(j, lo)  # lo > j: no start fits (a stage ending at j keeps outputs over budget)
    while (open_ := lo < hi).any():
        mid = np.minimum((lo + hi) // 2, len(m) - 1)  # closed entries' mid may lie past the end: never used
        ok = m[j] - m[mid] + _range_max(table, mid, j) <= budget[j]
        hi = np.where(open_ & ok, mid, hi)
        lo = np.where(open_ & ~ok, mid + 1, lo)
    return lo


def _left(tb: _Tables, k: int, t: float) -> np.ndarray:
    """L[j] for j = 0..n: the first start i with stage time and memory of [i, j) within t and budget."""
    slack = t * tb.speed[k]
    slack = slack * (1 + 1e-12) + 1e-15 if np.isfinite(slack) else slack
    lo = np.searchsorted(tb.start, tb.work - slack, side="left") if np.isfinite(slack) \
        else np.zeros(len(tb.work), np.int64)
    mem = tb.mem_left[k]
    return lo if mem is None else np.maximum(lo, mem)


def _range_min(values: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """out[j] = min(values[lo[j]:j]) for j = 0..n (inf for an empty range): a sparse table, all queries at once."""
    n1 = len(values)
    depth = max(1, int(n1).bit_length())
    table = np.full((depth, n1), INF)  # table[l, i] = min(values[i : i + 2^l])
    table[0] = values
    width = 1
    for level in range(1, depth):
        table[level, :n1 - width] = np.minimum(table[level - 1, :n1 - width], table[level - 1, width:])
        width *= 2
    hi = _ARANGE[:n1] - 1 if n1 <= len(_ARANGE) else np.arange(n1) - 1  # inclusive right end j - 1
    length = np.maximum(hi - lo + 1, 1)
    level_of = _LOG2[length] if length.max() < len(_LOG2) else np.floor(np.log2(length)).astype(np.int64)
    out = np.minimum(table[level_of, np.minimum(lo, n1 - 1)], table[level_of, np.maximum(hi - (1 << level_of) + 1, 0)])
    out[hi - lo + 1 < 1] = INF
    return out


def _additive(tb: _Tables, t: float) -> tuple[float, list[np.ndarray], list[np.ndarray]] | None:
    """g(t) = min sum_s (T_s + 2 c_s) over splits with every T_s <= t and memory in budget, with the per-layer
    arrays needed to trace the split back (None when no split qualifies)."""
    n1 = len(tb.work)
    prev = np.full(n1, INF)
    prev[0] = 0.0
    shifted, lefts = [], []
    for k in range(len(tb.speed)):
        # Stage k covers [i, j): T = (work[j] - start[i]) / speed, so the best i minimises prev[i] - start[i] / speed.
        arr = prev - tb.start / tb.speed[k]
        lo = _left(tb, k, t)
        prev = tb.work / tb.speed[k] + 2 * tb.comm[k] + _range_min(arr, lo)
        prev[tb.uncut] = INF
        shifted.append(arr)
        lefts.append(lo)
    best = float(prev[-1])
    return None if not np.isfinite(best) else (best, shifted, lefts)


def _trace(shifted: list[np.ndarray], lefts: list[np.ndarray]) -> Bounds:
    j, out = len(shifted[0]) - 1, []
    for k in range(len(shifted) - 1, -1, -1):
        lo = int(lefts[k][j])
        i = lo + int(np.argmin(shifted[k][lo:j]))
        out.append((i, j))
        j = i
    return tuple(reversed(out))


def _reachable(tb: _Tables, t: float) -> bool:
    """Is there a split with every stage time <= t and every stage in budget? (A counting DP, no costs.)"""
    reach = np.zeros(len(tb.work), dtype=np.int64)
    reach[0] = 1
    for k in range(len(tb.speed)):
        count = np.concatenate(([0], np.cumsum(reach)))  # count[x] = reachable starts < x
        lo = _left(tb, k, t)
        j = np.arange(len(reach))
        reach = ((count[j] - count[np.minimum(lo, j)]) > 0).astype(np.int64)
        reach[tb.uncut] = 0
    return bool(reach[-1])


def _candidates(tb: _Tables) -> np.ndarray:
    """Every possible stage time: (work[j] - start[i]) / speed, ascending."""
    w = tb.work
    diffs = (w[None, :] - tb.start[:, None])[np.triu_indices(len(w), 1)]
    return np.unique(np.concatenate([diffs / sp for sp in sorted(set(tb.speed))]))


def _min_max_index(tb: _Tables, cands: np.ndarray) -> int | None:
    """Index in `cands` of the least feasible bottleneck (binary search), or None when nothing fits."""
    if not _reachable(tb, INF):
        return None
    # No bottleneck is below the largest one-unit stage on the fastest device, nor below the total over all speeds.
    # (A stage of one unit i takes work[i + 1] - start[i]; the stages together at least the total less the most
    # that S first units take off, `UnitArrays.stage_start` <= 0.)
    off = np.sort(np.maximum(tb.start - tb.work, 0.0)[:-1])[::-1][:len(tb.speed)].sum()
    floor = max(float(np.max(tb.work[1:] - tb.start[:-1])) / max(tb.speed),
                float(tb.work[-1] - off) / sum(tb.speed))
    lo, hi = int(np.searchsorted(cands, floor * (1 - 1e-9))), len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _reachable(tb, float(cands[mid])):
            hi = mid
        else:
            lo = mid + 1
    return lo


class DpMemo:
    """Bottleneck candidates shared by DP runs on the same arrays (they depend only on the per-unit work and the
    set of speeds): computing them is O(n^2 log n), the dearest step for large models. One memo per UnitArrays."""

    def __init__(self) -> None:
        self.candidates: dict[tuple[Activation, tuple[float, ...]], np.ndarray] = {}

    def get(self, tb: _Tables, activation: Activation) -> np.ndarray:
        key = (activation, tuple(sorted(set(tb.speed))))
        if key not in self.candidates:
            self.candidates[key] = _candidates(tb)
        return self.candidates[key]


def feasible(a: UnitArrays, spec: PipeSpec) -> bool:
    """Does some split fit every stage's memory budget? (A reachability DP: far cheaper than pipeline_bounds.)"""
    return _check(a, spec) and _reachable(_tables(a, spec), INF)


def _check(a: UnitArrays, spec: PipeSpec) -> bool:
    return 1 <= spec.num_stages <= a.n


def min_max_bounds(a: UnitArrays, spec: PipeSpec, values: np.ndarray | None = None) -> Bounds | None:
    """The split minimising max_s T_s (T from `values` per unit if given, e.g. parameter counts), under the
    memory budgets; among those, the least sum_s (T_s + 2 c_s). None when no split fits."""
    if not _check(a, spec):
        return None
    tb = _tables(a, spec, values)
    cands = _candidates(tb)
    idx = _min_max_index(tb, cands)
    if idx is None:
        return None
    found = _additive(tb, float(cands[idx]))
    return None if found is None else _trace(found[1], found[2])


def pipeline_bounds(a: UnitArrays, spec: PipeSpec, memo: DpMemo | None = None) -> Bounds | None:
    """The split minimising sum_s (T_s + 2 c_s) + (m - 1) max_s T_s under the memory budgets (exact; see the module
    docstring). None when no split fits. `memo` (for `a` only) shares the bottleneck candidates between calls."""
    if not _check(a, spec):
        return None
    tb = _tables(a, spec)
    floor = _additive(tb, INF)  # g(inf): a lower bound on the additive part for every t
    if floor is None:
        return None
    m1 = tb.m - 1
    if m1 == 0:  # one microbatch: the additive part is the whole objective
        return _trace(floor[1], floor[2])
    cands = memo.get(tb, spec.activation) if memo is not None else _candidates(tb)
    idx = _min_max_index(tb, cands)
    assert idx is not None  # reachable at inf since floor exists
    best: tuple[float, Bounds] | None = None
    # 1. Bottleneck candidates t in ascending order, from the min-max bottleneck.
    for t in cands[idx:]:
        # 2. Stop when even the least additive part cannot beat the best objective found.
        if best is not None and floor[0] + m1 * float(t) >= best[0]:
            break
        # 3. Least additive part with every stage <= t; t overestimates a split's true bottleneck only when a
        #    smaller candidate (already tried) is its real one, so the minimum over t is exact.
        found = _additive(tb, float(t))
        if found is not None and (best is None or found[0] + m1 * float(t) < best[0]):
            best = (found[0] + m1 * float(t), _trace(found[1], found[2]))
    return None if best is None else best[1]


def pipeline_objective(a: UnitArrays, spec: PipeSpec, bounds: Sequence[tuple[int, int]]) -> float:
    """sum_s (T_s + 2 c_s) + (m - 1) max_s T_s of `bounds` (the DP's objective, for checks and baselines)."""
    tb = _tables(a, spec)
    times = [(tb.work[j] - tb.start[i]) / tb.speed[k] for k, (i, j) in enumerate(bounds)]
    comm = sum(tb.comm[k][j] for k, (_, j) in enumerate(bounds))
    return float(sum(times) + 2 * comm + (tb.m - 1) * max(times))


def fits(a: UnitArrays, spec: PipeSpec, bounds: Sequence[tuple[int, int]]) -> bool:
    """Does every stage of `bounds` fit its memory budget (as the DP models it)?"""
    tb = _tables(a, spec)
    return all(tb.mem[k][j] - tb.mem[k][i] + stage_transient(a, i, j) + tb.out[k][j] <= tb.budget[k] * (1 + 1e-12)
               for k, (i, j) in enumerate(bounds))


def min_memory(a: UnitArrays, spec: PipeSpec) -> int:
    """The least per-device memory (the same budget for every stage) for which some split fits, in bytes."""
    tb = _tables(a, spec)
    lo, hi = 0, int(max(m[-1] for m in tb.mem) + stage_transient(a, 0, a.n) + max(o.max() for o in tb.out)) + 1
    while lo < hi:
        mid = (lo + hi) // 2
        _set_budgets(tb, [float(mid)] * len(tb.speed))
        if _reachable(tb, INF):
            hi = mid
        else:
            lo = mid + 1
    return lo


def balanced_bounds(a: UnitArrays, num_stages: int, values: np.ndarray) -> Bounds:
    """Min-max split of per-unit `values` (e.g. parameter counts) into `num_stages` stages, ignoring memory."""
    found = min_max_bounds(a, PipeSpec(num_stages=num_stages), values)
    assert found is not None
    return found


def even_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """Split n units into p stages of as equal a unit count as possible (the earlier stages get the extras)."""
    q, r = divmod(n, p)
    ends = [0]
    for s in range(p):
        ends.append(ends[-1] + q + (s < r))
    return list(zip(ends, ends[1:]))

