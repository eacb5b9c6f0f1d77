"""Tensor- and data-parallel terms of each unit's cost: a tensor-parallel rank's collectives added to its times, and
a ZeRO stage's sharding of the static bytes and its collectives inside the step (docs/parallelism.md). Each reads its
degrees from the layout's `UnitView`; `group_terms` and `replica_terms` are what the search calls, so an axis adds
its terms here without its callers naming it.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053, s.3): the profile's `tp.csv` rows give a
rank's own compute at the sharded shapes and, per microbatch, the bytes of the all-reduces a colwise -> rowwise
pattern implies (rowwise outputs in F, colwise inputs' gradients in B) and of the all-gathers of gathered outputs.
They run on the group's link (`Cluster.tp_link`) on the critical path: F and B wait for them (no overlap assumed,
as in Megatron's f and g operators). Ring costs (nccl-tests doc/PERFORMANCE.md): all-reduce 2 (t - 1) / t x S / B,
all-gather (t - 1) / t x S / B, plus 2 (t - 1) latencies per collective (an upper bound for the all-gathers).

Sequence parallelism (`UnitView.sp`; Korthikanti et al. 2022, arXiv:2205.05198, s.4.2.2): each all-reduce becomes a
reduce-scatter + an all-gather of the same S, (t - 1) / t x S / B and t - 1 latencies each on a ring: the same time, so
the collectives' terms do not change (a vocabulary-parallel embedding's all-reduce in F becomes a reduce-scatter in F
and an all-gather in B: costed as before, in F). The sequence-wise modules (the norms) then hold 1/t of the sequence:
their saved inputs, which the profile's tp rows count per unit (`sp_sequence_bytes`, autopp.model.tp.sequence_modules),
shrink by t, so a rank's activation bytes are tp.csv's minus (1 - 1/t) x those (`group_table`). Between two units of
a stage that both hold such modules the residual stream stays a rank's local shard (autopp.run.tensor_parallel), so
a value one makes for the other counts 1/t of its bytes (`UnitArrays.born`: what per-unit recomputation keeps of it);
a stage's input stays whole. A rank's compute is its tp rows' SP times where the profile has them
(`SP_TIME_COLUMNS`: the shard counted with the norms and residual adds on 1/t of the sequence, autopp.model.
tp_sequence; the plain rows run them whole on every rank, as DTensor TP without SP does: docs/analytic.md, "Why a
block's TP row is more than 1/t of it"); without them (measured profiles, older ones) the plain times, an upper
bound. Not counted: the all-gather of a stage's output at each pipeline boundary (the runner keeps tensors whole
between stages, as torchtitan's PP x TP does). The inputs the colwise
projections read are saved gathered (as DTensor runs them), so the figure is Korthikanti's TP-only count sbh(10 + 24/t +
5as/(ht)) less (1 - 1/t) of the norms' inputs, above Megatron's sbh/t (34 + 5as/h), which also keeps those inputs and
the dropout masks sharded.

ZeRO (Rajbhandari et al., SC'20, arXiv:1910.02054, s.5), as it runs under torch.distributed.pipelining with FSDP2
(torch's stage accumulates unsharded gradients over a step's microbatches and reduce-scatters them once, and keeps
each unit's parameters gathered after every backward but the last, `set_reshard_after_backward(False)`, stage.py;
facts checked in docs/parallelism.md). Per unit with parameter, gradient and optimizer bytes P, G, O over d ranks
(`Layout.sync`: the dp replicas x the cp ranks):
  stage 0: P + G + O; all-reduce of G after the step's last backward (`terms.sync_time`).
  stage 1: P + P / d + G + O / d (FSDP2 without resharding after forward keeps its sharded copy beside the
           gathered one); reduce-scatter of G + all-gather of P per step.
  stage 2: P + P / d + G / d + O / d; a reduce-scatter of the microbatch's G after each backward (charged to W),
           unit by unit under the stage's backward with `Overlap.fsdp_prefetch`, the stage's first unit's on the
           rank's reduce-scatter stream beside its next actions (`scatter_in_backward`); all-gather of P per step.
           Plan-only: torch's stage cannot run it.
  stage 3: as stage 1 at the peak (after a backward every unit of the stage stays gathered until its next forward
           resharding it), and an all-gather of P before each forward (charged to F, not to the recomputed forward,
           whose gather is the one the backward needs anyway: m + 1 per step, counted on gloo), reduce-scatter of G +
           all-gather of P per step. Under torch's pipelining it only adds communication.
  stage 3 at pp 1 (`UnitView.fsdp`): FSDP2 without a pipeline, as torchtitan runs pure FSDP: (P' + G + O) / d, each
           unit gathered for its forward and its backward and reduce-scattered after its backward, every microbatch,
           under the neighbouring units' compute with FSDP2's prefetch (`fsdp_outside_pipeline`); nothing at the
           step's end.
P / d above (P' / d at pp 1) is FSDP2's sharded parameter. Where O holds an fp32 master copy (the bf16 and fp8
recipes: `UnitArrays.master`), that sharded parameter is the master: FSDP2's MixedPrecisionPolicy keeps the sharded
parameter in its own dtype (fp32), the optimizer steps it, and gathers param_dtype copies for compute
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py); it is counted once, in O / d (P' = 0; Megatron's distributed
optimizer likewise keeps 6 + 12 / d bytes per parameter, docs/source/api-guide/dist_optimizer.md). Without a master
copy (fp32) the sharded parameter is a copy of its own (P' = P).
The optimizer steps only its shard when stage >= 1: its time is divided by d. A reduce-scatter or all-gather costs
half the all-reduce of the same bytes (`terms.half_collective`).
HSDP (`UnitView.replicate` r > 1, `Layout.dp_replicate`; torchtitan's dp_replicate x dp_shard, FSDP2 on a 2-D mesh
(replicate, shard)): d above is the shard group (dp / r x cp neighbours, inside a node when it fits one), whose
links carry the all-gathers and reduce-scatters; each rank's G / d shard is then all-reduced across the r replicas
(`terms.hsdp_allreduce_time`, on the inter-node link when dp spans nodes): per microbatch, after the
reduce-scatter, at pp 1 (FSDP2 reduces every backward), else once at the step's end (`terms.rank_sync_times`).

Expert parallelism (`ExpertTable`, `expert_parallel`; torchtitan/distributed/expert_parallel.py, Megatron-Core's
MoE all-to-all dispatcher, DeepSeek-V3 arXiv:2412.19437 s.3.2): a stage's dp replicas form dp / ep groups of ep
ranks (ep fastest, Megatron's "tp-cp-ep-dp-pp" order); each rank of an ep group holds E / ep of every MoE layer's
experts. Per unit, the stacked expert weights (`expert_param_bytes`) and their gradient and optimizer state count
1 / ep (1 / (ep x etp) with expert tensor parallelism, autopp.costmodel.experts); the dense gradients are
all-reduced over dp, the expert ones over the r = dp / (ep x etp) ranks holding the same shard (none when r = 1).
That second all-reduce is charged as part of the step's dp-wide one (`grads`): an expert gradient byte weighs
((r - 1) / r) / ((d - 1) / d), its ring time over r ranks against d (`ExpertBytes`; on the dp group's link, which
the strided replicas cross as well). Under balanced routing (docs/analytic.md: every
expert gets tokens x top-k / E rows) a rank computes as many expert rows as without ep, so the FLOPs are unchanged,
but its expert GEMMs read 1 / ep of the expert weights: re-timed per pass from the profile's expert columns
(autopp.costmodel.experts; a profile without them keeps the ep-1 times).
Each MoE layer adds per microbatch a dispatch and a combine all-to-all in the forward and two in the backward
(autopp.costmodel.alltoall): each sends tokens x hidden x dtype x top-k x (ep - 1) / ep bytes (tokens x hidden x
dtype: the unit's output bytes, its input bytes for the last unit; the dispatch in FP8 under the fp8 recipe), at
bytes / bandwidth + (ep - 1) latencies on the link the ep group crosses (inside a node when ep x group devices fit
one, else across nodes: `Cluster.tp_link`, as tensor parallelism's collectives); a group-limited routing
(DeepSeek-V3's) over an ep group of whole nodes sends each token across nodes once per target node and forwards it
inside the node. They are on the critical path (`UnitArrays.ep_time`: what DualPipeV's overlapped forward-backward
pairs hide, autopp.schedule.simulate).
ZeRO beside ep (torchtitan's FSDP of the experts over dp_shard / ep, Megatron's expert data-parallel group): the
dense bytes shard over d ranks as above, the expert ones over their r replicas (`data_sharded`), and so does the
optimizer's step; stages 1 and 2. The per-step all-gather of the parameters stays charged over d (an upper bound
for the expert ones, gathered over r). Stage 3 at pp 1 is FSDP2 beside ep (autopp.costmodel.fsdp); under a
pipeline it is refused (`check_expert_zero`): no trainer autopp exports to runs it there.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from ..data.cluster import Cluster, Link
from ..data.layout import UnitView
from ..data.profile import EXPERT_COLUMNS, EXPERT_PARTS, EXPERT_PASSES, Profile, expert_column
from ..data.profile_tp import SP_COLUMNS, SP_TIME_COLUMNS
from ..data.zero import NO_ZERO
from ..data.zero import ZeroStage
from ..errors import LayoutError, ProfileError
from .alltoall import AllToAll, alltoall_time, routing_of
from .context import ContextTable, context_parallel
from .experts import ExpertParts, expert_gemms, expert_tensor_rows
from .fsdp import check_expert_zero, dense_bytes, fsdp_sharded, fsdp_static, replica_ring
from .terms import allreduce_times, half_collective
from .units import ExpertBytes, ProfileTable, UnitArrays, born_table

__all__ = ["group_table", "group_terms", "replica_terms", "tensor_parallel", "data_sharded", "ExpertTable",
           "expert_parallel", "sp_offered", "static_terms",
           "STATIC_TERMS", "scatter_in_backward"]


def sp_offered(profile: Profile) -> bool:
    """Whether the profile's tp rows count what sequence parallelism shards (`SP_COLUMNS`; older profiles do not, and
    SP is then not offered: no guess)."""
    return profile.tp_units is not None and all(c in profile.tp_units.columns for c in SP_COLUMNS)


def group_table(profile: Profile, view: UnitView) -> ProfileTable:
    """The profile's rows one device of the view's group computes with: its tensor-parallel degree's (`tp.csv`
    rows for tp > 1), with sequence parallelism's activation bytes (module docstring), or with its experts sharded
    over ep (`ExpertTable`; the runner runs ep at tp 1 only, so never beside SP), or a cp rank's share of the
    sequence (autopp.costmodel.context.ContextTable). An axis whose rows are measured at
    its sharded shapes selects them here."""
    if view.ep > 1:
        if view.tp > 1 or view.cp > 1 or view.ep_replicas < 1:
            raise LayoutError(f"expert parallelism ep({view.ep}) x etp({view.etp}) beside tp({view.tp}) and "
                              f"cp({view.cp}) is not costed: autopp carves the experts from the data-parallel "
                              "ranks only (tp 1, cp 1, ep x etp dividing dp), as its runner runs them; plan with "
                              "tp 1 and cp 1, or ep 1")
        return ExpertTable(profile, view.ep, view.ep_replicas, view.etp)
    table = ProfileTable(profile, view.tp) if view.cp == 1 else ContextTable(profile, view.tp, view.cp)
    if view.sp and view.tp > 1:
        if not sp_offered(profile) or profile.tp_units is None:
            raise ProfileError(f"the profile of {profile.meta.model_path} has no sequence-parallel bytes (tp.csv "
                               "column sp_sequence_bytes, profiles made before it): profile it again, or plan with "
                               "`sp` off")
        rows = profile.tp_units[profile.tp_units.tp == view.tp].sort_values("unit")
        seq = np.array([rows[rows.microbatch_size == b].sp_sequence_bytes.to_numpy(dtype=np.float64)
                        for b in table.sizes]).T
        table.cols["activation_bytes"] = np.maximum(0.0, table.cols["activation_bytes"] - (1 - 1 / view.tp) * seq)
        if all(c in rows.columns for c in SP_TIME_COLUMNS):  # the rank's compute with the stream sharded, counted
            table.cols.update({c.removeprefix("sp_"): np.array([rows[rows.microbatch_size == b][c].to_numpy(
                dtype=np.float64) for b in table.sizes]).T for c in SP_TIME_COLUMNS})
        stream = born_table(profile, table.sizes, within=seq.max(axis=1, initial=0.0) > 0)
        if table.born is not None and stream is not None:  # the residual stream between a stage's norm-holding units
            table.born = table.born - (1 - 1 / view.tp) * stream
    return table


class ExpertTable(ProfileTable):
    """A `ProfileTable` (tp 1) whose units hold 1 / ep of their stacked experts (module docstring), with the bytes
    of their all-to-alls per microbatch (`UnitArrays.ep_comm`) and their expert GEMMs re-timed for 1 / ep of the
    weights (`expert_gemms`, when the profile has the columns); `replicas` (dp / (ep x etp)) ranks hold the same
    expert shard; with `etp`, each expert's GEMMs and bytes over etp ranks too (`expert_tensor_rows`)."""

    def __init__(self, profile: Profile, ep: int, replicas: int = 1, etp: int = 1) -> None:
        super().__init__(profile, 1)
        d = ep * etp * replicas  # etp: each expert's GEMMs over etp ranks beside ep (autopp.costmodel.experts)
        self.replicas, self.etp = replicas, etp
        self.weight = 0.0 if replicas == 1 else ((replicas - 1) / replicas) / ((d - 1) / d)
        rows = profile.units.sort_values(["microbatch_size", "unit"])
        first = rows[rows.microbatch_size == self.sizes[0]]
        expert = first.expert_param_bytes.to_numpy(dtype=np.float64)
        # the share of each unit's parameter (gradient, optimizer) bytes that ep divides
        self.ep, self.share = ep, np.divide(expert, self.params, out=np.zeros(self.n), where=self.params > 0)
        self.layers, self.routing = first.moe_layers.to_numpy(dtype=np.float64), routing_of(profile)
        # a unit's tokens by its hidden states: its output, or its input for the last unit (the model's output)
        tokens = rows.output_bytes.where((rows.output_bytes > 0) & (rows.unit < self.n - 1), rows.recompute_keep_bytes)
        self.tokens = np.array([tokens[rows.microbatch_size == b].to_numpy(dtype=np.float64) for b in self.sizes]).T
        self.gemms = all(c in rows.columns for c in EXPERT_COLUMNS)
        self.cols.update({c: np.array([rows[rows.microbatch_size == b][c].to_numpy(dtype=np.float64)
                                       for b in self.sizes]).T for c in EXPERT_COLUMNS if self.gemms})

    def expert_parts(self, b: float) -> ExpertParts:
        """The expert GEMMs' FLOP, weight and other seconds per pass at microbatch size `b` ({}: not profiled)."""
        return {phase: tuple(self._at(self.cols[expert_column(phase, part)], b) for part in EXPERT_PARTS)
                for phase in EXPERT_PASSES} if self.gemms else {}

    def arrays(self, b: float) -> UnitArrays:
        a = expert_gemms(super().arrays(b), self.expert_parts(b), self.ep, self.etp)
        kept = 1 - self.share * (1 - 1 / (self.ep * self.etp))
        mine = self.share / (self.ep * self.etp)  # a rank's expert bytes per byte of the unit's whole
        expert = ExpertBytes(params=a.params * mine, grads=a.grads * mine, optimizer=(a.static - a.params - a.grads)
                             * mine, replicas=self.replicas, sync_weight=self.weight)
        a = replace(a, static=np.round(a.static * kept), params=np.round(a.params * kept),
                    grads=np.round(a.grads * (1 - self.share) + self.weight * expert.grads),
                    optimizer=None if a.optimizer is None else a.optimizer * kept,
                    ep_comm=AllToAll(self.layers * self._at(self.tokens, b), self.layers, self.routing),
                    expert=expert)
        return expert_tensor_rows(a, self.routing.top_k * self._at(self.tokens, b), self.layers, self.etp)


