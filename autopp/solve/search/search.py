"""The joint search: tensor parallelism x ZeRO stage x schedule x virtual stages x data parallelism x microbatches x
recomputation, judged by the simulator.

1. Enumerate configurations (request.py: tp from the profile's tensor-parallel rows, dp dividing the groups of tp
   devices and the global batch, pp = devices / (dp tp), ZeRO stages, schedules, v, m). Each tp sees the cluster
   as its groups of tp devices (views.py), so everything below runs on that view with that tp's unit arrays.
2. For each, the exact DP (dp.py) cuts the stages for the pipeline objective under per-stage memory budgets, and a
   closed-form estimate (the schedule descriptor's + all-reduce) ranks it.
3. The simulator judges the best-estimated configurations in order until `shortlist` of them fit; recomputation
   ("auto") is switched on stage by stage where a rank overflows. The fastest fitting verdict wins (ties: less
   memory); its `predicted` figures and the baselines' are the simulator's.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

from ...data.cluster import Cluster
from ...costmodel import (ProfileTable, UnitArrays, comm_times, message_overheads, stage_costs, stage_speeds,
                         step_end_time)
from ...data.profile import Profile
from ...progress import PROGRESS_LOG, share_line
from ...schedule import (COMPUTE_KINDS, Activation, Pairing, ScheduleName, StageCost, describe, pairing, policy,
                         stage_to_rank)
from ...schedule.sim_state import hidden_s
from ...schedule.effects import RankWalk, inflight_peaks, rank_static_bytes
from .band import band, choose, has_spread
from .bounds import lower_bound
from .prove import Proof, prove
from ..partition.dp import Bounds, DpMemo, PipeSpec, feasible, fits, pipeline_bounds
from .judge import Candidate, Verdict, judge, named_order
from .refining import beyond, refine_one, refined
from .request import Config, PlanRequest, configs
from .runnable import PARALLEL_KEY, mirror_refusal, parallel_refusal, schedule_refusal
from .views import ArraysKey, Views, arrays_key

__all__ = ["inflight", "pipe_spec", "links_hold_messages", "search"]

log = logging.getLogger(__name__)
_progress = logging.getLogger(PROGRESS_LOG)



def inflight(name: ScheduleName, pp: int, m: int, v: int) -> tuple[int, ...]:
    """Per stage, microbatches of activations held at its peak: the descriptor's closed form where it has one
    (GPipe: m; 1F1B: min(p - s, m)); otherwise chunk c of every rank gets the count of chunk c on rank 0, which warms
    up the most."""
    exact = describe(name).exact_inflight
    return exact(pp, m) if exact is not None else _walked(name, pp, m, v)


@lru_cache(maxsize=256)
def _walked(name: ScheduleName, pp: int, m: int, v: int) -> tuple[int, ...]:
    owner = stage_to_rank(name, pp, v)
    builder = describe(name).builder
    assert builder is not None  # configurations are named schedules
    top = inflight_peaks(builder(0, pp, m, v))  # rank 0's order only: a full build costs p times more
    ranks_chunk = [sum(1 for t in range(s) if owner[t] == owner[s]) for s in range(len(owner))]
    by_chunk = [top[s] for s in sorted(top)]  # rank 0's stages in chunk order
    return tuple(min(m, by_chunk[c]) for c in ranks_chunk)


def pipe_spec(req: PlanRequest, c: Config, activation: Activation, walk: bool = True) -> PipeSpec:
    """The DP's view of a configuration, every stage under `activation`; `walk=False` bounds every stage's in-flight
    count by m (no order walk)."""
    pp, v = c.layout.pp, c.layout.v
    owner = stage_to_rank(c.schedule, pp, v)
    share = v * (1 if describe(c.schedule).mirror(c.m) is None else 2)  # Chimera: two replicas per rank
    cl = req.cluster.placed(c.layout)
    links = tuple(None if owner[k] == owner[k + 1] else cl.link_between(owner[k], owner[k + 1])
                  for k in range(len(owner) - 1))
    return PipeSpec(num_stages=len(owner), microbatches=c.m, activation=activation,
                    speed=tuple(stage_speeds(cl, owner)),
                    memory=tuple(cl.device(r).memory_bytes / share for r in owner),
                    inflight=inflight(c.schedule, pp, c.m, v) if walk else (c.m,) * len(owner), links=links)


class _Splits:
    """The DP's splits of one search, memoised per (unit arrays, PipeSpec): configurations that differ only in the
    schedule's name often pose the same DP (ZBV and DualPipeV; GPipe and 1F1B when memory does not bind), and the
    branch and bound poses again the DPs the short-list solved. Its reachability checks are memoised alike."""

    def __init__(self) -> None:
        self.found: dict[tuple[ArraysKey, PipeSpec], Bounds | None] = {}
        self.memos: dict[ArraysKey, DpMemo] = {}
        self.reach: dict[tuple[ArraysKey, PipeSpec], bool] = {}

    def feasible(self, a: UnitArrays, key: ArraysKey, spec: PipeSpec) -> bool:
        if (key, spec) not in self.reach:
            self.reach[key, spec] = feasible(a, spec)
        return self.reach[key, spec]

    def bounds(self, a: UnitArrays, key: ArraysKey, spec: PipeSpec) -> Bounds | None:
        if (key, spec) not in self.found:
            self.found[key, spec] = pipeline_bounds(a, spec, self.memos.setdefault(key, DpMemo()))
        return self.found[key, spec]


def _bounds(a: UnitArrays, req: PlanRequest, c: Config, activation: Activation, splits: _Splits) -> Bounds | None:
    """The DP's split. A reachability check first rules out configurations whose memory no split fits (cheap);
    when the memory-free split already fits with every stage holding all m microbatches, memory does not bind and
    the schedule's order need not be walked."""
    spec, key = pipe_spec(req, c, activation), arrays_key(c.b, c.layout)
    if not splits.feasible(a, key, spec):
        return None
    if not describe(c.schedule).single_stage:
        loose = pipe_spec(req, c, activation, walk=False)
        free = splits.bounds(a, key, replace(loose, memory=(), inflight=()))
        if free is not None and fits(a, loose, free):
            return free
    return splits.bounds(a, key, spec)


