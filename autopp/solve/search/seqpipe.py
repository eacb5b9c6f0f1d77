"""Sequence pipelining in the search: Seq1F1B configurations, one per chunk count, cut by the DP and judged by the
simulator as units (`autopp.schedule.seqpipe`; Seq1F1B, Sun et al., NAACL 2025; TeraPipe, Li et al., ICML 2021).

Offered (`seq_offered`) for causal LMs whose profile records the attention's shape (HF configs:
`meta.extra["hf_config"]["attention"]` with `causal`), where the attention's share of the time
(`causal_share`: its FLOPs, weighted by its efficiency on an analytic profile) sets the chunks' equal-cost
boundaries; with the schedule searched (or pinned to it), no trainer (none ships it),
the plain vocabulary split, and every stage keeping its activations (the chunk costs are those of keep). Only
pipeline and data parallelism with whole replicas (tp, cp, ep 1, ZeRO 0) are searched, the layouts the runner runs
it on (`autopp.run.seq_chunks.check_seq_plan`), as Chimera's are (`request.configs`): context parallelism already
splits each sequence, and no trainer runs the others beside it.

1. Configurations: those of the request under Seq1F1B (one stage per rank, any microbatch count), each with each
   chunk count of `CHUNK_COUNTS` (1 chunk is 1F1B itself, searched among the named schedules).
2. Visited in order of a lower bound valid for every split: the busiest rank runs its stage's whole work for every
   microbatch (m x W / sum of the speeds), plus the step's end (`step_end_floor`); the visit stops when the bound
   reaches the best step found (the named schedules' best included), so chunks are simulated only where they can win.
3. The DP cuts the stages with each stage holding the most of a microbatch's kept bytes its rank's order holds at
   once (each unit its chunk's share), rounded up to whole microbatches (a bound), and where no split fits so,
   rounded down; the simulator's walk with each unit's own bytes (`seqpipe.chunk_peaks`) decides what fits.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from ...costmodel import attention_shape, causal_share, stage_speeds, step_end_floor
from ...data.layout import Layout
from ...data.profile import Profile
from ...errors import InfeasibleError, ProfileError, ScheduleError
from ...schedule import Activation, Kind, ScheduleName
from ...schedule.seqpipe import ChunkCosts, chunk_costs, chunk_lengths, chunked_order, kv_share_of
from ..partition.dp import Bounds, DpMemo, pipeline_bounds
from .judge import Verdict, judge
from .request import Config, Group, PlanRequest, configs
from .runnable import parallel_refusal
from .search import pipe_spec
from .views import Views, arrays_key

__all__ = ["CHUNK_COUNTS", "CHUNK_MULTIPLE", "seq_offered", "seq_chunkings", "seq_verdicts", "with_seq"]

#: The chunk counts searched, as `seqpipe.choose_chunks` tries them (1 is 1F1B).
CHUNK_COUNTS = (2, 4, 8)
#: Chunk boundaries fall on multiples of this many tokens (the tile of FlashAttention's and cuBLAS's GPU kernels; a
#: shorter chunk's lower efficiency is not modelled), so sequences under 256 tokens, or not a multiple of 128, are
#: not chunked.
CHUNK_MULTIPLE = 128


def seq_offered(profile: Profile, req: PlanRequest) -> bool:
    """Whether the search tries sequence pipelining (module docstring); a ProfileError when the request pins it
    for a profile it cannot be planned for."""
    if req.schedule not in (None, ScheduleName.SEQ_1F1B):
        return False
    if causal_share(profile) is None:
        if req.schedule is not None:
            raise ProfileError(f"`schedule` {ScheduleName.SEQ_1F1B.value} splits each sequence of a causal LM by the "
                               f"attention's cost, and the profile of {profile.meta.model_path} records no causal "
                               "attention (profiles of HF causal-lm configs do, but for ones counted before the "
                               "attention record): profile the HF config (again), or search `schedule`")
        return False
    if not seq_chunkings(profile):
        if req.schedule is not None:
            shape = attention_shape(profile)
            raise ProfileError(f"`schedule` {ScheduleName.SEQ_1F1B.value} cuts sequences into 2 or more chunks on "
                               f"multiples of {CHUNK_MULTIPLE} tokens, and the profile's are "
                               f"{shape.seq_len if shape else 0}: plan with `seq_len` a multiple of "
                               f"{CHUNK_MULTIPLE} from {2 * CHUNK_MULTIPLE}, or search `schedule`")
        return False
    keeps = Activation.KEEP in req.allowed() and req.recompute_stages is None
    return keeps and req.trainer is None and None in req.vocab


def seq_chunkings(profile: Profile) -> list[ChunkCosts]:
    """Each chunk count's chunks of the profile's sequence, boundaries at equal cost on multiples of
    `CHUNK_MULTIPLE` tokens (`seqpipe.chunk_lengths`); counts the sequence cannot take are left out."""
    shape, share = attention_shape(profile), causal_share(profile)
    assert shape is not None and share is not None  # seq_offered
    kv = kv_share_of(shape.heads, shape.kv_heads)
    out = []
    for k in CHUNK_COUNTS:
        try:
            lengths = chunk_lengths(shape.seq_len, k, min(share, 0.999), CHUNK_MULTIPLE)
            out.append(chunk_costs(lengths, min(share, 0.999), kv))
        except ScheduleError:  # fewer tokens than k chunks of CHUNK_MULTIPLE, or not a multiple of it
            continue
    return out


def _inflight(pp: int, m: int, seq: ChunkCosts) -> list[tuple[int, ...]]:
    """Per stage, microbatches of kept bytes at its Seq1F1B peak (module docstring, 3): the walk of its order with
    each unit's share, rounded up (a bound), then down where that differs (the simulator's walk decides)."""
    k, held = len(seq.lengths), []
    for r, order in sorted(chunked_order(pp, m, k).items()):
        now = peak = 0.0
        for a in order:
            now += seq.memory[a.microbatch % k] * (1 if a.kind is Kind.F else -1)
            peak = max(peak, now)
        held.append(peak)
    up = tuple(min(m, math.ceil(h - 1e-9)) for h in held)
    down = tuple(max(1, min(m, math.floor(h + 1e-9))) for h in held)
    return [up] if up == down else [up, down]


def _runs(layout: Layout) -> bool:
    """Whether the runner runs sequence chunks on `layout`: pipeline and data parallelism, whole replicas."""
    return layout.tp == layout.cp == layout.ep == 1 and layout.zero.replicated


def _floor(views: Views, c: Config) -> float:
    """A lower bound of the configuration's simulated step for every split (module docstring, 2)."""
    a, view = views.arrays(c.b, c.layout), views.request(c.layout)
    speeds = stage_speeds(view.cluster, range(c.layout.pp))
    return c.m * float(a.work().sum()) / sum(speeds) + step_end_floor(a, view.cluster, c.layout)


