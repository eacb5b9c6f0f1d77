"""FSDP2 outside a pipeline (pp 1, `UnitView.fsdp`): ZeRO 3 as torchtitan runs pure FSDP, each unit resharded after
its forward and its backward, with the experts of a mixture-of-experts model beside it (autopp.costmodel.parallel's
module docstring has the stages under a pipeline).

Expert parallelism beside it is how torchtitan runs its MoE models (torchtitan/models/llama4/infra/parallelize.py,
`apply_fsdp`: the dense modules `fully_shard`-ed over the dp_shard (x cp) mesh, each block's experts over
`dp_shard_mod_ep`, the ranks holding the same experts, with the gradient divide factor of the dense ones) and as NeMo
AutoModel ran Qwen3-30B-A3B (EP8 beside FSDP8). Per unit with dense bytes P, G, O over the d synchronisation ranks
and a rank's expert bytes (1 / ep of the stacked experts, `ExpertBytes`) over their r = d / ep replicas:
  static: (P' + G + O) / d of the dense bytes, (E_P' + E_G + E_O) / r of the expert ones (P' the sharded parameter,
          none where the optimizer state holds the master copy, `UnitArrays.master`), r = 1 (ep = d) included.
  working memory: the gathered units (`fsdp_outside_pipeline`): the dense weights and the experts' gathered over
          r; their unsharded gradients likewise.
With r = 1 the experts are still `fully_shard`-ed, over a mesh of one rank: torchtitan builds dp_shard_mod_ep "even if
it's 1, whose FSDP wrapping helps the MoE layers do mixed precision training" (torchtitan/distributed/
parallel_dims.py, `build_mesh`) and its `apply_fsdp` wraps the experts whenever ep > 1; torch's FSDP2 at world size 1
(torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, `FSDPParamGroup.unshard` / `wait_for_unshard`) runs no
collective but still makes the unsharded parameter in `param_dtype` from the sharded one and frees it at reshard. So
the fp32 sharded parameter is the master, and the bf16 copy lives only around each unit's forward and backward, as
for r > 1: no persistent bf16 expert weights beside the master (counted until 2026-12-05, 6.75 GiB a rank on NeMo
AutoModel's Qwen3-30B-A3B row), and no time for their gathers and reduce-scatters (a local copy). NeMo AutoModel
does otherwise at ep = dp (nemo_automodel/components/moe/parallelizer.py, `parallelize_model`: `ep_shard_enabled`
only for an ep_shard mesh above 1 rank, and `apply_fsdp` then leaves the experts to the block's `ignored_params`),
but it trains its MoE models in bf16 without a master copy (the model cast to bf16 by `initialize_weights`, Adam's
moments in bf16), a recipe autopp.data.precision does not have; autopp's runner, which runs without a
MixedPrecisionPolicy (the weights are their own master), leaves them unwrapped too (autopp.run.expert_parallel,
`shard_experts`).
  time: per microbatch and unit, the dense all-gather (before the forward and again before the backward) and
          reduce-scatter over d on the synchronisation group's link, and the experts' over r (`replica_ring`: a ring
          of r ranks strided by ep, on the intra-node link when pipeline rank 0's dp ranks share a node, else on the
          inter-node one, an upper bound when some replicas share a node, as HSDP's replicas are costed), all under
          the neighbouring units' compute with FSDP2's prefetch.
Under torch.distributed.pipelining (pp > 1) ZeRO 3 beside ep stays refused (`check_expert_zero`): torch's stage keeps
its units gathered after each backward, and torchtitan's FSDP under a pipeline does not reshard after forward by
default (`fsdp_reshard_after_forward` "default": `not pp_enabled`), so nothing would run it as costed here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from ..data.cluster import Cluster
from ..data.layout import UnitView
from ..data.zero import ZeroStage
from ..errors import LayoutError
from .terms import half_collective, hsdp_allreduce_time
from .units import UnitArrays

__all__ = ["check_expert_zero", "dense_bytes", "fsdp_outside_pipeline", "fsdp_sharded", "fsdp_static", "replica_ring"]

_Terms = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_Time = Callable[[np.ndarray], np.ndarray]


def check_expert_zero(zero: ZeroStage, ep: int, pipelined: bool, etp: int = 1) -> None:
    """Refuse ZeRO 3 beside expert parallelism under a pipeline (`pipelined`: pp > 1) with one line; at pp 1 it runs
    as FSDP2 (module docstring), without expert tensor parallelism (`etp`: FSDP2 of the experts' etp shards is
    neither costed nor run)."""
    if etp > 1 and zero.gathers_each_forward:
        raise LayoutError(f"`zero` {zero.stage} with `etp` {etp}: autopp plans expert tensor parallelism with ZeRO 0, "
                          "1 or 2 (FSDP2 of the experts' tensor-parallel shards is not modelled); re-plan with `etp` 1 "
                          "or `zero` 1")
    if ep > 1 and zero.gathers_each_forward and pipelined:
        raise LayoutError(f"`zero` {zero.stage} with `ep` {ep} and `pp` above 1: autopp plans ZeRO 3 beside expert "
                          "parallelism only without a pipeline (FSDP2, as torchtitan runs its MoE models); re-plan "
                          "with `pp` 1 or `zero` 1")


def dense_bytes(a: UnitArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per unit, the dense parameter, gradient and optimizer bytes of a rank: `a`'s less its experts' (`a.grads`
    carries the expert gradients at their sync weight, the optimizer bytes the rest of them)."""
    p, g, e = a.params, a.grads, a.expert
    o = a.static - p - g
    if e is None:
        return p, g, o
    return p - e.params, g - e.sync_weight * e.grads, o - e.optimizer - (1 - e.sync_weight) * e.grads


