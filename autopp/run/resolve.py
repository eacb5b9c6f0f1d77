"""What a run's unset options become for a plan: the torch.distributed backend by the plan's device kind, the
optimizer by the plan's (the profile's). Torch-free: the CLI prints torchrun commands with it before torch loads.

The backend follows the device the plan was made for (`Plan.device`, a device catalog name): NCCL for a GPU, whose
ranks each drive one CUDA device, as torchtitan and Megatron-LM run; gloo for the CPU entry (a catalog device whose
memory is the host's, `DeviceSpec.memory_shared`). ROCm builds of torch serve AMD GPUs under the same "nccl" name
(RCCL). Running here, a GPU plan needs a CUDA device per rank of this node: without them the run is refused with
the flag that runs it on CPU instead, rather than silently measuring something else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..data.catalog import load_device
from ..data.plan import Plan
from ..errors import AutoppError, RunError
from .options import Backend, RunOptions

__all__ = ["Chosen", "plan_backend", "resolve_options"]


@dataclass(frozen=True)
class Chosen:
    """Options with every choice made, and one line on how the backend was chosen ("nccl: the plan is for ...")."""

    options: RunOptions
    backend_reason: str


def plan_backend(plan: Plan) -> tuple[Backend | None, str]:
    """(backend, why) from the plan's device kind; (None, why) when the plan names none the catalog knows."""
    if plan.device is None:
        return None, "the plan names no device kind"
    try:
        spec = load_device(plan.device)
    except AutoppError:
        return None, f"the plan's device {plan.device!r} is not in the device catalog"
    if spec.memory_shared:
        return "gloo", f"the plan is for {spec.name} (CPU ranks)"
    return "nccl", f"the plan is for {spec.name} (one GPU per rank)"


def resolve_options(plan: Plan, options: RunOptions, *, cuda_devices: int | None) -> Chosen:
    """`options` with the backend and optimizer set. `cuda_devices`: CUDA devices on this node, when the ranks run
    here (a plan without a device kind then gets NCCL only with one per rank); None for commands printed for other
    machines. Raises RunError when a GPU plan, or a given --backend nccl, is to run here without a CUDA device per
    rank (each NCCL rank drives its own device: `torch.cuda.set_device(local_rank)`)."""
    options = replace(options, optimizer=options.optimizer or plan.optimizer or "sgd")
    per_node = plan.num_ranks // (options.nodes.nnodes if options.nodes else 1)
    if options.backend == "nccl" and cuda_devices is not None and cuda_devices < per_node:
        raise RunError(f"--backend nccl needs a CUDA device per rank, but this node has {cuda_devices} CUDA devices "
                       f"for its {per_node} ranks: run it on GPU machines, or give --backend gloo to run it on CPU "
                       "here")
    if options.backend is not None:
        return Chosen(options, f"{options.backend}: given")
    backend, why = plan_backend(plan)
    if backend is None:
        if cuda_devices is None:
            return Chosen(replace(options, backend="gloo"), f"gloo: {why} (give --backend nccl for GPUs)")
        backend = "nccl" if cuda_devices >= per_node else "gloo"
        return Chosen(replace(options, backend=backend),
                      f"{backend}: {why}; this node has {cuda_devices} CUDA devices for {per_node} ranks")
    if backend == "nccl" and cuda_devices is not None and cuda_devices < per_node:
        raise RunError(f"{why} but this node has {cuda_devices} CUDA devices for its {per_node} ranks: run it on "
                       "those machines, or give --backend gloo to run it on CPU here")
    return Chosen(replace(options, backend=backend), f"{backend}: {why}")