def group_terms(a: UnitArrays, view: UnitView, cluster: Cluster) -> UnitArrays:
    """`a` (one device's compute in a group of `view.group` devices acting as one pipeline rank, `ProfileTable`) with
    the terms of the axes inside the group on `cluster` (the request's devices): tensor parallelism's collectives on
    its group's link, and context parallelism's K/V ring on the link its cp x tp devices cross (autopp.costmodel.
    context); the carved axes' too: ep's all-to-alls on the link its ep x etp devices cross, and etp's collectives
    (tensor parallelism on the experts, autopp.costmodel.experts) on its etp devices'. An axis inside the group adds
    its terms here, so the search's views (autopp.solve.search.views) need not name it."""
    a = tensor_parallel(a, view, cluster.tp_link(view.tp))
    a = context_parallel(a, view, cluster.tp_link(view.group))
    a = expert_parallel(a, view, cluster)
    return tensor_parallel(a, view._replace(tp=view.etp, sp=False), cluster.tp_link(view.etp * view.group))


def replica_terms(a: UnitArrays, view: UnitView, groups: Cluster) -> UnitArrays:
    """`a` (a group's `group_terms`) sharded by the view's ZeRO stage over its `sync` ranks, the all-gathers and
    reduce-scatters on the synchronisation group of pipeline rank 0 of `groups` (the cluster of groups,
    `PlanRequest.view`; `Cluster.dp_group`); with HSDP (`view.replicate` > 1) the shard group is the first
    dp / replicate of pipeline rank 0's data-parallel ranks and FSDP2's all-reduce of each microbatch's gradient
    shards across the replicas (`hsdp_allreduce_time`) joins the reduce-scatter; beside ep under FSDP2, the experts'
    collectives run over their replicas, strided by ep as HSDP's by the shard group (`replica_ring`)."""
    dp = view.sync // view.sync_per_group * view.replicate if view.sharded else 1
    return data_sharded(a, view, lambda s: allreduce_times(s, view.sync, groups, 0, view.sync_per_group),
                        replica_ring(view.replicate, dp, groups), replica_ring(view.ep_replicas, dp, groups))


