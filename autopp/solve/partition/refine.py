"""The simulator's best split and per-stage recomputation for one configuration, exact where that is affordable.

The DP (dp.py) is exact for its closed-form objective, which the simulator does not share: where the bottleneck sits,
ties, a slow cut paid on every round trip, per-message overheads and progress delays. Given a configuration (schedule,
pp, v, m, dp, microbatch size) and the DP's split, `refine` searches contiguous splits and recompute choices judged by
the simulator itself (`judge.judge`):

1. Recomputation per stage, as AdaPipe chooses it jointly with the split (Sun et al., "AdaPipe: Optimizing Pipeline
   Parallelism with Adaptive Recomputation and Partitioning", ASPLOS'24): a stage's policy changes only its own rank's
   memory (the order walk `effects.rank_peak`), and each policy up the ladder of allowed ones (keep, then those
   saving more memory, `PlanRequest.ladder`) can only add time (a longer B or I), so for a split the candidates are,
   per rank, the minimal assignments of ladder steps to its stages that make the rank fit (`recompute_choices`);
   any assignment above one of them is slower, and none below fits.
2. Exact mode, when the configuration has at most `exact_limit` contiguous splits: every split gets a lower bound
   (`split_floor`: the busiest rank's compute actions back to back, plus the step's end, a bound of the simulated
   step); they are simulated in order of that bound until it exceeds the best step found. The answer is the simulator's
   optimum over splits and recompute choices (tests/solve/test_refine.py checks it against the brute force).
3. Otherwise a local search from the DP's split and the baselines' (even, parameter- and time-balanced): move one
   cut by one unit, keep the best improvement, until none improves or `budget` simulations are spent. It never
   returns worse than its best seed.
Preference between equal step times: less peak memory, then the earlier split, then fewer recomputing stages.
"""

from __future__ import annotations

import itertools
from collections import Counter
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from ...costmodel import (UnitArrays, comm_times, message_overheads, send_times, stage_costs, stage_speeds,
                         step_end_floor, step_end_time)
from ...data.cluster import Cluster
from ...schedule import COMPUTE_KINDS, Action, Activation, Kind, StageCost, describe, pairing, policy
from ...schedule.effects import RankWalk, durations, rank_static_bytes
from .baselines import baseline_bounds
from .dp import Bounds
from ..search.bounds import without_comm
from ..search.judge import Candidate, Verdict, judge, named_order

__all__ = ["Refined", "EXACT_LIMIT", "SLACK", "recompute_choices", "action_counts", "split_floor", "candidate_floor",
           "refine"]

EXACT_LIMIT = 1000
"""Most contiguous splits a configuration may have for `refine` to visit them all (exact mode)."""
SLACK = 1 + 1e-9
"""A floor from prefix sums may exceed the summed stage times by rounding: prune only beyond this factor."""
_MAX_CHOICES = 16
"""Most recompute choices judged per split (the product of the ranks' minimal sets can grow as 2^p)."""


@dataclass(frozen=True)
class Refined:
    """What `refine` found."""

    best: Verdict | None
    """The fastest fitting verdict found (None: nothing fits)."""
    exact: bool
    """Every split was visited: `best` is the simulator's optimum for the configuration."""
    judged: int
    """Simulations run."""


def _key(v: Verdict) -> tuple[float, int, Bounds, int]:
    return (v.step_s, max(v.peak_memory), v.candidate.bounds, v.candidate.recomputing)


def _rank_actions(c: Candidate) -> dict[int, list[Action]]:
    order = named_order(c.schedule, c.layout.pp, c.microbatches, c.layout.v)
    return {r: [x for x in order[r] if x is not None and x.kind in COMPUTE_KINDS] for r in sorted(order)}


def _steps(stages: int, top: int) -> list[tuple[int, ...]]:
    """Every assignment of ladder steps 0..`top` to `stages` stages, fewest steps first, then the earlier stages
    higher (with two steps: `itertools.combinations` order of the stages that step up)."""
    return sorted(itertools.product(range(top + 1), repeat=stages), key=lambda v: (sum(v), [-x for x in v]))


