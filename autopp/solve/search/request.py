"""What the user asks the planner for, and the configurations that request spans (the outer search space)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import NamedTuple

from ...data.cluster import Cluster
from ...data.layout import Layout, LayoutPins, check_planned
from ...data.overlap import TRAINER_OVERLAP, Overlap, default_overlap
from ...data.trainers import TRAINER_RULES, refusal
from ...data.vocab import VocabVariant
from ...data.zero import NO_ZERO, SEARCHED_ZERO, ZeroStage
from ...costmodel import UnitArrays, check_expert_zero, check_sequence
from ...errors import LayoutError, ProfileError, ScheduleError
from ...schedule import NAMED, Activation, ScheduleName, by_saving, chosen, describe, listed, policy
from ...schedule.seqpipe import ChunkCosts
from .judge import Candidate
from .runnable import check_pinned_mirror, check_pinned_v, check_pinned_zero, runs_beside

__all__ = ["RecomputeMode", "PlanRequest", "Config", "Group", "replica_counts", "microbatch_counts", "zero_stages",
           "ep_choices", "tp_choices", "cp_choices", "configs", "with_sp"]


class RecomputeMode(enum.Enum):
    """How the search chooses each stage's activation policy (autopp.schedule.activation)."""

    NONE = "none"
    """Every stage keeps its activations."""
    ALL = "all"
    """Every stage recomputes."""
    AUTO = "auto"
    """Every policy the profile has figures for, chosen per stage: more saving (and time) only where needed."""

    def policies(self) -> tuple[Activation, ...]:
        """The activation policies this mode lets the search give a stage, least memory saved first."""
        fixed = {RecomputeMode.NONE: (Activation.KEEP,), RecomputeMode.ALL: (Activation.RECOMPUTE,)}
        return fixed.get(self) or by_saving(list(Activation))


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What the user asked for; None for a field means "search it"."""

    cluster: Cluster
    global_batch: int
    """Samples per training step over all replicas: dp x microbatches x microbatch size."""
    num_microbatches: int | None = None
    """Microbatches per replica; None: every count that divides global_batch / dp."""
    schedule: ScheduleName | None = ScheduleName.ONE_F_ONE_B
    """None: every named schedule."""
    pins: LayoutPins = LayoutPins()
    """The fixed degrees and ZeRO stage; each None searched: pp as devices / (dp x tp); dp over the devices' divisors;
    tp over 1 and each degree with profile rows that fits (`tp_choices`); ZeRO over `SEARCHED_ZERO` where dp > 1."""
    tp_across_nodes: bool = False
    """Allow a tensor-parallel group to span nodes (its collectives then run on the inter-node link)."""
    tied_across_stages: bool = False
    """Plan tp or ZeRO with a weight tied between stages (Megatron sums its tied embedding's shards; plan only)."""
    recompute: RecomputeMode = RecomputeMode.NONE
    """Which activation policies the search gives the stages, unless `activations` names them."""
    activations: tuple[Activation, ...] | None = None
    """The policies a stage may get (None: `recompute`'s); several are chosen per stage (least saving that fits)."""
    recompute_stages: tuple[int, ...] | None = None
    """Stages that recompute, pinned (None: chosen by `recompute`)."""
    shortlist: int = 4
    """Configurations the simulator must find fitting before the search stops."""
    judge_budget: int = 2000
    """Configurations the branch and bound judges by bound, short-listed ones included (prove.py); 0: the short-list."""
    synthesize: bool = False
    """Also try a CP-SAT-synthesized order for the best candidate's split (autopp.solve.assemble.reorder)."""
    synth_time_limit_s: float = 10.0
    """CP-SAT time limit of that synthesis."""
    placement_time_limit_s: float = 10.0
    """CP-SAT time limit for choosing the device order of a heterogeneous cluster (autopp.solve.cpsat.placement)."""
    ties: bool = False
    """Candidates within the profile's spreads' band tie, kept by fewer microbatches, then less memory (search.band)."""
    trainer: str | None = None
    """Search only what this trainer runs (autopp.data.trainers: "torchtitan", "megatron", "deepspeed"): its
    schedules and synthesized orders, ZeRO stages and axes, and one activation policy for every stage (`recompute`
    auto then tries none and all, `make_plan`); None: everything autopp runs."""
    overlap: Overlap | None = None
    """The collectives assumed hidden under compute (autopp.data.overlap); None: `assumed_overlap`'s default."""
    frees_outputs: bool | None = None
    """The pipeline frees each stage's outputs once sent (Megatron-LM, DualPipe, Llama 3's runs); None: as `trainer`
    does, else held until their backward as torch's PipelineStage does (autopp.data.trainers.frees_outputs)."""
    vocab: tuple[VocabVariant | None, ...] = (None,)
    """The layouts of the vocabulary layers the search may choose (autopp.solve.search.vocab): None the plain split
    (embedding and head whole in the first and last stages), a variant vocabulary parallelism; (None,) off, every
    one searched, or one variant pinned. None of the trainers runs it: with `trainer`, only the plain split."""

    def __post_init__(self) -> None:
        for name, least in (("global_batch", 1), ("judge_budget", 0)):  # judge_budget 0: the short-list alone
            if getattr(self, name) < least:
                raise LayoutError(f"`{name}` must be >= {least}, got {getattr(self, name)}")
        check_planned(self.pins)
        self.pins.check_devices(self.cluster.num_devices)
        self._check_tp()
        self._check_ep()
        if self.num_microbatches is not None and self.global_batch % self.num_microbatches:
            raise LayoutError(f"global batch {self.global_batch} is not divisible by {self.num_microbatches} "
                              "microbatches")
        check_pinned_v(self.schedule, self.pins.v)
        if self.schedule is not None and describe(self.schedule).given_order:
            raise LayoutError(f"{self.schedule.value} is a plan's own order, not a schedule to plan for; use one of "
                              f"{listed(lambda d: True)} or search `schedule`")
        check_pinned_zero(self.schedule, self.pins.zero)
        check_pinned_mirror(self.schedule, self.pins)
        self._check_recompute_stages()
        self._check_trainer()
        if not self.cluster.homogeneous and self.pins.dp not in (1, None):
            raise LayoutError("data parallelism needs identical devices; give `dp` 1 with a heterogeneous cluster")

    def _check_tp(self) -> None:
        if self.pins.cp not in (None, 1) and not self.cluster.homogeneous:
            raise LayoutError("context parallelism needs identical devices; give `cp` 1 with a heterogeneous cluster")
        if self.pins.cp not in (None, 1) and self.pins.ep not in (None, 1):
            raise LayoutError(f"`cp` {self.pins.cp} with `ep` {self.pins.ep}: autopp runs expert parallelism with cp "
                              "1; give one of them 1")
        nodes, group = self.cluster.nodes, (self.pins.cp or 1) * (self.pins.tp or 1)
        if self.pins.cp not in (None, 1) and nodes is not None and nodes.devices_per_node % group \
                and group % nodes.devices_per_node:
            raise LayoutError(f"cp({self.pins.cp or 1}) x tp({self.pins.tp or 1}) = {group} devices neither fit in a "
                              f"node of {nodes.devices_per_node} nor span whole nodes: give degrees whose product "
                              f"divides or is a multiple of {nodes.devices_per_node}")
        tp = self.pins.tp
        if tp in (None, 1):
            return
        if not self.cluster.homogeneous:
            raise LayoutError("tensor parallelism needs identical devices; give `tp` 1 with a heterogeneous cluster")
        nodes = self.cluster.nodes
        if nodes is None or nodes.devices_per_node % tp == 0:
            return
        if not self.tp_across_nodes:
            raise LayoutError(f"tp={tp} does not fit in a node of {nodes.devices_per_node} devices; give a divisor "
                              f"of {nodes.devices_per_node}, or `tp_across_nodes` to let tensor-parallel groups "
                              "span nodes")
        if tp % nodes.devices_per_node:
            raise LayoutError(f"tp={tp} neither fits in a node of {nodes.devices_per_node} devices nor spans whole "
                              f"nodes: give a divisor or a multiple of {nodes.devices_per_node}")

    def _check_trainer(self) -> None:
        if self.trainer is None:
            return
        if self.trainer not in TRAINER_RULES:
            raise LayoutError(f"`trainer` {self.trainer!r} is not one autopp exports to; give one of "
                              f"{', '.join(TRAINER_RULES)}")
        rules = TRAINER_RULES[self.trainer]
        if self.synthesize and not rules.synthesized:
            raise LayoutError(f"`synthesize` with `trainer` {self.trainer}: {rules.title} runs no synthesized order; "
                              "drop `synthesize`")
        pinned = self.schedule
        if pinned is not None and not describe(pinned).given_order and pinned not in rules.schedules:
            raise LayoutError(f"`schedule` {pinned.value} with `trainer` {self.trainer}: {rules.title} runs "
                              f"only {rules.runs}; pin one of those or search `schedule`")
        if pinned is None and self.pins.v is not None and not any(describe(s).v_choices(self.pins.v)
                                                                   for s in rules.schedules):
            raise LayoutError(f"`v` {self.pins.v} with `trainer` {self.trainer}: none of the schedules it runs "
                              f"({rules.runs}) runs {self.pins.v} stages per rank; drop `v`")
        if self.recompute_stages is not None:
            raise LayoutError(f"`recompute_stages` pins a policy per stage, and {rules.title} applies one to every "
                              "stage: give `recompute` auto (each policy it applies on every stage) or none")
        if None not in self.vocab:
            raise LayoutError(f"`vocab` {'/'.join(v.value for v in self.vocab if v)} with `trainer` "
                              f"{self.trainer}: {rules.vocab}; give `vocab` off")

    def _check_ep(self) -> None:
        ep, zero, dp, pp = self.pins.ep, self.pins.zero, self.pins.dp, self.pins.pp  # etp's ZeRO: ep pinned or not
        if zero is not None and (pp not in (None, 1) and ep not in (None, 1) or self.pins.etp not in (None, 1)):
            check_expert_zero(zero, ep or 1, pipelined=pp not in (None, 1), etp=self.pins.etp or 1)
        if ep in (None, 1):
            return
        if self.pins.tp not in (None, 1) or dp is not None and dp % ep:
            got = ", ".join(f"`{k}` {v}" for k, v in (("dp", dp), ("tp", self.pins.tp)) if v is not None)
            raise LayoutError(f"`ep` {ep} runs with `tp` 1 and a `dp` it divides (carved from dp ranks): got {got}")

    def view(self, group: int) -> PlanRequest:
        """The request as groups of `group` devices (a layout's `group`: cp x tp) see it: each group is one pipeline
        rank (`Cluster.tp_groups`), so the pipeline x data-parallel search runs on the groups unchanged."""
        pins = self.pins.per_group()
        if group == 1:
            return replace(self, pins=pins)
        return replace(self, cluster=self.cluster.tp_groups(group), pins=pins)

    @property
    def assumed_overlap(self) -> Overlap:
        """`overlap`, or what the `trainer` overlaps on a catalog GPU (`Trainer.overlap`; without one, torchtitan's and
        Megatron-LM's) and nothing on CPU ranks and unnamed devices (`default_overlap`); the plan records it."""
        default = default_overlap(self.cluster.device_kind)
        trainer = TRAINER_RULES[self.trainer].overlap if self.trainer and default is TRAINER_OVERLAP else default
        return self.overlap if self.overlap is not None else trainer

    def pinned_activations(self, num_stages: int) -> tuple[Activation, ...] | None:
        """The per-stage policies `recompute_stages` pins for `num_stages` stages (None: not pinned)."""
        return None if self.recompute_stages is None else chosen(num_stages, self.recompute_stages)

    def allowed(self) -> tuple[Activation, ...]:
        """The policies the search may give a stage, least memory saved first (`activations`, else `recompute`'s);
        with `recompute_stages` pinned, every policy (the DP's split may need any)."""
        if self.activations is not None:
            return by_saving(self.activations)
        return RecomputeMode.AUTO.policies() if self.recompute_stages is not None else self.recompute.policies()

    def offered(self, a: UnitArrays) -> tuple[Activation, ...]:
        """`allowed` policies whose figures the unit arrays `a` carry, on this cluster's devices
        (`ActivationPolicy.offered`: offload needs a host link; maybe none)."""
        return tuple(p for p in self.allowed() if policy(p).offered(a, self.cluster.host_bandwidth))

    def ladder(self, a: UnitArrays) -> tuple[Activation, ...]:
        """`offered` policies; a ProfileError when there are none."""
        allowed, out = self.allowed(), self.offered(a)
        if not out:
            why = "; ".join(f"{p.value}: {policy(p).unoffered}" for p in allowed)
            raise ProfileError(f"`activations` {','.join(p.value for p in allowed)}: none is offered ({why}); allow "
                               "`keep` or `recompute`")
        return out

    def _check_recompute_stages(self) -> None:
        acts = self.activations
        if acts is not None and (not acts or self.recompute is not RecomputeMode.NONE):
            raise LayoutError(f"`activations` {','.join(a.value for a in acts) or 'none'}: give at least one policy, "
                              f"and drop `recompute` {self.recompute.value}")
        stages = self.recompute_stages
        if stages is None:
            return
        if any(s < 0 for s in stages) or len(set(stages)) != len(stages):
            raise LayoutError(f"`recompute_stages` {','.join(map(str, stages))}: give distinct stage indices >= 0")
        if acts is not None:
            raise LayoutError("`recompute_stages` pins each stage's recomputation; drop `activations`")
        if self.recompute is not RecomputeMode.NONE:
            raise LayoutError(f"`recompute_stages` pins each stage's recomputation; drop `recompute` "
                              f"{self.recompute.value}")


@dataclass(frozen=True)
class Config:
    """One point of the outer search (the split is chosen inside it)."""

    schedule: ScheduleName
    layout: Layout
    m: int
    """Microbatches per replica per step."""
    b: int
    """Microbatch size."""
    seq: ChunkCosts | None = None
    """Sequence pipelining's chunks (`Candidate.seq`); None: microbatches run whole."""

    def candidate(self, bounds: tuple[tuple[int, int], ...], activations: tuple[Activation, ...]) -> Candidate:
        """This configuration with a split and each stage's activation policy."""
        return Candidate(schedule=self.schedule, layout=self.layout, microbatches=self.m, microbatch_size=self.b,
                         bounds=bounds, activations=activations, seq=self.seq)

    @staticmethod
    def of(c: Candidate) -> Config:
        """The configuration of a candidate (without its split and policies)."""
        return Config(c.schedule, c.layout, c.microbatches, c.microbatch_size, c.seq)


def replica_counts(req: PlanRequest) -> list[int]:
    d = req.cluster.num_devices
    if req.pins.dp is not None:
        return [req.pins.dp]
    if req.pins.pp is not None:
        return [d // req.pins.pp]
    return [x for x in range(1, d + 1) if d % x == 0 and req.cluster.homogeneous or x == 1]


def microbatch_counts(req: PlanRequest, dp: int) -> list[int]:
    """Candidate microbatch counts per replica: divisors of global_batch / dp (or the pinned count)."""
    if req.global_batch % dp:
        return []
    per = req.global_batch // dp
    if req.num_microbatches is not None:
        return [req.num_microbatches] if per % req.num_microbatches == 0 else []
    return [m for m in range(1, per + 1) if per % m == 0]


def zero_stages(req: PlanRequest, dp: int) -> tuple[ZeroStage, ...]:
    """ZeRO stages over `dp` synchronising ranks (dp x cp): none without (and no configuration where a sharding stage
    is pinned: a tester's `--zero 3` came out as dp 1 without ZeRO), else the pinned one or SEARCHED_ZERO."""
    if dp == 1:
        return (NO_ZERO,) if req.pins.zero is None or req.pins.zero.replicated else ()
    return SEARCHED_ZERO if req.pins.zero is None else (req.pins.zero,)


def tp_choices(req: PlanRequest, profiled: tuple[int, ...]) -> list[int]:
    """Tensor-parallel degrees to search: the pinned one, else 1 and each degree in `profiled` (the profile's
    `tp_degrees`) that divides the devices with the pinned pp, dp and cp and, unless `tp_across_nodes`, the devices
    per node."""
    if req.pins.tp is not None:
        return [req.pins.tp]
    nodes, d = req.cluster.nodes, req.cluster.num_devices
    pinned = (req.pins.pp or 1) * (req.pins.dp or 1) * (req.pins.cp or 1)
    fits = lambda t: d % (pinned * t) == 0 and (nodes is None or nodes.devices_per_node % t == 0  # noqa: E731
                                                or req.tp_across_nodes and t % nodes.devices_per_node == 0)
    return [1, *(t for t in sorted(profiled) if t > 1 and fits(t) and req.cluster.homogeneous)]


def cp_choices(req: PlanRequest, tp: int, seq_len: int | None) -> list[int]:
    """Context-parallel degrees to search beside `tp`: the pinned one, else 1 and each degree c > 1 whose group of
    c x tp devices divides the devices (with the pinned pp and dp), fits in a node or spans whole nodes (as
    `Cluster.tp_groups` needs), and shards a sequence of `seq_len` tokens (`costmodel.check_sequence`; None: the
    profile records no attention shape, so 1 alone). A pinned degree the sequence refuses is a LayoutError."""
    pinned = req.pins.cp
    if pinned is not None:
        why = None if pinned == 1 or seq_len is None else check_sequence(seq_len, pinned, tp)
        if why is not None:
            raise LayoutError(why)
        return [pinned]
    if seq_len is None or req.pins.ep not in (None, 1) or not req.cluster.homogeneous:
        return [1]
    nodes, d, others = req.cluster.nodes, req.cluster.num_devices, (req.pins.pp or 1) * (req.pins.dp or 1) * tp
    rest = d // others if d % others == 0 else 0
    fits = lambda g: nodes is None or nodes.devices_per_node % g == 0 or g % nodes.devices_per_node == 0  # noqa: E731
    return [1, *(c for c in range(2, rest + 1) if rest % c == 0 and fits(c * tp)
                 and check_sequence(seq_len, c, tp) is None)]


def ep_choices(req: PlanRequest, dp: int, tp: int, zero: ZeroStage, pp: int = 1) -> tuple[tuple[int, int], ...]:
    """(ep, etp) pairs to try (autopp.costmodel.parallel: both carved from dp, tp 1, ZeRO 0 to 2, or 3 at pp 1 as
    FSDP2 with etp 1, autopp.costmodel.fsdp): ep pinned or, searched (`pins.ep` None), 1 and every divisor of dp
    (torchtitan: ep divides dp_shard); beside each ep > 1, etp pinned or every divisor of dp / ep (etp 1 alone)."""
    fits, etp = dp > 1 and tp == 1 and (not zero.gathers_each_forward or pp == 1), req.pins.etp
    eps = (1, *(e for e in range(2, dp + 1) if dp % e == 0)) if fits else (1,)
    if req.pins.ep is not None:
        eps = (req.pins.ep,) if req.pins.ep == 1 or fits and dp % req.pins.ep == 0 else ()
    return tuple((e, t) for e in eps for t in ((etp,) if etp is not None else range(1, dp // e + 1))
                 if t == 1 or not zero.gathers_each_forward and e > 1 and dp % (e * t) == 0)


def replicate_choices(req: PlanRequest, dp: int, zero: ZeroStage, ep: int) -> tuple[int, ...]:
    """HSDP's replicate degrees to try (`Layout.dp_replicate`): the pinned one where it fits (a sharding ZeRO stage,
    a divisor of dp below it, no ep), or, searched (`pins.dp_replicate` None), 1 and every such divisor."""
    fits = [r for r in range(2, dp) if dp % r == 0] if not zero.replicated and ep == 1 else []
    pinned = req.pins.dp_replicate
    if pinned is None:
        return (1, *fits)
    return (pinned,) if pinned == 1 or pinned in fits else ()


def with_sp(req: PlanRequest, offered: bool) -> PlanRequest:
    """The request with sequence parallelism decided for every tp > 1 (`offered`: the profile counts its bytes,
    `costmodel.sp_offered`): pinned on needs them (LayoutError otherwise); searched (None) is on where offered, as
    it dominates in the cost model (the same collective time, fewer activation bytes), else off, and off with tp
    pinned to 1 (nothing to shard: a profile with SP figures planned without tensor parallelism)."""
    if req.pins.sp and not offered:
        raise LayoutError("`sp` on: the profile's tensor-parallel rows do not count what sequence parallelism shards "
                          "(tp.csv column sp_sequence_bytes; profiles made before it): profile again, or `sp` off")
    searched = offered and req.pins.tp != 1
    return replace(req, pins=replace(req.pins, sp=searched if req.pins.sp is None else req.pins.sp))


class Group(NamedTuple):
    """The degrees of the axes inside a pipeline rank's group of devices (`Axis.in_group`): one point of the
    search's outer loop (`Views.degrees`)."""

    cp: int
    tp: int


def configs(req: PlanRequest, n: int, degrees: tuple[Group, ...] = (Group(1, 1),), experts: int = 0) -> list[Config]:
    """Every valid configuration of the request for a model of `n` units, per group's cp and tp in `degrees` (pp and
    dp count groups of cp x tp devices: `PlanRequest.view`), ep and etp (`ep_choices`; searched ep dividing `experts`,
    the routed experts per MoE layer, where known) and sp where tp > 1 and `sp` is on (`with_sp`); with a `trainer`,
    only those it runs (autopp.data.trainers); each has the stages `recompute_stages` pins."""
    out = [replace(c, layout=replace(c.layout, cp=cp, tp=tp, zero=zero, ep=ep, sp=tp > 1 and bool(req.pins.sp),
                                     dp_replicate=r, etp=etp))
           for cp, tp in degrees for c in _pipeline_configs(req.view(cp * tp), n)
           for zero in zero_stages(req, c.layout.dp * cp)
           for ep, etp in ep_choices(req, c.layout.dp, cp * tp, zero, c.layout.pp)
           if not experts or experts % ep == 0 or req.pins.ep
           for r in replicate_choices(req, c.layout.dp, zero, ep)]
    out = [c for c in out if runs_beside(c.schedule, c.layout)]  # what the runner runs whatever the model
    rules = TRAINER_RULES.get(req.trainer or "")
    return out if rules is None else [c for c in out if refusal(rules, c.schedule, c.layout, c.m) is None]


def _pipeline_configs(req: PlanRequest, n: int) -> list[Config]:
    """The pipeline x data-parallel configurations of a request (tp 1 or a `view`) that have its pinned stages."""
    names = [req.schedule] if req.schedule else list(NAMED)
    out = []
    for dp in replica_counts(req):
        pp = req.cluster.num_devices // dp
        for name in names:
            d = describe(name)
            if d.mirrored and not req.cluster.placed(Layout(pp=pp, dp=dp)).mirror_symmetric(pp):
                continue
            for v in d.v_choices(req.pins.v):  # not several stages on one rank (explain.py `_looped_single_rank`)
                stages = pp * d.stages_per_rank(v)
                if not max(req.recompute_stages or (0,)) < stages <= n or pp == 1 < stages:
                    continue
                for m in microbatch_counts(req, dp):
                    try:
                        d.validate(pp, m, v)
                    except ScheduleError:
                        continue
                    out.append(Config(name, Layout(pp=pp, v=d.stages_per_rank(v), dp=dp), m,
                                      req.global_batch // (dp * m)))
    return out