def tensor_parallel(a: UnitArrays, view: UnitView, link: Link) -> UnitArrays:
    """`a` (a tensor-parallel rank's compute, `ProfileTable(profile, view.tp)`) with its collectives' times added: F's
    to the forward and the recomputed forward, B's to the input-gradient pass and the full backward."""
    comm, tp = a.tp_comm, view.tp
    if tp == 1 or comm is None:
        return a
    ring = (tp - 1) / tp / link.bandwidth_bytes_per_s
    latency = 2 * (tp - 1) * link.latency_s
    forward = 2 * ring * comm.forward_allreduce + ring * comm.forward_allgather + latency * comm.forward_count
    backward = 2 * ring * comm.backward_allreduce + latency * comm.backward_count
    exposed_f, exposed_b = forward, backward
    if a.overlap.async_tp and view.sp:
        exposed_f, exposed_b = _async_tp(forward, a.forward, tp), _async_tp(backward, a.backward_input, tp)
    return replace(a, forward=a.forward + exposed_f, recompute=a.recompute + exposed_f,
                   backward_input=a.backward_input + exposed_b, backward=a.backward + exposed_b,
                   tp_seconds=(forward + backward, exposed_f + exposed_b))


def _async_tp(comm: np.ndarray, compute: np.ndarray, tp: int) -> np.ndarray:
    """What async TP leaves exposed of `comm` seconds of sequence-parallel collectives beside `compute` seconds of
    the matmuls they feed: the micro-pipeline splits each collective into tp chunks and hides all but the first
    under the matmuls on the other chunks (torch's `_micro_pipeline_tp` fusion of all-gather + matmul and matmul +
    reduce-scatter; Wang et al., "Overlap Communication with Dependent Computation via Decomposition", ASPLOS'23),
    so comm / tp, plus whatever of the rest the compute cannot cover."""
    first = comm / tp
    return first + np.maximum(0.0, comm - first - compute)


