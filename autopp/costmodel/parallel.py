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
shrink by t, so a rank's activation bytes are tp.csv's minus (1 - 1/t) x those (`group_table`). Not counted: the norms'
compute divided by t (elementwise, kept whole: an upper bound) and the all-gather of a stage's output at each pipeline
boundary (the runner keeps tensors whole between stages, as torchtitan's PP x TP does). The inputs the colwise
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
  stage 2: P + P / d + G / d + O / d; a reduce-scatter of the microbatch's G after each backward (charged to W);
           all-gather of P per step. Plan-only: torch's stage cannot run it.
  stage 3: as stage 1 at the peak (after a backward every unit of the stage stays gathered until its next forward
           resharding it), and an all-gather of P before each forward (charged to F, not to the recomputed forward,
           whose gather is the one the backward needs anyway: m + 1 per step, counted on gloo), reduce-scatter of G +
           all-gather of P per step. Under torch's pipelining it only adds communication.
The optimizer steps only its shard when stage >= 1: its time is divided by d. A reduce-scatter or all-gather costs
half the all-reduce of the same bytes (`terms.half_collective`).

Expert parallelism (`ExpertTable`, `expert_parallel`; torchtitan/distributed/expert_parallel.py, Megatron-Core's
MoE all-to-all dispatcher, DeepSeek-V3 arXiv:2412.19437 s.3.2): a stage's ep ranks (its dp replicas, ep = dp) each
hold E / ep of every MoE layer's experts. Per unit, the stacked expert weights (`expert_param_bytes`) and their
gradient and optimizer state count 1 / ep; their gradients are not all-reduced over the replicas (each rank owns
different experts), so `grads` (what the step's synchronisation all-reduces) keeps only the dense ones. Under
balanced routing (docs/analytic.md: every expert gets tokens x top-k / E rows) a rank computes as many expert rows
as without ep, so compute is unchanged. Each MoE layer adds per microbatch a dispatch and a combine all-to-all in
the forward and two in the backward; each sends tokens x hidden x dtype x top-k x (ep - 1) / ep bytes (tokens x
hidden x dtype: the unit's output bytes, its input bytes for the last unit), at bytes / bandwidth + (ep - 1)
latencies on the link the ep group crosses (inside a node when ep x group devices fit one, else across nodes:
`Cluster.tp_link`, as tensor parallelism's collectives), on the critical path (no overlap; DualPipe's is not
modelled).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from ..data.cluster import Cluster, Link
from ..data.layout import UnitView
from ..data.profile import Profile
from ..data.profile_tp import SP_COLUMNS
from ..data.zero import NO_ZERO
from ..errors import ProfileError
from .context import ContextTable, context_parallel
from .terms import allreduce_times, half_collective
from .units import ProfileTable, UnitArrays

__all__ = ["group_table", "group_terms", "replica_terms", "tensor_parallel", "data_sharded", "ExpertTable",
           "expert_parallel", "sp_offered"]


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
        return ExpertTable(profile, view.ep)
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
    return table


class ExpertTable(ProfileTable):
    """A `ProfileTable` (tp 1) whose units hold 1 / ep of their stacked experts (module docstring), with the bytes
    of their all-to-alls per microbatch (`UnitArrays.ep_comm`)."""

    def __init__(self, profile: Profile, ep: int) -> None:
        super().__init__(profile, 1)
        rows = profile.units.sort_values(["microbatch_size", "unit"])
        first = rows[rows.microbatch_size == self.sizes[0]]
        expert = first.expert_param_bytes.to_numpy(dtype=np.float64)
        # the share of each unit's parameter (gradient, optimizer) bytes that ep divides
        self.ep, self.share = ep, np.divide(expert, self.params, out=np.zeros(self.n), where=self.params > 0)
        self.layers = first.moe_layers.to_numpy(dtype=np.float64)
        top_k = (profile.meta.extra.get("moe") or {}).get("top_k") or 1
        tokens = rows.output_bytes.where(rows.output_bytes > 0, rows.recompute_keep_bytes)
        self.routed = float(top_k) * np.array([tokens[rows.microbatch_size == b].to_numpy(dtype=np.float64)
                                               for b in self.sizes]).T

    def arrays(self, b: float) -> UnitArrays:
        a = super().arrays(b)
        kept = 1 - self.share * (1 - 1 / self.ep)
        sent = self.layers * self._at(self.routed, b) * (self.ep - 1) / self.ep
        return replace(a, static=np.round(a.static * kept), params=np.round(a.params * kept),
                       grads=np.round(a.grads * (1 - self.share)),
                       optimizer=None if a.optimizer is None else a.optimizer * kept, ep_comm=(sent, self.layers))


def group_terms(a: UnitArrays, view: UnitView, cluster: Cluster) -> UnitArrays:
    """`a` (one device's compute in a group of `view.group` devices acting as one pipeline rank, `ProfileTable`) with
    the terms of the axes inside the group on `cluster` (the request's devices): tensor parallelism's collectives on
    its group's link, and context parallelism's K/V ring on the link its cp x tp devices cross (autopp.costmodel.
    context). An axis inside the group adds its terms here, so the search's views (autopp.solve.search.views) need
    not name it."""
    a = tensor_parallel(a, view, cluster.tp_link(view.tp))
    a = context_parallel(a, view, cluster.tp_link(view.group))
    return expert_parallel(a, view, cluster.tp_link(view.ep * view.group))


def replica_terms(a: UnitArrays, view: UnitView, groups: Cluster) -> UnitArrays:
    """`a` (a group's `group_terms`) sharded by the view's ZeRO stage over its `sync` ranks, the all-gathers and
    reduce-scatters on the synchronisation group of pipeline rank 0 of `groups` (the cluster of groups,
    `PlanRequest.view`; `Cluster.dp_group`)."""
    return data_sharded(a, view, lambda s: allreduce_times(s, view.sync, groups, 0, view.sync_per_group))


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
    return replace(a, forward=a.forward + forward, recompute=a.recompute + forward,
                   backward_input=a.backward_input + backward, backward=a.backward + backward)


def expert_parallel(a: UnitArrays, view: UnitView, link: Link) -> UnitArrays:
    """`a` with its expert-parallel all-to-alls' times added (`a.ep_comm`, module docstring): a dispatch and a
    combine per MoE layer in the forward (and the recomputed forward) and in the backward (input gradients and the
    full backward), each bytes / bandwidth + (ep - 1) latencies on `link`."""
    if view.ep == 1 or a.ep_comm is None:
        return a
    sent, layers = a.ep_comm
    both = 2 * (sent / link.bandwidth_bytes_per_s + layers * (view.ep - 1) * link.latency_s)
    return replace(a, forward=a.forward + both, recompute=a.recompute + both,
                   backward_input=a.backward_input + both, backward=a.backward + both)


def data_sharded(a: UnitArrays, view: UnitView, reduce_time: Callable[[np.ndarray], np.ndarray]) -> UnitArrays:
    """`a` with the view's ZeRO stage over its d = `view.sync` ranks (module docstring): static bytes, the
    all-gather before each forward (stage 3), the reduce-scatter after each backward (stage 2), the optimizer's
    shard. `reduce_time(bytes)`: per unit, an all-reduce of those bytes over the synchronisation group."""
    zero, d = view.zero, view.sync
    if zero.replicated or d == 1:
        return replace(a, zero=NO_ZERO)
    p, g = a.params, a.grads
    o = a.static - p - g
    static = p + p / d + (g / d if zero.scatters_each_microbatch else g) + o / d
    if zero.gathers_each_forward:
        gather = half_collective(reduce_time(p))
        a = replace(a, forward=a.forward + gather)
    if zero.scatters_each_microbatch:
        scatter = half_collective(reduce_time(g))
        a = replace(a, backward_weight=a.backward_weight + scatter, backward=a.backward + scatter)
    optimizer = None if a.optimizer is None else a.optimizer / d
    return replace(a, static=np.round(static), optimizer=optimizer, zero=zero)
