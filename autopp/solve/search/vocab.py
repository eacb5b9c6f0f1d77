"""Whether to split the vocabulary layers over the pipeline ranks (Yeung et al., MLSys 2025), and with which variant:
the best split without it against the best split of the body with the passes on every rank, each simulated
(`judge`), the faster layout that fits chosen (ties: without). `vocab_verdicts` judges every configuration of a
request that the runner runs with it (`make_plan` compares them with the plain search's best); `choose_vocab`
decides for one pp, schedule and microbatch count."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ...costmodel import UnitArrays
from ...costmodel.vocab import VocabVariant, body_arrays, vocab_link, vocab_passes
from ...data.cluster import Cluster
from ...data.layout import Layout
from ...data.profile import Profile
from ...data.vocab import vocab_refusal, vocab_tied
from ...errors import InfeasibleError, PlanError
from ...schedule import Activation, Kind, ScheduleName, describe
from ..partition.dp import Bounds, PipeSpec, pipeline_bounds
from .judge import Candidate, Verdict, judge, named_order
from .request import Config, PlanRequest, configs
from .runnable import schedule_refusal
from .search import pipe_spec
from .views import Views

__all__ = ["VocabOption", "VocabChoice", "body_bounds", "choose_vocab", "vocab_runs", "vocab_verdicts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VocabOption:
    """One layout judged: `variant` None is the plain split, the head and embedding in its first and last stages."""

    variant: VocabVariant | None
    verdict: Verdict


@dataclass(frozen=True)
class VocabChoice:
    """Every option judged, and the chosen one."""

    options: tuple[VocabOption, ...]
    chosen: VocabOption

    @property
    def without(self) -> VocabOption:
        return self.options[0]

    @property
    def gain(self) -> float:
        """Predicted speed-up of the chosen layout over the plain split (step time ratio - 1; 0 when not chosen)."""
        return self.without.verdict.step_s / self.chosen.verdict.step_s - 1.0


def body_bounds(body: UnitArrays, spec: PipeSpec) -> Bounds | None:
    """The DP's split of the body (`body_arrays`) with every stage holding some of it: no cut right after the
    embedding or right before the head, whose work moved to the passes. Without this rule the DP may leave a
    stage only the (free) embedding or head, which the runner cannot cut off (the body has nothing before its
    first block: tests/models/tiedlm.py, pp 2, one microbatch)."""
    return pipeline_bounds(body, replace(spec, uncut=(1, body.n - 1)))


def _option(a: UnitArrays, cluster: Cluster, c: Candidate, variant: VocabVariant | None,
            tied: bool) -> VocabOption | None:
    spec = PipeSpec(num_stages=c.layout.pp, microbatches=c.microbatches)
    arrays = a if variant is None else body_arrays(a)
    bounds = pipeline_bounds(arrays, spec) if variant is None else body_bounds(arrays, spec)
    if bounds is None:
        return None
    cand = Candidate(schedule=c.schedule, layout=c.layout, microbatches=c.microbatches,
                     microbatch_size=c.microbatch_size, bounds=bounds, activations=c.activations)
    link = vocab_link(cluster.placed(c.layout), c.layout.pp, float(a.cut[a.n - 1]))
    passes = None if variant is None else vocab_passes(a, c.layout.pp, link, variant, tied,
                                                      microbatches=c.microbatches)
    return VocabOption(variant, judge(arrays, cluster, cand, passes))


def choose_vocab(a: UnitArrays, cluster: Cluster, pp: int, microbatches: int, microbatch_size: int,
                 schedule: ScheduleName = ScheduleName.ONE_F_ONE_B, tied: bool = False) -> VocabChoice:
    """Judge the plain split and each variant of vocabulary parallelism for `pp` ranks running `schedule` (one stage
    per rank); the fastest option that fits every device's memory is chosen (without, unless a variant is faster).
    `tied`: the head is the embedding's tensor (`vocab_passes`)."""
    if pp < 2 or a.n < pp + 2:
        raise PlanError(f"vocabulary parallelism needs `pp` >= 2 and an embedding, a body of `pp` units or more "
                        f"and a head (pp {pp}, {a.n} units)")
    base = Candidate(schedule=schedule, layout=Layout(pp=pp), microbatches=microbatches,
                     microbatch_size=microbatch_size, bounds=(), activations=(Activation.KEEP,) * pp)
    options = [o for v in (None, *VocabVariant) if (o := _option(a, cluster, base, v, tied)) is not None]
    if not options or options[0].variant is not None:
        raise PlanError(f"no split of {a.n} units into {pp} stages")
    fitting = [o for o in options if o.verdict.fits] or options[:1]
    chosen = min(fitting, key=lambda o: (o.verdict.step_s, o.variant is not None))
    return VocabChoice(tuple(options), chosen)