def recompute_choices(costs: Sequence[StageCost], owner: Sequence[int], actions: dict[int, list[Action]],
                      memory: Callable[[int], int], ladder: tuple[Activation, ...],
                      fixed: tuple[Activation, ...] | None = None, mirrored: bool = False,
                      walks: dict[int, RankWalk] | None = None,
                      affordable: Callable[[int, Sequence[Activation]], bool] | None = None
                      ) -> list[tuple[Activation, ...]]:
    """Per-stage activation policies worth judging for one split: `fixed` (pinned policies), or a one-policy
    `ladder`, gives its one choice if it fits; a longer ladder (least memory saved first) gives the product over
    ranks of each rank's minimal fitting assignments of ladder steps to its stages (fewest steps first; at most
    `_MAX_CHOICES`). Empty when some rank cannot fit. `memory(r)`: rank r's device memory; `mirrored`: each rank
    also holds its up replicas (Chimera, `effects.rank_static_bytes`). `walks`: `actions` as `RankWalk`s (faster).
    `affordable(r, policies)`: False where rank r under `policies` is known to be slower than a step already found
    (its part of `split_floor` with what its stages' policies redo): such an assignment is left out before its
    memory is walked, as if it did not fit (one that steps up further yet redoes less is still tried, as the
    minimality rule above keeps it anyway)."""
    n = len(costs)
    walks = walks or {r: RankWalk(acts) for r, acts in actions.items()}
    ok = affordable or (lambda r, p: True)
    if fixed is not None:
        fits = all(ok(r, fixed) and walks[r].peak(costs, fixed, rank_static_bytes(costs, owner, r, mirrored))
                   <= memory(r) for r in actions)
        return [fixed] if fits else []
    per_rank: list[list[dict[int, Activation]]] = []
    for r in sorted(actions):
        mine = sorted({a.stage for a in actions[r]}) if mirrored else [s for s in range(n) if owner[s] == r]
        static = rank_static_bytes(costs, owner, r, mirrored)
        minimal: list[tuple[int, ...]] = []
        redo = {s: [policy(p).redo_s(costs[s]) for p in ladder] for s in mine}
        for steps in _steps(len(mine), len(ladder) - 1):
            # a fitting choice with no more steps on any stage is as good unless a step up adds less time (offload
            # on a stage whose transfer does not hide can cost more than recomputing it): that choice is kept too
            if any(all(x == y or x < y and redo[s][y] >= redo[s][x] for s, x, y in zip(mine, m, steps))
                   for m in minimal):
                continue
            policies = [ladder[0]] * n
            for s, k in zip(mine, steps):
                policies[s] = ladder[k]
            if ok(r, policies) and walks[r].peak(costs, policies, static) <= memory(r):
                minimal.append(steps)
        if not minimal:
            return []
        per_rank.append([{s: ladder[k] for s, k in zip(mine, m)} for m in minimal])
    out = []
    for combo in itertools.islice(itertools.product(*per_rank), _MAX_CHOICES):
        mix = {s: a for part in combo for s, a in part.items()}
        out.append(tuple(mix.get(s, ladder[0]) for s in range(n)))
    return out


def action_counts(actions: dict[int, list[Action]]) -> dict[int, Counter[tuple[int, Kind]]]:
    """Per rank, how many compute actions of each (stage, kind) its order holds."""
    return {r: Counter((s, kind) for s, kind, _ in acts) for r, acts in actions.items()}