def fsdp_static(a: UnitArrays, view: UnitView) -> _Terms:
    """Per unit, a rank's static bytes under FSDP2 at pp 1 by term (`parallel.STATIC_TERMS`: weights, sharded
    parameters, gradients, optimizer state; module docstring): the dense bytes over d, the experts' over r."""
    d, e = view.sync, a.expert
    p, g, o = dense_bytes(a)
    none = np.zeros(a.n)
    terms = (none, none if a.master else p / d, g / d, o / d)
    if e is None:
        return terms
    r = e.replicas  # r = 1 too: FSDP2 over one rank (module docstring)
    mine = (none, none if a.master else e.params / r, e.grads / r, e.optimizer / r)
    return tuple(x + y for x, y in zip(terms, mine))  # type: ignore[return-value]


def replica_ring(r: int, dp: int, groups: Cluster) -> _Time:
    """Per unit, a ring all-reduce of its bytes over `r` replicas strided across pipeline rank 0's `dp`
    data-parallel ranks of `groups` (HSDP's replicas of a shard group, the experts' replicas beside ep: the ring on
    the link they cross, `terms.hsdp_allreduce_time`; 0 with r = 1), vectorised (affine in the bytes)."""
    one = hsdp_allreduce_time(1.0, r, dp, groups)
    slope = hsdp_allreduce_time(2.0, r, dp, groups) - one
    return lambda s: np.where(s > 0, one - slope + slope * s, 0.0)


