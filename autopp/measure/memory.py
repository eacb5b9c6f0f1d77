"""Bytes a unit holds: its parameters, gradients and optimizer state, what autograd saves for its backward, the
storages behind a value, and the peak allocated during a forward and backward (CUDA: the caching allocator's
statistics; CPU: the live storages that torch's operators create, tracked by a TorchDispatchMode)."""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..data.precision import Recipe
from ..schedule.activation import SAVED_OPS
from ..model.experts import expert_bytes
from .options import OPTIMIZER_STATES

__all__ = ["tensors_in", "storage_bytes", "value_bytes", "saved_bytes", "saved_storages", "static_bytes", "peak_bytes",
           "live_peak", "LiveBytes", "storage_key", "PEAK_HOW", "SavedOps", "ReplaySaved"]

#: How `peak_bytes` measures, by device type (stored with the peaks in a profile's `extra.peak_bytes_how`).
PEAK_HOW = {"cuda": "torch.cuda.max_memory_allocated - memory_allocated before",
            "cpu": "most bytes of live storages created by torch operators (autopp.measure.memory.LiveBytes)"}


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
    """Bytes of the distinct storages behind `tensors` (real, meta and fake alike: `storage_key`), each counted
    once, skipping storages in `exclude`."""
    seen: dict[int, int] = {}
    for t in tensors:
        key = storage_key(t)
        if key not in exclude:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def value_bytes(value: Any) -> int:
    """Bytes of the distinct storages behind the tensors of a (nested) value."""
    return storage_bytes(tensors_in(value))


def saved_bytes(run: Callable[[], Any], exclude: set[int]) -> tuple[Any, int]:
    """`run()`'s result and the bytes autograd saves for backward meanwhile (`saved_storages`), summed."""
    out, saved = saved_storages(run, exclude)
    return out, sum(saved.values())