def expert_parallel(a: UnitArrays, view: UnitView, cluster: Cluster) -> UnitArrays:
    """`a` with its expert-parallel all-to-alls' times added (`a.ep_comm`, module docstring): a dispatch and a
    combine per MoE layer in the forward (and the recomputed forward) and in the backward (input gradients and the
    full backward), each on the links its ep group crosses on `cluster` (autopp.costmodel.alltoall)."""
    if view.ep == 1 or a.ep_comm is None:
        return a
    both = alltoall_time(a.ep_comm, view.ep, view.etp * view.group, cluster)  # ep's ranks etp apart
    return replace(a, forward=a.forward + both, recompute=a.recompute + both,
                   backward_input=a.backward_input + both, backward=a.backward + both, ep_time=both)


def data_sharded(a: UnitArrays, view: UnitView, reduce_time: Callable[[np.ndarray], np.ndarray],
                 across: Callable[[np.ndarray], np.ndarray] | None = None,
                 experts: Callable[[np.ndarray], np.ndarray] | None = None) -> UnitArrays:
    """`a` with the view's ZeRO stage over its d = `view.sync` ranks (module docstring): static bytes, the
    all-gather before each forward (stage 3), the reduce-scatter after each backward (stage 2), the optimizer's
    shard; expert bytes (`a.expert`) over their own dp / (ep x etp) ranks. `reduce_time(bytes)`: per unit, an
    all-reduce of those bytes over the synchronisation (shard) group; `across(bytes)`: HSDP's all-reduce of a
    gradient shard over the replicas (`view.replicate`), charged here per microbatch where FSDP2 runs outside a
    pipeline (else at the step's end, autopp.costmodel.terms); `experts(bytes)`: an all-reduce over the experts'
    replicas, under FSDP2 (autopp.costmodel.fsdp)."""
    zero, d = view.zero, view.sync
    if zero.replicated or d == 1:
        return replace(a, zero=NO_ZERO)
    p, g, e = a.params, a.grads, a.expert
    static = np.round(sum(static_terms(a, view).values(), np.zeros(a.n)))
    optimizer = None if a.optimizer is None else a.optimizer / d
    if e is not None and a.optimizer is not None:  # the step's share of the experts: over their replicas
        mine = g + (1 - e.sync_weight) * e.grads
        part = np.divide(e.grads, mine, out=np.zeros(len(mine)), where=mine > 0)
        optimizer = a.optimizer * ((1 - part) / d + part / e.replicas)
    if view.fsdp:
        return fsdp_sharded(a, view, (reduce_time, across, experts), static, optimizer)
    comm = exposed = np.zeros(a.n)
    if zero.gathers_each_forward:
        gather = half_collective(reduce_time(p))
        a, comm, exposed = replace(a, forward=a.forward + gather), comm + gather, exposed + gather
    if zero.scatters_each_microbatch:
        scatter = half_collective(reduce_time(g))
        a, shown = scatter_in_backward(a, scatter)
        comm, exposed = comm + scatter, exposed + shown
    return replace(a, static=static, optimizer=optimizer, zero=zero, zero_seconds=(comm, exposed))