def vocab_runs(c: Config) -> bool:
    """Whether autopp.run.vocab runs configuration `c`: two or more pipeline ranks and no other axis (its passes
    use the pipeline ranks' own group), a named schedule whose F and B do not overlap (the passes run inside them)
    and whose every stage runs its backwards (B or I) in microbatch order, as the output passes run (a looped
    breadth-first order runs them from the last microbatch: checked, its ranks stop "out of order")."""
    d, layout = describe(c.schedule), c.layout
    if layout.pp < 2 or layout.world != layout.pp or d.given_order or d.overlaps_f_b:
        return False
    last: dict[int, int] = {}
    for row in named_order(c.schedule, layout.pp, c.m, layout.v).values():
        for a in (a for a in row if a is not None and a.kind in (Kind.B, Kind.I)):
            if a.microbatch < last.get(a.stage, -1):
                return False
            last[a.stage] = a.microbatch
    return True


def vocab_verdicts(profile: Profile, req: PlanRequest, views: Views) -> list[Verdict]:
    """The fitting verdicts of vocabulary parallelism, one per configuration the runner runs it with (`vocab_runs`)
    and variant the request allows (`PlanRequest.vocab`; none with a `trainer`): the body split by the exact DP
    (every stage keeping its activations, its budget less what the passes hold), judged with the passes. A
    PlanError (one line) when a variant is pinned and the profile's model cannot run it (`vocab_refusal`), an
    InfeasibleError when a pinned one fits no configuration."""
    variants = [v for v in req.vocab if v is not None] if req.trainer is None else []
    pinned = None not in req.vocab
    if not variants:
        return []
    others = [f"{a} {v}" for a in ("dp", "tp", "cp", "ep") if (v := getattr(req.pins, a)) not in (None, 1)]
    why = vocab_refusal(profile.meta.extra) if req.cluster.homogeneous else \
        "vocabulary parallelism needs identical devices"
    if why is None and others:  # a tester: pinned pp x dp x tp was refused, its pins checked on the groups' view
        why = f"vocabulary parallelism runs with pipeline parallelism alone, and the request pins {', '.join(others)}"
    if why is not None:
        if pinned:
            raise PlanError(f"`vocab` {'/'.join(v.value for v in variants)}: {why}")
        log.info("vocabulary parallelism not searched: %s", why)
        return []
    out = []
    for c in (c for c in configs(req, profile.num_units) if vocab_runs(c)):
        a, view = views.arrays(c.b, c.layout), views.request(c.layout)
        link = vocab_link(view.cluster.placed(c.layout), c.layout.pp, float(a.cut[a.n - 1]))
        body = body_arrays(a)
        for variant in variants:
            passes = vocab_passes(a, c.layout.pp, link, variant, vocab_tied(profile.meta.extra), microbatches=c.m)
            spec = pipe_spec(view, c, Activation.KEEP)
            room = [passes.static_bytes + passes.transient_bytes + (passes.fed_bytes if s == 0 else 0)
                    for s in range(len(spec.memory))]
            bounds = body_bounds(body, replace(spec, memory=tuple(max(0.0, m - r) for m, r in zip(spec.memory, room))))
            if bounds is None or schedule_refusal(profile.meta.live_values, c.schedule, bounds) is not None:
                continue
            verdict = judge(body, view.cluster, c.candidate(bounds, (Activation.KEEP,) * len(bounds)), passes)
            if verdict.fits:
                out.append(verdict)
    if pinned and not out:
        raise InfeasibleError(f"`vocab` {'/'.join(v.value for v in variants)}: no configuration the runner runs with "
                              f"vocabulary parallelism (pp >= 2 and no other axis) fits on {req.cluster.num_devices} "
                              "devices")
    return out
