"""The judge: a fully specified candidate (schedule, layout, microbatches, split, activation policies) → simulated
figures."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ...data.cluster import Cluster
from ...costmodel import (UnitArrays, comm_times, message_overheads, progress_delays, stage_costs, stage_speeds,
                         step_end_time)
from ...costmodel.vocab import VocabPasses, with_vocab_passes
from ...data.layout import Layout
from ...schedule import (Action, Activation, ScheduleName, StageCost, build_schedule, describe, pairing, policy,
                         resumed_s, simulate, stage_to_rank)
from ...schedule.seqpipe import ChunkCosts, simulate_units
from ..partition.dp import Bounds

__all__ = ["Candidate", "Verdict", "step_time", "named_order", "judge"]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """Everything that fixes one training step's layout."""

    schedule: ScheduleName
    layout: Layout
    """Every parallel degree and the ZeRO stage; pp and dp count groups of cp x tp devices (`PlanRequest.view`)."""
    microbatches: int
    """Microbatches per replica per step."""
    microbatch_size: int
    bounds: Bounds
    activations: tuple[Activation, ...]
    """Each stage's activation policy."""
    seq: ChunkCosts | None = None
    """Sequence pipelining (Seq1F1B, `autopp.schedule.seqpipe`): each microbatch's chunks with their shares of its
    time and kept bytes; None: microbatches run whole."""

    @property
    def owner(self) -> list[int]:
        return stage_to_rank(self.schedule, self.layout.pp, self.layout.v)

    @property
    def mirror(self) -> int | None:
        """The first microbatch of the up pipeline (Chimera, `Descriptor.mirror`); None for other schedules."""
        return describe(self.schedule).mirror(self.microbatches)

    @property
    def recomputing(self) -> int:
        """Stages whose policy redoes the forward, or part of it (selective recomputation)."""
        return sum(policy(a).redoes_forward for a in self.activations)


def step_time(pipeline_s: float, allreduce_s: float, optimizer_s: float) -> float:
    """A step: the pipeline, then what it adds after the pipeline drains (`costmodel.step_end_time`'s terms)."""
    return pipeline_s + allreduce_s + optimizer_s


@dataclass(frozen=True)
class Verdict:
    """The simulator's figures for a candidate (step time includes the data-parallel gradient all-reduce)."""

    candidate: Candidate
    step_s: float
    pipeline_s: float
    allreduce_s: float
    peak_memory: tuple[int, ...]
    """Per pipeline rank."""
    bubble: float
    """Mean over pipeline ranks of the simulator's idle fraction."""
    fits: bool
    costs: tuple[StageCost, ...]
    optimizer_s: float = 0.0
    """The slowest pipeline rank's optimizer step (included in step_s)."""
    passes: VocabPasses | None = None
    """Vocabulary parallelism's passes on every rank (None: the plain split); `costs` include them."""
    resumed_s: tuple[float, ...] = ()
    """Per stage, the resume time the simulated step charged its actions that started after a wait
    (`schedule.resumed_s`; () or zeros without a resume cost): part of its ranks' busy time."""
    overlapped_s: tuple[float, ...] = ()
    """Per stage, the communication its actions hid in overlapped F + B pairs (`SimResult.overlapped_s`)."""
    scatter_tail_s: tuple[float, ...] = ()
    """Per pipeline rank, how long its reduce-scatter stream ran past its last action (`SimResult.scatter_tail_s`;
    () without ZeRO 2's first-unit scatters on the stream): part of `pipeline_s`."""

    @property
    def key(self) -> tuple[float, int]:
        """Order of preference: faster, then less memory."""
        return (self.step_s, max(self.peak_memory))


@lru_cache(maxsize=12)
def named_order(name: ScheduleName, pp: int, m: int, v: int) -> dict[int, list[Action]]:
    """build_schedule, memoised: the recompute pass and the simulator of one candidate (and the baselines, which
    share its layout) read the same order, and a large one costs seconds to build. Callers must not mutate it."""
    return build_schedule(name, pp, m, v)


def judge(a: UnitArrays, cluster: Cluster, c: Candidate, passes: VocabPasses | None = None) -> Verdict:
    """Simulate the candidate's named schedule and add what the step does after the pipeline drains (the gradient
    all-reduce, the optimizer step), on the links its pp x dp layout crosses (`Cluster.placed`); a sequence-chunked
    candidate (`Candidate.seq`) as its units (`seqpipe.simulate_units`). With `passes`
    (vocabulary parallelism; `a` then the body's arrays, `costmodel.vocab.body_arrays`), every rank also runs them."""
    cluster = cluster.placed(c.layout)
    owner = c.owner
    speeds = stage_speeds(cluster, owner)
    costs = stage_costs(a, c.bounds, speeds, message_overheads(cluster, owner), cluster.host_bandwidth)
    if passes is not None:
        costs = with_vocab_passes(costs, owner, passes)
    comm, delays = comm_times(a, cluster, c.bounds, owner), progress_delays(cluster, owner)
    if c.seq is not None:  # units of a sequence's chunks, every stage keeping its activations (`seqpipe`)
        sim = simulate_units(costs, comm, c.microbatches, c.seq, delays)
    else:
        order = named_order(c.schedule, c.layout.pp, c.microbatches, c.layout.v)
        sim = simulate(order, costs, owner, comm, c.activations, delays,
                       pairing(c.schedule, a.overlap.ep_a2a, c.layout.v), c.mirror)
    ar, opt = step_end_time(a, cluster, c.bounds, owner, c.layout, speeds, c.mirror is not None)
    peaks = tuple(int(x) for x in sim.peak_memory_bytes)
    fits = all(p <= cluster.device(r).memory_bytes for r, p in enumerate(peaks))
    return Verdict(c, step_time(sim.step_time_s, ar, opt), sim.step_time_s, ar, peaks,
                   sum(sim.bubble_fraction) / len(sim.bubble_fraction), fits, tuple(costs), opt, passes,
                   resumed_s(sim, costs), sim.overlapped_s, sim.scatter_tail_s)