def _loose(a: UnitArrays, req: PlanRequest, c: Config, activation: Activation, splits: _Splits) -> Bounds | None:
    """The DP's split without memory budgets, for a configuration whose budgeted DP found none under its last
    allowed policy: the budgets give each of a rank's v stages 1/v of its memory, each at its own peak in flight
    (`pipe_spec`), so they refuse splits whose rank, walked exactly (`_fitted`), fits (`recompute` none said "no
    split fits" where `recompute` auto planned every stage keeping: Llama 3 405B on 8,192 GPUs, 2026-12-06)."""
    loose = pipe_spec(req, c, activation, walk=False)
    return splits.bounds(a, arrays_key(c.b, c.layout), replace(loose, memory=(), inflight=()))


def links_hold_messages(cluster: Cluster) -> bool:
    """Whether any pipeline link holds messages while their sender computes (`Link.progress_s`; `link` also joins
    ranks whose devices are not adjacent in a cluster file; the links of its nodes). The closed-form estimate leaves
    these delays out, and they slow schedules with many cross-rank messages most, so the short-list is then twice as
    long."""
    return any(link.progress_s > 0 for link in cluster.pipeline_links)


def _estimate(a: UnitArrays, req: PlanRequest, c: Config, bounds: Bounds,
              activations: tuple[Activation, ...]) -> float:
    """The schedule descriptor's closed form for the split under each stage's policy, plus stage 0's last scatter on
    its rank's reduce-scatter stream (`StageCost.scatter_s`: ZeRO 2 under FSDP2's streams) and the step's end."""
    owner = stage_to_rank(c.schedule, c.layout.pp, c.layout.v)
    cluster = req.cluster.placed(c.layout)
    speeds = stage_speeds(cluster, owner)
    costs = stage_costs(a, bounds, speeds, message_overheads(cluster, owner), cluster.host_bandwidth)
    redo = [policy(p).redo_s(x) for x, p in zip(costs, activations)]
    d = describe(c.schedule)
    split = d.splits_backward  # else each backward is one full B: pass it as I, with W = 0
    backward = [(x.backward_input_s, x.backward_weight_s) if split or x.backward_s is None else (x.backward_s, 0.0)
                for x in costs]
    assert d.estimate is not None  # configurations are named schedules
    rule = pairing(c.schedule, a.overlap.ep_a2a, c.layout.v)
    hide = [_hidden(x, c, rule) for x in costs] if rule is not None else [0.0] * len(costs)
    est = d.estimate([x.forward_s + x.overhead_s - h for x, h in zip(costs, hide)],
                         [max(0.0, i - h) + x.overhead_s + r for (i, _), x, r, h in zip(backward, costs, redo, hide)],
                         [w for _, w in backward],
                         owner, comm_times(a, cluster, bounds, owner), c.m)
    tail = costs[0].scatter_s  # stage 0's last backward ends the pipeline; its scatter on the stream then ends it
    return est + tail + sum(step_end_time(a, cluster, bounds, owner, c.layout, speeds, d.mirror(c.m) is not None))


