"""Data parallelism on a rank's pipeline stages beyond plain replicas: ZeRO stages 1 and 3 as FSDP2's `fully_shard`
over the layout's synchronisation ranks (`Layout.sync`: the mesh's "dp" dimension, flattened with "cp" where context
parallelism adds one, as torchtitan's `dp_shard_cp` mesh; a 2-D (replicate, shard) mesh with HSDP), and what
torch.distributed.pipelining cannot run (autopp.data.zero; Rajbhandari et al., SC'20, arXiv:1910.02054;
docs/parallelism.md)."""

from __future__ import annotations

import logging
from typing import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from ..data.layout import Layout
from ..data.plan import Plan
from ..data.zero import ZeroStage
from ..errors import RunError
from ..data.runner_rules import run_refusal

__all__ = ["check_runnable", "sync_mesh", "shard_replicas"]

logger = logging.getLogger(__name__)


def check_runnable(plan: Plan) -> None:
    """Refuse in one line what the runner does not run of `plan`'s layout (`run_refusal`, torch-free: what torch's
    pipelining cannot run of a ZeRO stage, expert and context parallelism beside what the runner runs them with)."""
    if why := run_refusal(plan):
        raise RunError(why)


def sync_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh of the ranks that average their gradients and over which ZeRO shards (`Layout.sync_axes` of `mesh`,
    flattened when there are several); with HSDP (`Layout.dp_replicate` > 1) unflattened into FSDP2's 2-D
    ("dp_replicate", "dp_shard") mesh, the replicas outermost as `Layout.shard` groups neighbours (torchtitan's
    `dp_replicate` x `dp_shard` mesh): `fully_shard` over it shards along dp_shard and all-reduces along
    dp_replicate."""
    dims = layout.sync_axes
    flat = mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten()
    if layout.dp_replicate == 1:
        return flat
    return flat._unflatten(0, (layout.dp_replicate, layout.shard), ("dp_replicate", "dp_shard"))


def shard_replicas(piece: nn.Module, mesh: DeviceMesh, zero: ZeroStage, units: Sequence[str],
                   ignored: set[nn.Parameter] | None = None) -> None:
    """ZeRO 1/3: `fully_shard` each of the piece's units with parameters, then the piece itself, over `mesh` (the
    synchronisation ranks), resharding after forward as the stage's descriptor says, leaving the `ignored`
    parameters alone (experts not sharded further beside ep: autopp.run.expert_parallel.shard_experts); nothing for
    ZeRO 0."""
    reshard = zero.fsdp_reshard_after_forward
    if reshard is None:
        return
    held = dict(piece.named_modules())
    sharded = [n for n in units if n in held and held[n] is not piece and any(True for _ in held[n].parameters())]
    for name in sharded:
        fully_shard(held[name], mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
    fully_shard(piece, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
    logger.info("%s over %d ranks: fully_shard(reshard_after_forward=%s) on %d units and the stage", zero,
                mesh.size(), reshard, len(sharded))
