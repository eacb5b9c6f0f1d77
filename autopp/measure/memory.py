"""Bytes a unit holds: its parameters, gradients and optimizer state, what autograd saves for its backward, the
storages behind a value, and (on CUDA) the peak allocated during a forward and backward."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from .options import OPTIMIZER_STATES

__all__ = ["tensors_in", "storage_bytes", "saved_bytes", "static_bytes", "peak_bytes"]


def tensors_in(value: Any) -> list[torch.Tensor]:
    """All tensors in a (nested) tuple/list/dict value."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Bytes of the distinct storages behind `tensors`, each counted once, skipping storages in `exclude`."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def saved_bytes(run: Callable[[], Any], params: set[int]) -> int:
    """Bytes autograd saves for backward while `run()` executes, parameters excluded, shared storage once."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return storage_bytes(saved, exclude=params)


def static_bytes(module: nn.Module, optimizer: str, dtype: torch.dtype) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes of `module` (an fp32 master copy counted below float32)."""
    params = list(module.parameters())
    numel = sum(p.numel() for p in params if p.requires_grad)
    master = 4 * numel if dtype != torch.float32 else 0
    return {"param_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
            "optimizer_bytes": OPTIMIZER_STATES[optimizer] * 4 * numel + master}


def peak_bytes(device: torch.device, forward_backward: Callable[[], None]) -> int | None:
    """On CUDA: the most memory allocated during `forward_backward()`, above what was allocated before."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward_backward()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)
