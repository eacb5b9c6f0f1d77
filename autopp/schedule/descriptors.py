"""One descriptor per schedule, in one registry: everything else asks the descriptor, never a family set.

A descriptor holds a schedule's stage → rank layout, its stages-per-rank and microbatch rules (with their error
messages), whether it splits the backward into I and W, its order builder (`named.py`), its closed-form step-time
estimate and lower-bound formula (used only to rank and prune candidates before the simulator judges them), and the
name of the torch class the runner uses. Adding a schedule is one `Descriptor` in `DESCRIPTORS` and its tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from autopp.errors import ScheduleError
from autopp.schedule import named
from autopp.schedule.actions import Action
from autopp.schedule.floors import (Floors, PipeBound, bound_chimera, bound_flush, bound_megatron, bound_single,
                                    bound_zero_bubble, estimate_bound_chimera, estimate_bound_megatron,
                                    estimate_bound_single, estimate_bound_zero_bubble)

__all__ = ["ScheduleName", "StagePlacement", "Pairing", "Floors", "Descriptor", "DESCRIPTORS", "NAMED", "describe",
           "listed", "pairing", "stage_to_rank", "stages_per_rank", "validate", "build_schedule"]


class ScheduleName(Enum):
    """Schedules autopp plans and runs; values are torch's names (and "Custom" for a plan's own order)."""

    GPIPE = "GPipe"
    ONE_F_ONE_B = "1F1B"
    INTERLEAVED_1F1B = "Interleaved1F1B"
    LOOPED_BFS = "LoopedBFS"
    INTERLEAVED_ZERO_BUBBLE = "InterleavedZeroBubble"
    ZBV_ZERO_BUBBLE = "ZBVZeroBubble"
    DUAL_PIPE_V = "DualPipeV"
    CHIMERA = "Chimera"
    """Two pipelines in opposite directions over the same ranks (Li and Hoefler, SC'21); torch ships no class."""
    SEQ_1F1B = "Seq1F1B"
    """1F1B over (microbatch, sequence chunk) units (`autopp.schedule.seqpipe`): torch's CSV schedule runtime runs
    it, `autopp.run.seq_chunks` adds the K/V cache, for model files that declare SEQUENCE_CHUNKS."""
    CUSTOM = "Custom"
    """A per-rank order given in the plan (CP-SAT synthesis), run by torch's CSV schedule runtime."""


class StagePlacement(Enum):
    """How stages map to ranks (not to be confused with `Layout`, the parallel degrees)."""

    LOOP = "loop"
    """Stage s on rank s % p (Megatron interleaving; one stage per rank is the special case v = 1)."""
    V = "v"
    """Zig-zag: chunk c runs ranks 0..p-1 when c is even and p-1..0 when odd (ZB-V, DualPipeV)."""
    BIDIRECTIONAL = "bidirectional"
    """Two replicas of every stage: stage s on rank s for the first half of the microbatches ("down") and on rank
    p - 1 - s for the second half ("up"), Chimera's bidirectional pipelines. `stage_to_rank` gives the down ranks;
    `Descriptor.mirror` says which microbatches go up."""
    GIVEN = "given"
    """The plan lists each stage's rank (custom orders)."""


class Pairing(Enum):
    """Which forward-backward neighbours in a rank's order run as one overlapped pair, each one's communication inside
    its stage (expert parallelism's all-to-alls) under the other's compute (`autopp.schedule.sim_state.pairs`)."""

    STAGES = "stages"
    """A forward, then a full backward of another stage (DualPipeV: torch's OVERLAP_F_B, DeepSeek-V3 s.3.2.1)."""
    MICROBATCHES = "microbatches"
    """A forward, then a full backward of another microbatch: Megatron-Core's combined 1F1B
    (`overlap_moe_expert_parallel_comm`, megatron/core/pipeline_parallel/schedules.py: each steady-state forward
    and backward of the interleaved schedule run as one step, their all-to-alls under each other's compute), on the
    interleaved order as autopp builds it; Megatron runs one more warm-up forward per rank so that no step pairs a
    microbatch's forward with its own backward, autopp's order leaves such neighbours (the last rank's last stage)
    unpaired."""


#: (forward, input backward, weight backward, stage -> rank, transfer after each stage, microbatches) -> seconds.
Estimate = Callable[[Sequence[float], Sequence[float], Sequence[float], Sequence[int], Sequence[float], int], float]
Builder = Callable[[int, int, int, int], list[Action]]


def _rank_times(times: Sequence[float], owner: Sequence[int]) -> list[float]:
    per_rank = [0.0] * (max(owner) + 1)
    for t, r in zip(times, owner):
        per_rank[r] += t
    return per_rank


def _stage_times(forward: Sequence[float], backward_input: Sequence[float],
                 backward_weight: Sequence[float]) -> list[float]:
    return [f + i + w for f, i, w in zip(forward, backward_input, backward_weight)]


def _estimate_gpipe(forward: Sequence[float], backward_input: Sequence[float], backward_weight: Sequence[float],
                    owner: Sequence[int], comm: Sequence[float], m: int) -> float:
    """GPipe: sum T + 2 sum c + (m - 1)(max F + max B): all forwards run before any backward."""
    times = _stage_times(forward, backward_input, backward_weight)
    backward = [i + w for i, w in zip(backward_input, backward_weight)]
    return sum(times) + 2 * sum(comm) + (m - 1) * (max(forward) + max(backward))


def _estimate_1f1b(forward: Sequence[float], backward_input: Sequence[float], backward_weight: Sequence[float],
                   owner: Sequence[int], comm: Sequence[float], m: int) -> float:
    """1F1B (PipeDream-flush, Narayanan et al. 2021; as DAPPLE and Alpa use it): sum T + 2 sum c + (m - 1) max T."""
    times = _stage_times(forward, backward_input, backward_weight)
    return sum(times) + 2 * sum(comm) + (m - 1) * max(times)


def _estimate_megatron(forward: Sequence[float], backward_input: Sequence[float], backward_weight: Sequence[float],
                       owner: Sequence[int], comm: Sequence[float], m: int) -> float:
    """Interleaved 1F1B and looped BFS: (m + (p - 1) / v) max R + 2 sum c (Megatron: the bubble shrinks v times)."""
    times = _stage_times(forward, backward_input, backward_weight)
    p = max(owner) + 1
    v = len(times) / p
    return (m + (p - 1) / v) * max(_rank_times(times, owner)) + 2 * sum(comm)


def _estimate_zero_bubble(forward: Sequence[float], backward_input: Sequence[float],
                          backward_weight: Sequence[float], owner: Sequence[int], comm: Sequence[float],
                          m: int) -> float:
    """Zero bubble (Qi et al. 2023: W fills the bubble): m max R + (p - 1) / v max (F + I - W)^+ + 2 sum c / v."""
    times = _stage_times(forward, backward_input, backward_weight)
    p = max(owner) + 1
    v = len(times) / p
    gap = max(max(0.0, f + i - w) for f, i, w in zip(forward, backward_input, backward_weight))
    return m * max(_rank_times(times, owner)) + (p - 1) / v * gap + 2 * sum(comm) / v


def _estimate_chimera(forward: Sequence[float], backward_input: Sequence[float], backward_weight: Sequence[float],
                      owner: Sequence[int], comm: Sequence[float], m: int) -> float:
    """Chimera (Li and Hoefler, SC'21, section 3.2: p - 2 idle slots per rank against 1F1B's 2(p - 1)): each rank
    runs m / 2 microbatches through each of its two replicas, (m / 2) max_r (T_r + T_(p-1-r)), plus half of 1F1B's
    fill and drain, (p - 2) / 2 max T, plus 2 sum c."""
    times = _stage_times(forward, backward_input, backward_weight)
    p = len(times)
    pair = max(times[r] + times[p - 1 - r] for r in range(p))
    return m / 2 * pair + (p - 2) / 2 * max(times) + 2 * sum(comm)


def _exact_gpipe(p: int, m: int) -> tuple[int, ...]:
    return (m,) * p


def _exact_1f1b(p: int, m: int) -> tuple[int, ...]:
    return tuple(min(p - s, m) for s in range(p))


@dataclass(frozen=True, kw_only=True)
class Descriptor:
    """Everything autopp knows about one schedule."""

    name: ScheduleName
    placement: StagePlacement
    fixed_v: int | None
    """Stages per rank the schedule always runs (1: torch's PipelineScheduleSingle; 2: V shapes); None: the plan's."""
    splits_backward: bool
    """Runs each backward as an input pass I and a weight pass W (False for CUSTOM: its order says)."""
    torch_class: str
    """The class in torch.distributed.pipelining.schedules that runs it ("": none; Chimera runs on autopp's own
    runtime, autopp.run.bidirectional; Seq1F1B on the CSV runtime with autopp.run.seq_chunks' K/V cache)."""
    builder: Builder | None = None
    """Rank r's compute actions for (r, p, m, v); None: the plan gives the order."""
    estimate: Estimate | None = None
    pipe_bound: PipeBound | None = None
    """A lower bound of the simulated pipeline for every split (tests/solve/test_bounds.py checks it): the branch and
    bound over configurations prunes with it (autopp.solve.search.prove)."""
    estimate_bound: PipeBound | None = None
    """A lower bound of the estimate for every split: the short-list prunes with it, as it ranks by the estimate
    (None: `pipe_bound`)."""
    min_microbatches_per_rank: int = 0
    """m must be >= this x p, i.e. at least one per stage (1F1B: 1; DualPipeV, 2 stages per rank: 2)."""
    rounded: bool = False
    """m must be a multiple of rounds = max(1, m // p) (torch's interleaved schedules)."""
    overlaps_f_b: bool = False
    """A forward listed right before a full backward of the other stage on its rank runs with it as one overlapped
    pair, each one's communication inside the stage hidden under the other's compute (torch's OVERLAP_F_B;
    DualPipe, arXiv 2412.19437 s.3.2.1): `autopp.schedule.simulate` times it so."""
    exact_inflight: Callable[[int, int], tuple[int, ...]] | None = None
    """Per stage, microbatches of activations held at its peak, in closed form; None: walk rank 0's order."""
    sequence_chunks: bool = False
    """Splits each microbatch along the sequence into chunks run as units (`autopp.schedule.seqpipe`): `build` gives
    its one-chunk order, `seqpipe.chunked_order` the k-chunk one; its estimate and bound apply to unit costs and
    m x k units. Not in `NAMED`: the search tries it with its chunk counts (`autopp.solve.search.seqpipe`)."""

    @property
    def runnable(self) -> bool:
        """The runner runs it: with a torch class (Seq1F1B: the CSV runtime), or on its own bidirectional runtime
        (Chimera)."""
        return bool(self.torch_class) or self.mirrored

    @property
    def mirrored(self) -> bool:
        """Two replicas of every stage, one per direction (BIDIRECTIONAL: Chimera)."""
        return self.placement is StagePlacement.BIDIRECTIONAL

    def mirror(self, num_microbatches: int) -> int | None:
        """The first microbatch of the up pipeline (BIDIRECTIONAL: the second half of the microbatches runs stage s
        on rank p - 1 - s); None: every microbatch runs on the stage's one rank."""
        return num_microbatches // 2 if self.mirrored else None

    @property
    def single_stage(self) -> bool:
        """One stage per rank (torch's PipelineScheduleSingle)."""
        return self.fixed_v == 1

    @property
    def given_order(self) -> bool:
        """The plan gives the order and each stage's rank (CUSTOM); the schedule has no builder of its own."""
        return self.builder is None

    def stages_per_rank(self, requested_v: int = 1) -> int:
        """Stages each rank holds: the schedule's fixed count (a V schedule accepts 1 or 2 for 2), else the request."""
        if requested_v < 1:
            raise ScheduleError(f"{self.name.value} needs stages per rank >= 1 ({requested_v} < 1)")
        if self.fixed_v == 1 and requested_v != 1:
            raise ScheduleError(f"{self.name.value} runs exactly 1 stage per rank ({requested_v} != 1)")
        if self.fixed_v is not None and self.fixed_v != 1:
            if requested_v not in (1, self.fixed_v):
                raise ScheduleError(f"{self.name.value} runs exactly {self.fixed_v} stages per rank "
                                    f"({requested_v} != {self.fixed_v})")
            return self.fixed_v
        return requested_v

    def v_choices(self, requested: int | None) -> list[int]:
        """Stages per rank the search tries: the fixed count (none where a request asks for another: a tester's
        pinned v was ignored by the schedules that run a fixed count), else the request, else 2 and 4."""
        if self.fixed_v is not None:
            return [self.fixed_v] if requested in (None, self.fixed_v) else []
        return [requested] if requested else [2, 4]

    def stage_to_rank(self, num_ranks: int, v: int = 1) -> list[int]:
        """Rank of every stage (index = stage): loop layout s % p, or the V zig-zag."""
        v = self.stages_per_rank(v)
        if self.placement in (StagePlacement.LOOP, StagePlacement.BIDIRECTIONAL):  # BIDIRECTIONAL: the down ranks
            return [s % num_ranks for s in range(num_ranks * v)]
        if self.placement is StagePlacement.V:
            return [s % num_ranks if (s // num_ranks) % 2 == 0 else num_ranks - 1 - s % num_ranks
                    for s in range(num_ranks * v)]
        raise ScheduleError(f"{self.name.value}: the plan gives each stage's rank; there is no layout to compute")

    def validate(self, num_ranks: int, num_microbatches: int, v: int = 1) -> int:
        """Check the size constraints; return the stages per rank or raise ScheduleError with the numbers."""
        v = self.stages_per_rank(v)
        name = self.name.value
        if num_ranks < 1:
            raise ScheduleError(f"{name} needs ranks >= 1 ({num_ranks} < 1)")
        if num_microbatches < 1:
            raise ScheduleError(f"{name} needs microbatches >= 1 ({num_microbatches} < 1)")
        need = self.min_microbatches_per_rank * num_ranks
        if num_microbatches < need:
            raise ScheduleError(f"{name} needs microbatches >= stages ({num_microbatches} < {need})")
        rounds = max(1, num_microbatches // num_ranks)
        if self.rounded and num_microbatches % rounds != 0:
            raise ScheduleError(
                f"{name} needs microbatches to be a multiple of rounds = max(1, microbatches // ranks)"
                f" ({num_microbatches} % {rounds} = {num_microbatches % rounds})"
            )
        if self.placement is StagePlacement.BIDIRECTIONAL:
            _check_bidirectional(name, num_ranks, num_microbatches)
        return v

    def build(self, num_ranks: int, num_microbatches: int, v: int = 1) -> dict[int, list[Action]]:
        """Per-rank compute actions (F, B or I/W), no idle slots and no communication."""
        if self.builder is None:  # given_order
            raise ScheduleError(f"{self.name.value} has no order of its own: the plan gives it")
        v = self.validate(num_ranks, num_microbatches, v)
        return {r: self.builder(r, num_ranks, num_microbatches, v) for r in range(num_ranks)}


def _check_bidirectional(name: str, num_ranks: int, num_microbatches: int) -> None:
    """Chimera's size rules: an even pipeline (rank r's two replicas are distinct stages r and p - 1 - r) and as many
    microbatches down as up."""
    if num_ranks % 2:
        raise ScheduleError(f"{name} needs an even number of ranks ({num_ranks} % 2 = 1)")
    if num_microbatches % 2:
        raise ScheduleError(f"{name} needs an even number of microbatches, half per direction "
                            f"({num_microbatches} % 2 = 1)")


_GPIPE = Descriptor(name=ScheduleName.GPIPE, placement=StagePlacement.LOOP, fixed_v=1, splits_backward=False,
                    torch_class="ScheduleGPipe", builder=named.gpipe, estimate=_estimate_gpipe,
                    pipe_bound=bound_flush, estimate_bound=estimate_bound_single, exact_inflight=_exact_gpipe)
_ONE_F_ONE_B = Descriptor(name=ScheduleName.ONE_F_ONE_B, placement=StagePlacement.LOOP, fixed_v=1,
                          splits_backward=False, torch_class="Schedule1F1B", builder=named.one_f_one_b,
                          estimate=_estimate_1f1b,
                          pipe_bound=bound_flush, estimate_bound=estimate_bound_single, min_microbatches_per_rank=1,
                          exact_inflight=_exact_1f1b)
_INTERLEAVED = Descriptor(name=ScheduleName.INTERLEAVED_1F1B, placement=StagePlacement.LOOP, fixed_v=None,
                          splits_backward=False, torch_class="ScheduleInterleaved1F1B",
                          builder=named.interleaved_1f1b, estimate=_estimate_megatron, pipe_bound=bound_megatron,
                          estimate_bound=estimate_bound_megatron,
                          rounded=True)
_LOOPED_BFS = Descriptor(name=ScheduleName.LOOPED_BFS, placement=StagePlacement.LOOP, fixed_v=None,
                         splits_backward=False, torch_class="ScheduleLoopedBFS", builder=named.looped_bfs,
                         estimate=_estimate_megatron,
                         pipe_bound=bound_megatron, estimate_bound=estimate_bound_megatron)
_INTERLEAVED_ZB = Descriptor(name=ScheduleName.INTERLEAVED_ZERO_BUBBLE, placement=StagePlacement.LOOP, fixed_v=None,
                             splits_backward=True, torch_class="ScheduleInterleavedZeroBubble",
                             builder=named.interleaved_zero_bubble, estimate=_estimate_zero_bubble,
                             pipe_bound=bound_zero_bubble, estimate_bound=estimate_bound_zero_bubble, rounded=True)
_ZBV = Descriptor(name=ScheduleName.ZBV_ZERO_BUBBLE, placement=StagePlacement.V, fixed_v=2, splits_backward=True,
                  torch_class="ScheduleZBVZeroBubble", builder=named.zbv, estimate=_estimate_zero_bubble,
                  pipe_bound=bound_zero_bubble, estimate_bound=estimate_bound_zero_bubble)
_DUAL_PIPE_V = Descriptor(name=ScheduleName.DUAL_PIPE_V, placement=StagePlacement.V, fixed_v=2, splits_backward=True,
                          torch_class="ScheduleDualPipeV", builder=named.dual_pipe_v, estimate=_estimate_zero_bubble,
                          pipe_bound=bound_zero_bubble, estimate_bound=estimate_bound_zero_bubble,
                          min_microbatches_per_rank=2, overlaps_f_b=True)
_CHIMERA = Descriptor(name=ScheduleName.CHIMERA, placement=StagePlacement.BIDIRECTIONAL, fixed_v=1,
                      splits_backward=False, torch_class="", builder=named.chimera, estimate=_estimate_chimera,
                      pipe_bound=bound_chimera, estimate_bound=estimate_bound_chimera)
_SEQ_1F1B = Descriptor(name=ScheduleName.SEQ_1F1B, placement=StagePlacement.LOOP, fixed_v=1, splits_backward=False,
                       torch_class="_PipelineScheduleRuntime", builder=named.seq_1f1b, estimate=_estimate_1f1b,
                       pipe_bound=bound_single, estimate_bound=estimate_bound_single, min_microbatches_per_rank=0,
                       sequence_chunks=True)
_CUSTOM = Descriptor(name=ScheduleName.CUSTOM, placement=StagePlacement.GIVEN, fixed_v=None, splits_backward=False,
                     torch_class="_PipelineScheduleRuntime")

#: The registry: every schedule's descriptor.
DESCRIPTORS: dict[ScheduleName, Descriptor] = {d.name: d for d in (
    _GPIPE, _ONE_F_ONE_B, _INTERLEAVED, _LOOPED_BFS, _INTERLEAVED_ZB, _ZBV, _DUAL_PIPE_V, _CHIMERA, _SEQ_1F1B,
    _CUSTOM)}

#: The schedules with an order of their own (all but CUSTOM and the sequence-chunked one), in the order the search
#: tries them.
NAMED: tuple[ScheduleName, ...] = tuple(n for n, d in DESCRIPTORS.items()
                                        if not d.given_order and not d.sequence_chunks)


def listed(keep: Callable[[Descriptor], bool], sep: str = ", ") -> str:
    """The named schedules whose descriptor `keep` accepts, as text for messages ("GPipe, 1F1B, ...")."""
    return sep.join(n.value for n in NAMED if keep(DESCRIPTORS[n]))


def describe(name: ScheduleName) -> Descriptor:
    """The descriptor of `name`."""
    return DESCRIPTORS[name]


def pairing(name: ScheduleName, ep_a2a: bool, v: int) -> Pairing | None:
    """The forward-backward pairs `name` at `v` stages per rank overlaps: DualPipeV's own (`Descriptor.overlaps_f_b`);
    with `ep_a2a` (the trainer's combined 1F1B, `autopp.data.overlap.Overlap.ep_a2a`) Interleaved1F1B's steady-state
    neighbours where v > 1 (Megatron-Core asserts a virtual pipeline for it where pp > 1, and treats one stage per
    rank as none); else None."""
    if DESCRIPTORS[name].overlaps_f_b:
        return Pairing.STAGES
    return Pairing.MICROBATCHES if ep_a2a and name is ScheduleName.INTERLEAVED_1F1B and v > 1 else None


def stages_per_rank(name: ScheduleName, requested_v: int = 1) -> int:
    """`Descriptor.stages_per_rank` of `name`."""
    return DESCRIPTORS[name].stages_per_rank(requested_v)


def stage_to_rank(name: ScheduleName, num_ranks: int, v: int = 1) -> list[int]:
    """`Descriptor.stage_to_rank` of `name`."""
    return DESCRIPTORS[name].stage_to_rank(num_ranks, v)


def validate(name: ScheduleName, num_ranks: int, num_microbatches: int, v: int = 1) -> int:
    """`Descriptor.validate` of `name`."""
    return DESCRIPTORS[name].validate(num_ranks, num_microbatches, v)


def build_schedule(name: ScheduleName, num_ranks: int, num_microbatches: int, v: int = 1) -> dict[int, list[Action]]:
    """`Descriptor.build` of `name`."""
    return DESCRIPTORS[name].build(num_ranks, num_microbatches, v)