def split_floor(costs: Sequence[StageCost], owner: Sequence[int], comm: Sequence[float],
                counts: dict[int, Counter[tuple[int, Kind]]], one_stage_per_rank: bool, mirrored: bool = False,
                activations: Sequence[Activation] | None = None) -> float:
    """A lower bound of the simulated pipeline for these stage costs (no recomputation: it only adds time): over
    ranks, the rank's compute actions back to back (it runs one at a time), after the first microbatch's forwards
    through the stages before its first one (it has nothing to do earlier); with one stage per rank and full
    backwards also before that microbatch's backwards back through them (the rank's last action is its last B).
    `mirrored` (Chimera): the rank's first stage is the nearer to the head of its two replicas' chains, and its last
    action is not known, so no tail. `activations`: each stage's policy, its redone work counted (default: keep)."""
    table = [durations(c, p) for c, p in zip(costs, activations or [Activation.KEEP] * len(costs))]
    return max(_rank_floors(table, owner, comm, counts, one_stage_per_rank, mirrored).values(), default=0.0)


def _rank_floors(table: Sequence[dict[Kind, float]], owner: Sequence[int], comm: Sequence[float],
                 counts: dict[int, Counter[tuple[int, Kind]]], one_stage_per_rank: bool,
                 mirrored: bool) -> dict[int, float]:
    """Per rank, its part of `split_floor` given each stage's busy time per kind (`durations`)."""
    hop = [0.0, *[0.0 if owner[s - 1] == owner[s] else comm[s - 1] for s in range(1, len(table))]]
    out = {}
    for r, count in counts.items():
        first = min(owner.index(r), len(owner) - 1 - owner.index(r)) if mirrored else owner.index(r)
        busy = sum(n * table[s][kind] for (s, kind), n in count.items())
        head = sum(table[s][Kind.F] + hop[s + 1] for s in range(first))
        tail = sum(table[s][Kind.B] + hop[s + 1] for s in range(first)) if one_stage_per_rank and not mirrored else 0.0
        out[r] = head + busy + tail
    return out


def candidate_floor(a: UnitArrays, cluster: Cluster, c: Candidate) -> float:
    """A lower bound of `judge(a, cluster, c).step_s`: `split_floor` of `c`'s split under its activation policies
    on the judge's own stage costs and transfers, plus the step's end (`step_end_time`, which the judge adds as it
    is). Not for schedules that overlap forward-backward pairs (`schedule.pairing`: they hide part of F + B)."""
    cluster = cluster.placed(c.layout)
    owner = c.owner
    speeds = stage_speeds(cluster, owner)
    costs = stage_costs(a, c.bounds, speeds, message_overheads(cluster, owner), cluster.host_bandwidth)
    counts = action_counts(_rank_actions(c))
    split = any(kind in (Kind.I, Kind.W) for count in counts.values() for _, kind in count)
    mirrored = c.mirror is not None
    pipe = split_floor(costs, owner, comm_times(a, cluster, c.bounds, owner), counts,
                       len(c.bounds) == c.layout.pp and not split, mirrored, c.activations)
    return pipe + sum(step_end_time(a, cluster, c.bounds, owner, c.layout, speeds, mirrored))