def _hidden(x: StageCost, c: Config, rule: Pairing) -> float:
    """Per microbatch, half of what overlapped pairs hide on a stage (`sim_state.hidden_s`), charged to its F and to
    its I alike, times the share of forwards overlapped: DualPipeV's 2m - 3p + 1 of rank 0's 2m
    (autopp.schedule.named.dual_pipe_v, phases 4 and 5); the combined 1F1B's v m less rank 0's warm-up forwards on
    autopp's interleaved order, (v - 1) p + 2 (p - 1) (Megatron-LM's count without the overlap's one more), of its
    v m, for every rank (the last rank pairs fewer: an estimate, for ranking)."""
    p, v, m = c.layout.pp, c.layout.v, c.m
    share = max(0, 2 * m - 3 * p + 1) / (2 * m) if rule is Pairing.STAGES \
        else max(0, v * m - (v - 1) * p - 2 * (p - 1)) / (v * m)
    return min(x.forward_s, hidden_s(x, x) / 2) * share


@dataclass(frozen=True)
class _Option:
    estimate: float
    index: int
    config: Config
    candidate: Candidate
    """The DP's split, with the activation policies that fit."""


def _options(views: Views, cfgs: list[Config],
             refuse: Callable[[Config, Bounds], str | None] = lambda c, b: None,
             splits: _Splits | None = None) -> list[_Option]:
    """The short-list: the `shortlist` configurations of least estimate among those whose split fits in memory
    (checked by walking the schedule's order, exact peaks, recomputation switched on per stage under "auto"), best
    first (`_GROUPS_FACTOR` times as many when several tensor-parallel degrees or ZeRO stages are searched). A
    plain split's estimate counts the stages its memory walk made recompute under "auto" (its estimate without them,
    a lower bound, first rules out what cannot enter the short-list without walking its memory). Configurations are
    visited lazily in order of a lower bound of their estimate (bounds.py) until the bound reaches the short-list's
    worst estimate: nothing left could enter it. With --recompute auto a configuration whose plain split does not
    fit the DP re-enters the queue under its all-recompute bound. A configuration whose split the runner would
    refuse (`refuse` says why) is left out. `splits` memoises the DP's splits (shared with the branch and bound)."""
    req = views.req
    groups = len({(c.layout.cp, c.layout.tp, c.layout.zero) for c in cfgs})
    keep = req.shortlist * (2 if links_hold_messages(req.cluster) else 1) * (_GROUPS_FACTOR if groups > 1 else 1)
    splits = splits or _Splits()
    arrays = lambda c: views.arrays(c.b, c.layout)  # noqa: E731
    # each configuration's all-stages policies for the DP, least memory saved first; the next when one does not fit
    # (none: the unit arrays of its tensor-parallel degree lack the figures of every allowed policy)
    ladders = [views.request(c.layout).offered(arrays(c)) for c in cfgs]
    queue = [(lower_bound(arrays(c), views.request(c.layout), c, ladders[idx][0]), idx, 0)
             for idx, c in enumerate(cfgs) if ladders[idx]]
    heapq.heapify(queue)
    short: list[tuple[float, int, _Option]] = []  # (-estimate, -index, option): the worst on top
    visited, shown = set(), time.monotonic()
    while queue:
        bound, idx, mode = heapq.heappop(queue)
        visited.add(idx)
        if time.monotonic() - shown >= 1.0:  # no time left said: the walk ends when no bound can enter
            shown = time.monotonic()
            _progress.info(share_line(len(visited) / len(cfgs), None, f"short-listing: {len(visited)} of at most "
                                      f"{len(cfgs)} configurations walked in order of their bounds"))
        if len(short) >= keep and bound >= -short[0][0]:
            break
        c, modes = cfgs[idx], ladders[idx]
        rc = modes[mode]
        a, view = arrays(c), views.request(c.layout)
        bounds = _bounds(a, view, c, rc, splits)
        if bounds is None and mode + 1 < len(modes):  # AUTO: save more memory only when the plain split does not fit
            heapq.heappush(queue, (max(bound, lower_bound(a, view, c, modes[mode + 1])), idx, mode + 1))
            continue
        bounds = bounds or _loose(a, view, c, rc, splits)  # the last policy: the split's check is conservative
        if bounds is None:
            continue
        why = refuse(c, bounds)
        if why is not None:
            log.info("%s: %s", _named(c), why)
            continue
        est = _estimate(a, view, c, bounds, (rc,) * len(bounds))
        if len(short) >= keep and (est, idx) >= (-short[0][0], -short[0][1]):
            continue  # cannot enter the short-list: its memory need not be walked
        cand = _fitted(a, view, c.candidate(bounds, (rc,) * len(bounds)))
        if cand is None:
            log.info("%s: estimate %.6g s, does not fit", _named(c), est)
            continue
        if cand.activations != (rc,) * len(bounds):  # the stages the memory walk made save more count (they only
            # add time: the bound holds)
            est = _estimate(a, view, c, bounds, cand.activations)
            if len(short) >= keep and (est, idx) >= (-short[0][0], -short[0][1]):
                continue
        heapq.heappush(short, (-est, -idx, _Option(est, idx, c, cand)))
        if len(short) > keep:
            heapq.heappop(short)
    return [o for _, _, o in sorted(short, key=lambda x: (-x[0], -x[1]))]


