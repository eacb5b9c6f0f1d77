"""Expert parallelism's all-to-alls: what each dispatch and combine of a MoE layer sends, on which links, and in what
time; DeepSeek-V3's node-limited routing and FP8 dispatch where the model and the recipe say so.

Per MoE layer and microbatch a rank runs a dispatch (the routed tokens to their experts' ranks) and a combine (the
experts' outputs back) in the forward, and their mirror images in the backward (the output gradients to the
experts, the input gradients back): two all-to-alls per pass, the same bytes forward and backward (torchtitan's
`ExpertParallel`, Megatron-Core's all-to-all token dispatcher, DeepEP's dispatch and combine kernels). T below is
one microbatch's tokens of the layer in the activations' dtype (tokens x hidden x its bytes: the unit's output
bytes, its input bytes for the last unit), k the top-k, e the ep degree; under balanced routing (docs/analytic.md)
every routed copy's destination is uniform over the ep group's ranks.

Flat (every model, and every ep group inside one node): each of the k copies of a token goes to its expert's rank,
(e - 1) / e of them off the rank: a dispatch sends s x k x (e - 1) / e x T and a combine k x (e - 1) / e x T, at
bytes / bandwidth + (e - 1) latencies on the link the group crosses (`Cluster.tp_link`: inside a node when it fits
one, else across nodes), s the recipe's dispatch bytes per activation byte (`Recipe.dispatch_scale`: 1, or about
0.52 under fp8: FP8 values and one fp32 scale per 128 elements, arXiv:2412.19437v2 s.3.3.4; the combine stays in
the activations' dtype).

Node-limited (`Routing.group_limited`: the model's config has `n_group` groups of experts and routes each token
within its best `topk_group` of them, DeepSeek-V3 s.2.1.2 "node-limited routing"; and the ep group spans n whole
nodes of g ranks each): experts are laid out in order, so with the groups on nodes (EP64 over 8 nodes: one group of
32 experts per node) a token's k experts lie on at most M = min(k, n, topk_group x the nodes one group spans) nodes.
DeepSeek's dispatch kernels (s.3.2.2) send each token across nodes once per target node, over InfiniBand to the rank
of the same in-node index there, which forwards it over NVLink to its experts' ranks; the combine reduces a token's
expert outputs inside each node first and sends one vector per node back. So per all-to-all:
  inter-node leg: s x M x (n - 1) / n x T bytes on the inter-node link, n - 1 latencies;
  intra-node leg: s x k x (g - 1) / g x T bytes on the intra-node link (each copy's hop to its expert's rank, none
                  where the receiving rank holds the expert), g - 1 latencies.
DeepSeek's kernels run the two legs at once, chunk by chunk (IB sends, NVLink forwarding and the arrivals
pipelined; "each token can efficiently select an average of 3.2 experts per node without incurring additional
overhead from NVLink", s.3.2.2, from its 160 GB/s NVLink against 50 GB/s IB): an all-to-all takes the slower leg's
time, max(inter, intra). DeepEP's kernels send once per node whatever the routing; autopp counts it only where the
routing is group-limited, as the report states it for DeepSeek-V3 (Qwen3's and Mixtral's counts stay flat: an upper
bound for a trainer running DeepEP across nodes). DeepSeek-V3 pinned (k 8, EP64 over 8 nodes, M 4, FP8
dispatch): a dispatch's IB bytes are 4 x 7/8 x 0.52 = 1.80 T against the flat count's 8 x 63/64 = 7.88 T, a
combine's 3.5 T.

Both are assumptions about the trainer, said in the plan's notes (`routing_note`): the node-limited count assumes
DeepEP's normal kernels (DeepSeek's; Megatron-Core's flex dispatcher with `--moe-flex-dispatcher-backend deepep`,
torchtitan's `--parallelism.expert_parallel_comm_backend=deepep`), whose hierarchical sends the plain all-to-all
dispatchers (Megatron's `alltoall`, torchtitan's default) do not make; the FP8 dispatch is DeepSeek's own (checked
in megatron-core 0.16.1: its DeepEP path dispatches the hidden states as they are, its HybridEP one refuses FP8).
A profile counted before the routing groups were recorded (`extra.moe` without `num_groups`) keeps the flat count
and the plan's note says so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..data.precision import plan_recipe

if TYPE_CHECKING:
    from ..data.cluster import Cluster
    from ..data.profile import Profile

__all__ = ["Routing", "AllToAll", "routing_of", "ep_nodes", "target_nodes", "alltoall_time", "routing_note"]


@dataclass(frozen=True)
class Routing:
    """How a mixture of experts routes its tokens, as the all-to-alls' bytes need it (module docstring)."""

    top_k: int
    """Experts per token (k)."""
    num_experts: int
    """Routed experts per layer (E)."""
    num_groups: int | None = None
    """Groups of experts the routing limits each token to `group_top_k` of (None: not group-limited)."""
    group_top_k: int | None = None
    dispatch_scale: float = 1.0
    """Bytes a dispatch sends per activation byte (`Recipe.dispatch_scale`)."""
    recorded: bool = True
    """Whether the profile records the routing groups (False: counted before them: the flat count)."""

    @property
    def group_limited(self) -> bool:
        return self.num_groups is not None and self.group_top_k is not None and self.group_top_k < self.num_groups