class _Search:
    """One configuration's refinement: the cluster, the candidate template and the best verdict so far."""

    def __init__(self, a: UnitArrays, cluster: Cluster, template: Candidate, ladder: tuple[Activation, ...],
                 admissible: Callable[[Bounds], bool], fixed: tuple[Activation, ...] | None, beat: float) -> None:
        self.end = step_end_floor(a, cluster, template.layout, template.mirror is not None)  # every split's
        # what a schedule that overlaps forward-backward pairs may hide: the floors are taken without it (bounds.py)
        paired = pairing(template.schedule, a.overlap.ep_a2a, template.layout.v) is not None
        self.bare = without_comm(a) if paired and a.ep_time is not None else a
        cluster = cluster.placed(template.layout)
        self.a, self.cluster, self.template, self.ladder, self.admissible = a, cluster, template, ladder, admissible
        self.fixed, self.beat = fixed, beat
        self.owner = template.owner
        self.mirrored = template.mirror is not None
        self.speeds = stage_speeds(cluster, self.owner)
        self.overheads = message_overheads(cluster, self.owner)
        self.actions = _rank_actions(template)
        self.walks = {r: RankWalk(acts) for r, acts in self.actions.items()}
        self.counts = action_counts(self.actions)
        # per rank, how many actions of each stage redo its policy's forward (B and I)
        self.redos = {r: Counter({s: n for (s, kind), n in count.items() if kind in (Kind.B, Kind.I)})
                      for r, count in self.counts.items()}
        split = any(kind in (Kind.I, Kind.W) for count in self.counts.values() for _, kind in count)
        self.one_stage_per_rank = len(template.bounds) == template.layout.pp and not split
        b = self.bare
        self.prefix = {k: b.prefix(x).tolist() for k, x in (("f", b.forward), ("i", b.backward_input),
                                                            ("w", b.backward_weight), ("b", b.backward))}
        links = [cluster.link_between(self.owner[k], self.owner[k + 1]) for k in range(len(self.owner) - 1)]
        self.sends = [[0.0] * (a.n + 1) if self.owner[k] == self.owner[k + 1] else send_times(a, lk).tolist()
                      for k, lk in enumerate(links)]
        self.best: Verdict | None = None
        self.judged = 0
        self.seen: set[Bounds] = set()

    def floor(self, bounds: Bounds) -> float:
        """`split_floor` of `bounds` plus `step_end_floor` (every split's step end is at least that)."""
        table = [self.kept(s, i, j) for s, (i, j) in enumerate(bounds)]
        comm = [self.sends[k][j] for k, (_, j) in enumerate(bounds[:-1])]
        return max(_rank_floors(table, self.owner, comm, self.counts, self.one_stage_per_rank,
                                self.mirrored).values(), default=0.0) + self.end

    def kept(self, s: int, i: int, j: int) -> dict[Kind, float]:
        """Stage s's `durations` under keep over units [i, j) from prefix sums: `stage_costs`'s figures up to
        rounding (a floor of them, with `SLACK`), at a fraction of its cost."""
        p, sp, start, rb, o = self.prefix, self.speeds[s], self.a.start_s(i), self.a.runtime_backward_s, \
            self.overheads[s]
        full = (p["b"][j] - p["b"][i] + start) / sp + rb
        return {Kind.F: (p["f"][j] - p["f"][i]) / sp + self.a.runtime_forward_s + o,
                Kind.I: (0.0 if s == 0 else (p["i"][j] - p["i"][i]) / sp + rb) + o,
                Kind.W: full if s == 0 else (p["w"][j] - p["w"][i] + start) / sp, Kind.B: full + o}

    def _affordable(self, bounds: Bounds, limit: float) -> Callable[[int, Sequence[Activation]], bool] | None:
        """`recompute_choices`'s test: rank r's part of `split_floor` (its busy time between the head it waits for
        and the tail it waits on) under its own stages' policies, the others' kept (a policy redoes >= 0), plus
        the step's end floor, is within `limit`; None when nothing is to beat. A policy adds its redone time to each
        B and I of a stage."""
        if math.isinf(limit):
            return None
        timed = stage_costs(self.bare, bounds, self.speeds, self.overheads, self.cluster.host_bandwidth)
        comm = [self.sends[k][j] for k, (_, j) in enumerate(bounds[:-1])]
        base = _rank_floors([durations(c, Activation.KEEP) for c in timed], self.owner, comm, self.counts,
                            self.one_stage_per_rank, self.mirrored)
        redo = {(s, p): policy(p).redo_s(timed[s]) for s in range(len(timed))
                for p in {*self.ladder, *(self.fixed or ())}}
        return lambda r, policies: base[r] + sum(n * redo[s, policies[s]] for s, n in self.redos[r].items()) + \
            self.end <= limit

    def visit(self, bounds: Bounds) -> Verdict | None:
        """Judge `bounds` under each worthwhile recompute choice (unless its floor cannot beat the best); the best
        fitting verdict of this split, and the search's best updated."""
        if bounds in self.seen or not self.admissible(bounds):
            return None
        self.seen.add(bounds)
        limit = min(self.beat, math.inf if self.best is None else self.best.step_s) * SLACK
        if self.floor(bounds) > limit:
            return None
        # memory does not depend on speed; the policies' added times are compared per stage (`recompute_choices`)
        costs = stage_costs(self.a, bounds, [1.0] * len(bounds), host_bandwidth=self.cluster.host_bandwidth)
        memory = lambda r: self.cluster.device(r).memory_bytes  # noqa: E731
        found: Verdict | None = None
        for policies in recompute_choices(costs, self.owner, self.actions, memory, self.ladder, self.fixed,
                                          self.mirrored, self.walks, self._affordable(bounds, limit)):
            verdict = judge(self.a, self.cluster, replace(self.template, bounds=bounds, activations=policies))
            self.judged += 1
            if verdict.fits and (found is None or _key(verdict) < _key(found)):
                found = verdict
        if found is not None and (self.best is None or _key(found) < _key(self.best)):
            self.best = found
        return found