def _fitted(a: UnitArrays, req: PlanRequest, cand: Candidate) -> Candidate | None:
    """`cand` with activation policies that make every rank's peak (walked from the order: the simulator's peaks
    without timing) fit its device, else None: the pinned policies (`recompute_stages`), or with several policies
    allowed (`PlanRequest.ladder`), greedily from the one saving least: while a rank overflows, its stage whose next
    policy up the ladder saves the most kept bytes takes it (a rank's policies change only its own peak, so ranks
    are fixed one by one); refine.py then finds the best choice for the split it keeps."""
    owner = cand.owner
    costs = stage_costs(a, cand.bounds, [1.0] * len(owner))
    order = named_order(cand.schedule, cand.layout.pp, cand.microbatches, cand.layout.v)
    pinned = req.pinned_activations(len(owner))
    if pinned is not None and any(s >= len(owner) for s in req.recompute_stages or ()):
        return None  # a stage index this configuration does not have
    ladder = req.ladder(a)
    auto = pinned is None and len(ladder) > 1
    chosen = list(pinned if pinned is not None else (ladder[0],) * len(owner) if auto else cand.activations)

    def saved(s: int) -> tuple[int, int]:
        up = ladder[ladder.index(chosen[s]) + 1]
        return policy(chosen[s]).kept(costs[s]) - policy(up).kept(costs[s]), -s

    for r in sorted(order):
        acts = [x for x in order[r] if x is not None and x.kind in COMPUTE_KINDS]
        static = rank_static_bytes(costs, owner, r, cand.mirror is not None)
        walk = RankWalk(acts)
        while walk.peak(costs, chosen, static) > req.cluster.device(r).memory_bytes:
            choices = [s for s in sorted({x.stage for x in acts}) if chosen[s] in ladder[:-1]]
            if not auto or not choices:
                return None
            s = max(choices, key=saved)
            chosen[s] = ladder[ladder.index(chosen[s]) + 1]
    return replace(cand, activations=tuple(chosen))