def seq_verdicts(profile: Profile, views: Views, degrees: tuple[Group, ...], experts: int,
                 refuse: Callable[[Config, Bounds], str | None], best_s: float) -> list[Verdict]:
    """The fitting Seq1F1B verdicts the search should compare (module docstring), each configuration's DP split
    judged once; `best_s`: the fastest step found so far (inf: none)."""
    req = views.req
    base = configs(replace(req, schedule=ScheduleName.SEQ_1F1B), profile.num_units, degrees, experts)
    cfgs = [replace(c, seq=seq) for c in base if _runs(c.layout) for seq in seq_chunkings(profile)]
    memos: dict[object, DpMemo] = {}
    out: list[Verdict] = []
    for floor, _, c in sorted((_floor(views, c), i, c) for i, c in enumerate(cfgs)):
        if floor >= best_s:
            break
        assert c.seq is not None
        a, view = views.arrays(c.b, c.layout), views.request(c.layout)
        for inflight in _inflight(c.layout.pp, c.m, c.seq):
            spec = replace(pipe_spec(view, c, Activation.KEEP), inflight=inflight)
            bounds = pipeline_bounds(a, spec, memos.setdefault(arrays_key(c.b, c.layout), DpMemo()))
            if bounds is None or refuse(c, bounds) is not None:
                continue
            verdict = judge(a, view.cluster, c.candidate(bounds, (Activation.KEEP,) * len(bounds)))
            if verdict.fits:
                out.append(verdict)
                best_s = min(best_s, verdict.step_s)
                break
    return out


def with_seq(profile: Profile, views: Views, best: Verdict | None) -> tuple[Verdict | None, str | None]:
    """`best` (the named schedules' search), or the fastest Seq1F1B verdict where sequence pipelining is offered
    and faster (or where nothing else fits), with a note comparing the two."""
    if not seq_offered(profile, views.req):
        return best, None
    experts = int((profile.meta.extra.get("moe") or {}).get("num_experts") or 1)
    refuse = lambda c, b: parallel_refusal(profile.meta.tied_parameters, c.layout, b)  # noqa: E731
    found = seq_verdicts(profile, views, views.degrees(), experts, refuse, math.inf if best is None else best.step_s)
    if not found and views.req.schedule is ScheduleName.SEQ_1F1B:
        raise InfeasibleError(f"`schedule` {views.req.schedule.value}: in none of {', '.join(map(str, CHUNK_COUNTS))} "
                              "chunks does a configuration of pipeline and data parallelism (`tp`, `cp`, `ep` 1, "
                              "`zero` 0: what the runner runs it with) fit the devices' memory with every stage "
                              "keeping its activations; give more devices or memory, or search `schedule`")
    if not found:
        return best, None
    chosen = min(found, key=lambda v: v.key)
    if views.req.schedule is ScheduleName.SEQ_1F1B:  # pinned: nothing else was searched, so nothing to compare
        return chosen, None
    if best is not None and chosen.key >= best.key:
        return best, None
    than = "nothing else fits" if best is None else \
        f"the best plan without it ({best.candidate.schedule.value}) predicts {best.step_s:.4g} s " \
        f"({best.step_s / chosen.step_s - 1:+.1%} slower) at {max(best.peak_memory) / 2**30:.3g} GiB peak"
    return chosen, f"sequence pipelining chosen: {than}"