def scatter_in_backward(a: UnitArrays, scatter: np.ndarray) -> tuple[UnitArrays, np.ndarray]:
    """`a` with ZeRO 2's reduce-scatter of each unit's gradients after every microbatch's backward (`scatter`, per
    unit) charged to W and B, and the part of it on the critical path per unit (a stage's first unit's: see below).

    With `a.overlap.fsdp_prefetch`, FSDP's per-module reduce-scatter on its own stream: FSDP2 (`fully_shard` on each
    unit, torch docs "torch.distributed.fsdp.fully_shard") issues a module's reduce-scatter on a separate CUDA stream
    in its post-backward hook, as soon as that module's backward has produced its gradients, and the compute stream
    goes on at once; only the next use of that stream's result (the next reduce-scatter, the optimizer step at the
    step's end) waits for it (torchtitan docs/fsdp.md; `fsdp_outside_pipeline` costs the same streams at pp 1;
    Llama 3, arXiv:2407.21783, s.3.3.2: FSDP sharding "optimizer states and gradients" inside each pipeline stage).
    Inside a stage a microbatch's backward runs its units in reverse, so unit u's scatter hides under unit u - 1's
    backward H_{u-1} (the cheaper of B and I + W, as `UnitArrays.work` counts it: the same microbatch, the same
    stage): min(RS_u, H_{u-1}) hidden, the rest charged to the backward (exposed). The stage's first unit i finishes
    last: its whole scatter RS_i runs on the rank's reduce-scatter stream after the backward action ends, beside the
    rank's next actions (another microbatch's forward or backward): `UnitArrays.stage_scatter`, queued by the
    simulator (`StageCost.scatter_s`, autopp.schedule.simulate) at max(backward end, stream free), the step's end
    on that rank (its DP/ZeRO collectives, the optimizer) after the stream. The per-unit times charge unit u its
    RS_u - min(RS_u, H_{u-1}) (unit 0 all of RS_0); a stage starting at i takes unit i's charge off
    (`UnitArrays.stage_start`, <= 0), so no scatter hides under another stage's compute and none is counted twice.
    Not modelled: the in-stage scatters queueing behind a previous microbatch's first-unit scatter still on the
    stream (each backward's own scatters are taken to find it free), the stream's contention with the pipeline's
    point-to-point sends on the same link, and the memory of the unsharded gradients awaiting their scatter (one
    unit's G beside the next action's activations: not charged, as before). Without the switch every scatter is on
    the critical path, in W and B."""
    if not a.overlap.fsdp_prefetch:
        return replace(a, backward_weight=a.backward_weight + scatter, backward=a.backward + scatter), scatter
    hider = np.minimum(a.backward, a.backward_input + a.backward_weight)
    hidden = np.zeros(a.n)
    hidden[1:] = np.minimum(scatter[1:], hider[:-1])
    exposed = scatter - hidden
    return replace(a, backward_weight=a.backward_weight + exposed, backward=a.backward + exposed,
                   stage_start=-exposed if exposed.any() else None, stage_scatter=scatter), exposed