def _named(c: Config) -> str:
    """A configuration in log lines."""
    return f"{c.schedule.value} {c.layout.describe()} {c.layout.zero} v={c.layout.v} m={c.m}"


def search(profile: Profile, req: PlanRequest, table: ProfileTable | None = None,
           excluded: dict[str, str] | None = None, views: Views | None = None,
           tied: list[Verdict] | None = None, proofs: list[Proof] | None = None) -> tuple[Verdict | None, int, int]:
    """The best fitting verdict (or None), the number of configurations and the number simulated. Schedules left
    out because the runner would refuse them for this model go into `excluded` (name -> why). `views` (of `req`)
    shares unit arrays with the caller. The fitting verdicts whose steps lie within the fastest's band (band.py)
    besides the one kept go into `tied`; with `req.ties` the kept one is chosen among them by the tie rule. How the
    branch and bound beyond the short-list ended (prove.py) goes into `proofs`."""
    views = views or Views(profile, req, table)

    def refuse(c: Config, bounds: Bounds, quiet: bool = False) -> str | None:
        why = schedule_refusal(profile.meta.live_values, c.schedule, bounds)
        key = c.schedule.value
        if why is None:
            why = mirror_refusal(profile.meta.tied_parameters, c.schedule, c.layout, bounds)
        if why is None and not req.tied_across_stages:
            why, key = parallel_refusal(profile.meta.tied_parameters, c.layout, bounds), PARALLEL_KEY
        if why is not None and excluded is not None and not quiet:
            excluded.setdefault(key, why)
        return why

    # searched ep divides the routed experts per layer (1 for a dense profile: only ep 1 is searched)
    cfgs = configs(req, profile.num_units, views.degrees(), int((profile.meta.extra.get("moe") or {}).get(
        "num_experts") or 1)) if req.schedule is not ScheduleName.SEQ_1F1B else []  # seqpipe.py plans it
    splits = _Splits()  # the short-list's DPs, posed again by the branch and bound
    _progress.info("short-listing %d configurations: the DP's split of each, its lower bound", len(cfgs))
    opts = _options(views, cfgs, refuse, splits)
    fitting: list[Verdict] = []
    known: dict[int, Verdict | None] = {}
    for opt in opts:
        c = opt.config
        verdict = judge(views.arrays(c.b, c.layout), views.request(c.layout).cluster, opt.candidate)
        log.info("%s: estimate %.6g s, simulated %.6g s%s", _named(c), opt.estimate, verdict.step_s,
                 "" if verdict.fits else " (too big)")
        known[opt.index] = verdict if verdict.fits else None
        if verdict.fits:
            fitting.append(verdict)
    runs = lambda c: lambda b: schedule_refusal(profile.meta.live_values, c.schedule, b) is None and \
        mirror_refusal(profile.meta.tied_parameters, c.schedule, c.layout, b) is None  # noqa: E731
    if fitting and req.judge_budget > 0:  # every configuration whose bound is below the best step, refined
        found, proof = _bounded(views, cfgs, known, min(v.step_s for v in fitting),
                                lambda c, b: refuse(c, b, quiet=True), runs, splits, not has_spread(profile))
        left = [v for idx, v in known.items() if v is not None and idx not in found]  # bounds at the best or above
        fitting = list(found.values()) + (left if proof.exact else refined(profile.num_units, views, left, runs))
        if proofs is not None:
            proofs.append(proof)
    else:
        fitting = refined(profile.num_units, views, fitting, runs)
    if not fitting:
        return None, len(cfgs), len(opts)
    _progress.info("the step band of the fastest of %d fitting configurations", len(fitting))
    fastest = min(fitting, key=lambda v: v.key)
    best, inside = choose(fitting, band(profile, req, fastest).high_s, req.ties)
    if tied is not None:
        tied.extend(sorted(inside, key=lambda v: v.key))
    return best, len(cfgs), len(opts)