def saved_storages(run: Callable[[], Any], exclude: set[int], seen: Callable[[torch.Tensor], None] | None = None
                   ) -> tuple[Any, dict[int, int]]:
    """`run()`'s result and the storages autograd saves for backward meanwhile (`storage_key` -> bytes), storages
    in `exclude` (`storage_key`s: the parameters') left out, each also handed to `seen` as it is saved; real and
    fake tensors alike. What autograd keeps is a detached alias (its backward must not run), and no tensor is held
    here, since a saved output kept with its own grad_fn would form a cycle through autograd's C++ graph that
    Python's garbage collector cannot free (it kept every measured unit's parameters alive)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in exclude:
            saved[key] = t.untyped_storage().nbytes()
            if seen is not None:
                seen(t)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, saved


def static_bytes(module: nn.Module, optimizer: str, recipe: Recipe) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes of `module` under `recipe` (autopp.data.precision: gradients at
    its `grad_bytes`, its fp32 master copy counted with the optimizer state), and the bytes and count of its stacked
    experts (`expert_bytes`)."""
    params = list(module.parameters())
    numel = sum(p.numel() for p in params if p.requires_grad)
    return {"param_bytes": sum(p.numel() * p.element_size() for p in params), "grad_bytes": recipe.grad_bytes * numel,
            "optimizer_bytes": (OPTIMIZER_STATES[optimizer] * recipe.state_bytes + recipe.master_bytes) * numel,
            **expert_bytes(module)}


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind `t` (fake and meta tensors have no data pointer to tell them apart)."""
    return int(t.untyped_storage()._cdata)


class LiveBytes(TorchDispatchMode):
    """While active, the bytes of the storages that torch operators create and that are still alive (`now`), and
    the most they reached (`peak`): every operator's outputs are seen here (forward and, as the mode is passed to
    autograd, backward); an output sharing a storage with one of the operator's inputs (a view, an in-place or
    accumulating op) allocates nothing; a storage is counted from its first appearance until Python frees it
    (`weakref.finalize`; storages keep one Python object for their whole life). Storages made before the mode (the
    parameters') and those in `exclude` (`storage_key`s) are not counted. Real, fake and meta tensors alike: on CPU
    the measured peak (`peak_bytes`), under FakeTensorMode the counted one (autopp.measure.counting). What CUDA's
    `max_memory_allocated` gives, minus the allocator's rounding."""

    def __init__(self, exclude: frozenset[int] | set[int] = frozenset()) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self._exclude = frozenset(exclude)
        self._live: dict[int, int] = {}
        self._ids: dict[int, int] = {}  # storage_key -> its number in the order counted, while it lives
        self._made = 0  # storages counted so far
        self._made_at_peak = 0  # ... when `peak` was reached

    def _free(self, key: int) -> None:
        self.now -= self._live.pop(key, 0)
        self._ids.pop(key, None)

    def held_at_peak(self, keys: Iterable[int]) -> int:
        """Bytes of the storages of `keys` (`storage_key`s) alive now that were alive when `peak` was reached: those
        made by then (alive now, they were not freed since; a key reused since names a newer storage)."""
        return sum(self._live[k] for k in keys if k in self._live and self._ids[k] <= self._made_at_peak)

    def rebase(self, drop: set[int], keep: dict[int, int]) -> None:
        """Count on as if the storages in `drop` were freed now and those of `keep` (`storage_key` -> bytes) were
        alive, the peak restarting from here: a fused run's backward (autopp.measure.counting.count_piece), which
        keeps what fused kernels keep (those in `exclude` stay uncounted)."""
        for key in drop:
            self._free(key)
        self.now += sum(size for key, size in keep.items() if key not in self._live and key not in self._exclude)
        # what was added is held to the end (an upper bound): its storage (freed, its key reusable) is not watched
        self.peak, self._made_at_peak = self.now, self._made

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage_key(t)
            if key in inputs or key in self._live or key in self._exclude:
                continue
            self._made += 1
            self._live[key], self._ids[key] = storage.nbytes(), self._made
            self.now += storage.nbytes()
            weakref.finalize(storage, self._free, key)
            if self.now > self.peak:
                self.peak, self._made_at_peak = self.now, self._made
        return out


def live_peak(run: Callable[[], None]) -> int:
    """The most bytes of storages created during `run()` and alive at once (`LiveBytes`), Python's garbage collector
    held off while it runs (`peak_bytes` says why)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with LiveBytes() as live:
            run()
    finally:
        if enabled:
            gc.enable()
    return live.peak


def peak_bytes(device: torch.device, forward_backward: Callable[[], None]) -> int:
    """The most memory allocated during `forward_backward()`, above what was allocated before: on CUDA from the
    allocator's statistics, on CPU from `LiveBytes` (PEAK_HOW), with Python's garbage collector held off while it
    runs: a collection that the process's earlier allocations happen to trigger inside the run would free reference
    cycles (autograd's among them) at a moment no other run shares, and the head's slices (autopp.measure.head),
    extrapolated k-fold, turned such a moment into a peak 21 % off; so a cycle is counted until the run ends, as a
    run without a collection holds it."""
    if device.type != "cuda":
        return live_peak(forward_backward)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward_backward()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


class SavedOps(TorchDispatchMode):
    """What selective recomputation keeps of a forward run under it (autopp.schedule.activation): the outputs of the
    ops in `SAVED_OPS`, as torch's selective checkpoint context caches them (`bytes`: their distinct storages,
    those in `exclude` left out; `outputs`: in the order the ops ran, for `ReplaySaved`). Real and fake tensors
    alike, so the measured profile and the analytic count share it."""

    def __init__(self, exclude: set[int] | frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.exclude = exclude
        self.outputs: list[Any] = []
        self.seen: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if str(func.overloadpacket) in SAVED_OPS:
            self.outputs.append(out)
            for t in tensors_in(out):
                if storage_key(t) not in self.exclude:
                    self.seen[storage_key(t)] = t.untyped_storage().nbytes()
        return out

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


class ReplaySaved(TorchDispatchMode):
    """A forward as selective recomputation reruns it: the ops in `SAVED_OPS` hand back `outputs` (a `SavedOps`
    record of the same forward, in order) instead of running; every other op runs (and reaches the modes below,
    e.g. the analytic count's)."""

    def __init__(self, outputs: list[Any]) -> None:
        super().__init__()
        self.outputs = list(outputs)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func.overloadpacket) in SAVED_OPS and self.outputs:
            return self.outputs.pop(0)
        return func(*args, **(kwargs or {}))