def _splits(n: int, stages: int) -> Iterator[Bounds]:
    for cuts in itertools.combinations(range(1, n), stages - 1):
        ends = (0, *cuts, n)
        yield tuple(zip(ends, ends[1:]))


def _neighbours(bounds: Bounds) -> list[Bounds]:
    """Every split that moves one cut of `bounds` by one unit, keeping every stage non-empty."""
    cuts = [j for _, j in bounds[:-1]]
    n = bounds[-1][1]
    out = []
    for k in range(len(cuts)):
        for step in (-1, 1):
            moved = cuts[:k] + [cuts[k] + step] + cuts[k + 1:]
            ends = [0, *moved, n]
            if all(x < y for x, y in zip(ends, ends[1:])):
                out.append(tuple(zip(ends, ends[1:])))
    return out


def refine(a: UnitArrays, cluster: Cluster, seed: Candidate, ladder: tuple[Activation, ...], *,
           admissible: Callable[[Bounds], bool] = lambda b: True, exact_limit: int = EXACT_LIMIT,
           budget: int = 64, fixed: tuple[Activation, ...] | None = None, beat: float = math.inf) -> Refined:
    """The simulator's best split and recompute choice for `seed`'s configuration (module docstring): exact when it
    has at most `exact_limit` splits, else a local search of at most `budget` simulations from `seed`'s split and
    the baselines'. `ladder`: the policies a stage may take, least memory saved first (`PlanRequest.ladder`).
    `admissible` leaves out splits the runner would refuse; `fixed` pins the policies. Splits and per-rank
    recompute choices whose floor exceeds `beat` (another configuration's step) are not simulated, the seeds'
    included: then `best` (None when nothing was simulated) is the optimum only if it is below `beat`."""
    search = _Search(a, cluster, seed, ladder, admissible, fixed, beat)
    stages = len(seed.bounds)
    exact = math.comb(a.n - 1, stages - 1) <= exact_limit
    for bounds in [seed.bounds, *baseline_bounds(a, stages).values()]:
        if not exact and search.judged >= budget:
            break
        search.visit(tuple(bounds))
    if exact:
        # most promising first, so the best is found early and the rest is cut off by its floor
        for floor, bounds in sorted((search.floor(b), b) for b in _splits(a.n, stages)):
            if floor > min(beat, search.best.step_s if search.best is not None else math.inf) * SLACK:
                break
            search.visit(bounds)
        return Refined(search.best, True, search.judged)
    current = search.best
    while current is not None and search.judged < budget:
        for bounds in _neighbours(current.candidate.bounds):
            search.visit(bounds)
            if search.judged >= budget:
                break
        if search.best is current:
            break
        current = search.best
    return Refined(search.best, False, search.judged)