def fsdp_sharded(a: UnitArrays, view: UnitView, times: tuple[_Time, _Time | None, _Time | None],
                 static: np.ndarray, optimizer: np.ndarray | None) -> UnitArrays:
    """`a` under FSDP2 at pp 1 over d = `view.sync` ranks (module docstring); `times`, per unit and as functions of
    bytes: an all-reduce over the synchronisation group, HSDP's over the replicas of a shard group (None: no HSDP),
    and one over the experts' replicas (`replica_ring`; None: the synchronisation group's, their bytes weighted by
    `ExpertBytes.sync_weight`); `static`, `optimizer` the rank's static bytes and optimizer step
    (`parallel.data_sharded`)."""
    reduce_time, across, experts = times
    p, g, _ = dense_bytes(a)
    gathered, unsharded = p, g
    gather, scatter = half_collective(reduce_time(p)), half_collective(reduce_time(g))
    e = a.expert
    if e is not None:  # the experts' own FSDP over their replicas (one rank: gathered without a collective)
        gathered, unsharded = p + e.params, g + e.grads
    if e is not None and e.replicas > 1:
        weight = e.sync_weight
        over: _Time = experts if experts is not None else lambda s: reduce_time(weight * s)
        gather = gather + half_collective(over(e.params))
        scatter = scatter + half_collective(over(e.grads))
    if across is not None and view.replicate > 1:
        scatter = scatter + across(g / view.sync)
    held = (gathered, unsharded) if e is not None else None
    return replace(fsdp_outside_pipeline(a, gather, scatter, held), static=static, optimizer=optimizer,
                   zero=view.zero)


def fsdp_outside_pipeline(a: UnitArrays, gather: np.ndarray, scatter: np.ndarray,
                          held: tuple[np.ndarray, np.ndarray] | None = None) -> UnitArrays:
    """`a` run by FSDP2 with one module per unit outside a pipeline (pp 1, `UnitView.fsdp`; autopp.costmodel.
    parallel's stage 3 is the pipelined case): `gather`, `scatter` are each unit's all-gather of its parameters and
    reduce-scatter of its gradients, per microbatch; `held` the bytes per unit FSDP2 gathers and the unsharded
    gradients it reduce-scatters (None: `a.params`, `a.grads`).
    Unit u's parameters are gathered before its forward and again before its backward (resharded after the
    forward), its gradients reduce-scattered after its backward, every microbatch (FSDP2 reduces each backward
    unless told not to; torchtitan does not).

    Memory: beside the shards (static / d, set by the caller), a unit's working memory holds its gathered
    parameters and the prefetched neighbour's, its unsharded gradients and the previous unit's still being
    reduce-scattered: p_u + max(p_u-1, p_u+1) + g_u + g_u+1 on top of its own transient.

    Time, with `a.overlap.fsdp_prefetch` (FSDP2's implicit prefetch; torchtitan docs/fsdp.md): the forward of unit
    u runs while unit u + 1's parameters are gathered, max(F_u, AG_u+1), the first gather exposed; the backward (units
    in reverse) of unit u runs while unit u - 1's parameters are gathered and unit u + 1's gradients are
    reduce-scattered, max(B_u, AG_u-1 + RS_u+1), the last unit's gather and the first unit's scatter exposed. One
    collective stream per direction, as NCCL runs FSDP2's all-gather and reduce-scatter streams. The recomputed
    forward of a recomputing unit runs on the backward's gathered parameters: no gather of its own. Without the
    prefetch every collective is on the critical path."""
    zeros = np.zeros(1)
    if a.overlap.fsdp_prefetch:
        forward = np.maximum(a.forward, np.concatenate((gather[1:], zeros)))
        forward[0] += gather[0]
        behind = np.concatenate((zeros, gather[:-1])) + np.concatenate((scatter[1:], zeros))
        backward = np.maximum(a.backward, behind)
        backward[-1] += gather[-1]
        backward[0] += scatter[0]
    else:
        forward, backward = a.forward + gather, a.backward + gather + scatter
    extra = backward - a.backward  # charged to W, where the gradients are made
    params, grads = held if held is not None else (a.params, a.grads)
    neighbour = np.maximum(np.concatenate((zeros, params[:-1])), np.concatenate((params[1:], zeros)))
    working = params + neighbour + grads + np.concatenate((grads[1:], zeros))
    exposed = forward - a.forward + extra
    return replace(a, forward=forward, backward=backward, backward_weight=a.backward_weight + extra,
                   transient=np.round(a.transient_bytes() + working), fsdp=True,
                   zero_seconds=(2 * gather + scatter, exposed))