@dataclass(frozen=True)
class AllToAll:
    """Per unit, one microbatch's expert-parallel all-to-alls before the ep group's links are known: the tokens'
    bytes in the activations' dtype summed over the unit's MoE layers (T per layer, module docstring), the MoE
    layers (each adds a dispatch and a combine per pass), and the routing."""

    tokens: np.ndarray
    layers: np.ndarray
    routing: Routing


def routing_of(profile: Profile) -> Routing:
    """The routing the profile records (`meta.extra["moe"]`, autopp.model.experts.moe_facts) and its recipe's
    dispatch bytes (autopp.data.precision; a profile without a recipe: its dtype's, which sends as it computes)."""
    moe = profile.meta.extra.get("moe") or {}
    recipe = plan_recipe(profile.meta.extra.get("precision"), profile.meta.dtype)
    return Routing(top_k=int(moe.get("top_k") or 1), num_experts=int(moe.get("num_experts") or 1),
                   num_groups=moe.get("num_groups"), group_top_k=moe.get("group_top_k"),
                   dispatch_scale=1.0 if recipe is None else recipe.dispatch_scale(), recorded="num_groups" in moe)


def ep_nodes(ep: int, group: int, cluster: Cluster) -> tuple[int, int] | None:
    """The nodes an ep group of `ep` ranks of `group` consecutive devices each spans and its ranks per node, when it
    spans several whole nodes of `cluster`; None when it fits in one node, the cluster has no nodes, or it covers
    nodes partly (then the flat count on `Cluster.tp_link`)."""
    nodes = cluster.nodes
    devices = ep * group
    if nodes is None or nodes.devices_per_node % devices == 0 or devices % nodes.devices_per_node \
            or nodes.devices_per_node % group:
        return None
    return devices // nodes.devices_per_node, nodes.devices_per_node // group


def target_nodes(routing: Routing, ep: int, nodes: int) -> int:
    """M: the most nodes of an ep group of `ep` ranks over `nodes` nodes that one token's top-k experts lie on under
    the routing's group limit, experts laid out in order (expert x on rank x // (E / ep)): min(k, nodes, groups per
    token x the most nodes one group's experts touch)."""
    per_rank, per_group = routing.num_experts // ep, routing.num_experts // (routing.num_groups or 1)
    ranks_per_node = ep // nodes
    if per_rank == 0 or per_group == 0:  # experts not spread over ranks or groups in whole numbers: no group limit
        return min(routing.top_k, nodes)

    def node(x: int) -> int:
        return x // per_rank // ranks_per_node

    span = max(node((g + 1) * per_group - 1) - node(g * per_group) + 1 for g in range(routing.num_groups or 1))
    return min(routing.top_k, nodes, (routing.group_top_k or 1) * span)


def alltoall_time(comm: AllToAll, ep: int, group: int, cluster: Cluster) -> np.ndarray:
    """Per unit, the seconds of one pass's all-to-alls (a dispatch and a combine per MoE layer) of a rank of an ep
    group of `ep` ranks of `group` devices on `cluster` (module docstring)."""
    r = comm.routing
    placed = ep_nodes(ep, group, cluster) if r.group_limited else None
    if placed is None or cluster.nodes is None:
        link = cluster.tp_link(ep * group)
        sent = (1 + r.dispatch_scale) * comm.tokens * r.top_k * (ep - 1) / ep
        return sent / link.bandwidth_bytes_per_s + 2 * comm.layers * (ep - 1) * link.latency_s
    n, g = placed
    inter, intra = cluster.nodes.inter, cluster.nodes.intra
    m = target_nodes(r, ep, n)
    total = np.zeros(len(comm.tokens))
    for scale in (r.dispatch_scale, 1.0):  # the dispatch, then the combine
        across = scale * comm.tokens * m * (n - 1) / n / inter.bandwidth_bytes_per_s + \
            comm.layers * (n - 1) * inter.latency_s
        inside = scale * comm.tokens * r.top_k * (g - 1) / g / intra.bandwidth_bytes_per_s + \
            comm.layers * (g - 1) * intra.latency_s
        total = total + np.maximum(across, inside)
    return total


def routing_note(routing: Routing, ep: int, group: int, cluster: Cluster) -> str:
    """What the plan's all-to-alls assume of the routing and the dispatch's precision (module docstring), as a
    clause of the expert-parallel note ("" when they are the flat count in the activations' dtype)."""
    out = ""
    placed = ep_nodes(ep, group, cluster)
    if placed is not None and routing.group_limited:
        n, g = placed
        out += (f"; node-limited routing (top-{routing.top_k} within {routing.group_top_k} of {routing.num_groups} "
                f"expert groups, DeepSeek-V3 s.2.1.2): each token sent across nodes once per target node, to at most "
                f"{target_nodes(routing, ep, n)} of the ep group's {n} nodes, and forwarded to its experts inside "
                f"the node ({g} ranks), the two legs pipelined (the slower one costed), as DeepEP's kernels run it "
                "(Megatron's flex dispatcher with DeepEP; its alltoall dispatcher sends every copy)")
    elif placed is not None and not routing.recorded:
        out += ("; every routed copy costed across nodes: the profile was counted before the routing groups were "
                "recorded; if the model's routing is group-limited (DeepSeek-V3's), profile it again to count them")
    if routing.dispatch_scale != 1.0:
        out += (f"; dispatch in FP8 ({routing.dispatch_scale:.2f} of the activations' bytes with one fp32 scale per "
                "128 elements, DeepSeek-V3 s.3.3.4), combine in the activations' dtype")
    return out