#: The terms of a rank's static bytes (`static_terms`), in order.
STATIC_TERMS = ("weights", "sharded parameters", "gradients", "optimizer state")


def static_terms(a: UnitArrays, view: UnitView) -> dict[str, np.ndarray]:
    """Per unit, a rank's static bytes under the view's ZeRO stage by term (`STATIC_TERMS`, module docstring): the
    weights it computes with (whole; none between uses under FSDP2 at pp 1, where they are working memory), FSDP2's
    sharded parameters beside them (none where the optimizer state holds the master copy: `UnitArrays.master`), the
    gradients and the optimizer state (with the master copy); the expert bytes over their own replicas. They sum
    to `data_sharded`'s static bytes."""
    zero, d = view.zero, view.sync
    p, g, e = a.params, a.grads, a.expert
    o, none = a.static - p - g, np.zeros(a.n)
    if zero.replicated or d == 1:
        return dict(zip(STATIC_TERMS, (p, none, g, o)))
    check_expert_zero(zero, view.ep, pipelined=not view.fsdp, etp=view.etp)
    if view.fsdp:
        return dict(zip(STATIC_TERMS, fsdp_static(a, view)))
    terms = _shard(p, g, o, d, zero, a.master)
    if e is not None:  # the expert bytes: out of the dense shard, into their own replicas' one
        dense = _shard(*dense_bytes(a), d, zero, a.master)
        terms = tuple(x + y for x, y in zip(dense, _shard(e.params, e.grads, e.optimizer, e.replicas, zero, a.master)))
    return dict(zip(STATIC_TERMS, terms))


def _shard(p: np.ndarray, g: np.ndarray, o: np.ndarray, d: int, zero: ZeroStage,
           master: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Parameter, gradient and optimizer bytes on one of d ranks under `zero` (module docstring), by term: the
    gathered parameters, FSDP2's sharded ones unless they are the master copy in `o` (`master`), the gradients
    (sharded by stage 2) and the optimizer state's shard."""
    return p, np.zeros(len(p)) if master else p / d, g / d if zero.scatters_each_microbatch else g, o / d
