"""Whether to split the vocabulary layers over the pipeline ranks (Yeung et al., MLSys 2025), and with which variant:
the best split without it against the best split of the body with the passes on every rank, each simulated
(`judge`), the faster layout that fits chosen (ties: without)."""

from __future__ import annotations

from dataclasses import dataclass

from ...costmodel import UnitArrays
from ...costmodel.vocab import VocabVariant, body_arrays, vocab_passes
from ...data.cluster import Cluster
from ...data.layout import Layout
from ...errors import PlanError
from ...schedule import Activation, ScheduleName
from ..partition.dp import PipeSpec, pipeline_bounds
from .judge import Candidate, Verdict, judge

__all__ = ["VocabOption", "VocabChoice", "choose_vocab"]


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


def _option(a: UnitArrays, cluster: Cluster, c: Candidate, variant: VocabVariant | None) -> VocabOption | None:
    arrays = a if variant is None else body_arrays(a)
    bounds = pipeline_bounds(arrays, PipeSpec(num_stages=c.layout.pp, microbatches=c.microbatches))
    if bounds is None:
        return None
    cand = Candidate(schedule=c.schedule, layout=c.layout, microbatches=c.microbatches,
                     microbatch_size=c.microbatch_size, bounds=bounds, activations=c.activations)
    link = cluster.placed(c.layout).link_between(0, 1)
    passes = None if variant is None else vocab_passes(a, c.layout.pp, link, variant)
    return VocabOption(variant, judge(arrays, cluster, cand, passes))


def choose_vocab(a: UnitArrays, cluster: Cluster, pp: int, microbatches: int, microbatch_size: int,
                 schedule: ScheduleName = ScheduleName.ONE_F_ONE_B) -> VocabChoice:
    """Judge the plain split and each variant of vocabulary parallelism for `pp` ranks running `schedule` (one stage
    per rank); the fastest option that fits every device's memory is chosen (without, unless a variant is faster)."""
    if pp < 2 or a.n < 3:
        raise PlanError(f"vocabulary parallelism needs `pp` >= 2 and an embedding, a body and a head "
                        f"(pp {pp}, {a.n} units)")
    base = Candidate(schedule=schedule, layout=Layout(pp=pp), microbatches=microbatches,
                     microbatch_size=microbatch_size, bounds=(), activations=(Activation.KEEP,) * pp)
    options = [o for v in (None, *VocabVariant) if (o := _option(a, cluster, base, v)) is not None]
    if not options or options[0].variant is not None:
        raise PlanError(f"no split of {a.n} units into {pp} stages")
    fitting = [o for o in options if o.verdict.fits] or options[:1]
    chosen = min(fitting, key=lambda o: (o.verdict.step_s, o.variant is not None))
    return VocabChoice(tuple(options), chosen)
