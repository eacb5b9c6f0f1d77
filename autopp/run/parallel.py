"""A rank's pipeline stages parallelised beyond the pipeline, with torch's own pieces: the device mesh over the
layout's axes (`Layout.mesh_axes`, numbered as `Layout.rank` numbers the ranks), and each axis applied to a stage by
its own module, in torchtitan's order (torchtitan/models/llama3/infra/parallelize.py: TP first, then FSDP):
autopp.run.tensor_parallel (DTensor over mesh["tp"]), then autopp.run.data_parallel (FSDP2 over the
synchronisation ranks). docs/parallelism.md has the facts checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..data.layout import Layout
from ..data.plan import Plan
from .data_parallel import shard_replicas, sync_mesh
from .expert_parallel import ep_meshes, parallelize_experts, shard_experts
from .tensor_parallel import parallelize_stage

__all__ = ["make_mesh", "Sharding", "shard_stage", "local", "full"]


def make_mesh(plan: Plan, device: torch.device) -> DeviceMesh:
    """The device mesh over the world, row-major over `Layout.mesh_axes`: the ranks `Layout.rank` numbers."""
    axes = plan.layout.mesh_axes
    return init_device_mesh(device.type, tuple(getattr(plan.layout, a) for a in axes), mesh_dim_names=axes)


@dataclass(frozen=True)
class Sharding:
    """How a rank's stages are parallelised beyond the pipeline."""

    mesh: DeviceMesh
    layout: Layout
    resolved: dict[str, str]
    """Planned module name -> style ({} without TP)."""
    full_model: nn.Module | None
    """The freshly built full-size model whose planned modules and experts modules go back into the pieces (None
    without TP or EP)."""
    sequence: tuple[str, ...] = ()
    """The modules sequence parallelism shards along the sequence (the norms; () without `Layout.sp`)."""


def shard_stage(piece: nn.Module, sharding: Sharding, units: Sequence[str], device: torch.device) -> None:
    """Tensor-parallelise the piece's planned modules over mesh["tp"], shard its experts over the ep ranks (carved
    from the stage's dp ranks: autopp.run.expert_parallel; with ZeRO 3 at pp 1 fully_shard them over the ranks
    holding the same experts), then (ZeRO 1/3) fully_shard each of its units with parameters and the piece itself
    over the synchronisation ranks (TP first, then FSDP, as torchtitan)."""
    if sharding.resolved and sharding.full_model is not None:
        parallelize_stage(piece, sharding.mesh["tp"], sharding.resolved, sharding.full_model, device,
                          sharding.sequence, units)
    ignored: set[nn.Parameter] = set()
    if sharding.layout.ep > 1 and sharding.full_model is not None:
        ep, replicas = ep_meshes(sharding.mesh, sharding.layout)
        parallelize_experts(piece, ep, sharding.full_model, device)
        ignored = shard_experts(piece, sharding.layout, replicas)
    shard_replicas(piece, sync_mesh(sharding.mesh, sharding.layout), sharding.layout.zero, units, ignored)


def local(value: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a tensor (a DTensor's local shard)."""
    return value.to_local() if isinstance(value, DTensor) else value


def full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor gathered: collective over its mesh, every holder must call it)."""
    return value.full_tensor() if isinstance(value, DTensor) else value