def _bounded(views: Views, cfgs: list[Config], known: dict[int, Verdict | None], best_s: float,
             refuse: Callable[[Config, Bounds], str | None],
             runs: Callable[[Candidate], Callable[[Bounds], bool]],
             splits: _Splits | None = None, strict: bool = False) -> tuple[dict[int, Verdict], Proof]:
    """By configuration index, the fitting verdicts of the configurations whose lower bound of the simulated step,
    under any activation policies (the least saving policy's: every other redoes more), is below the best step
    found, judged in order of that bound (prove.py), with How it ended. Each is the DP's split under the first policy
    of its ladder whose DP finds one in memory, its memory walked as the short-list's (the short-list's verdicts,
    `known`, as they are), then refined (refine.py) against the best step found. `splits`: the short-list's DPs.
    `strict` (no verdict above the best step can matter: the profile has no spread, so the band is the fastest
    step): a configuration the refinement would not search further whose DP split's floor is above the best step
    found is left unjudged, as it cannot beat it (`refining.beyond`)."""
    splits = splits or _Splits()

    def attempt(idx: int, best: float) -> Verdict | None:
        c = cfgs[idx]
        if idx in known:
            v = known[idx]
            return None if v is None else refine_one(views, v, runs(v.candidate), best)
        a, view = views.arrays(c.b, c.layout), views.request(c.layout)
        for rc in view.offered(a):
            bounds = _bounds(a, view, c, rc, splits)
            if bounds is None:
                continue
            cand = None if refuse(c, bounds) is not None else _fitted(a, view, c.candidate(bounds, (rc,) * len(bounds)))
            if cand is not None and strict and beyond(a, view, cand, best):
                log.info("%s: bounded, its split's floor is above the best step %.6g s", _named(c), best)
                return None
            verdict = None if cand is None else judge(a, view.cluster, cand)
            if verdict is not None and verdict.fits:  # its split and policies again, judged by the simulator
                verdict = refine_one(views, verdict, runs(verdict.candidate), best)
            log.info("%s: bounded, %s", _named(c), "does not fit" if verdict is None or not verdict.fits
                     else f"simulated {verdict.step_s:.6g} s")
            return verdict
        return None

    bounds = []
    for idx, c in enumerate(cfgs):
        a, view = views.arrays(c.b, c.layout), views.request(c.layout)
        ladder = view.offered(a)
        if ladder:  # keeping redoes nothing: its bound is the least (bounds grow with redo)
            least = (Activation.KEEP,) if Activation.KEEP in ladder else ladder
            bounds.append((min(lower_bound(a, view, c, p, simulated=True) for p in least), idx))
    return prove(bounds, attempt, best_s, views.req.judge_budget)


#: The short-list is this many times longer when several (tensor-parallel degree, ZeRO stage) pairs are searched:
#: the estimate's error differs between them (collectives on the critical path, recomputation), and on Llama 3.1
#: 405B over 512 H100s (docs/published.md) a list of 4 missed the configuration a list of 12 or 64 finds.
_GROUPS_FACTOR = 3
