"""Per-rank measurement inside a step: when each F/I/W/B ran, time spent waiting for communication, peak memory.

Action timing wraps each stage's `forward_one_chunk` (F, with the last stage's loss: `StepRecorder.timed_loss`),
`backward_one_chunk` (B, or I when `full_backward=False`) and `backward_weight_one_chunk` (W); waits wrap torch's
private `schedules._wait_batch_p2p`, through which every schedule waits for its sends and receives. Peak memory is
`torch.cuda.max_memory_allocated` on a GPU. On CPU (`cpu_memory_method`), where no tensor of the step is a DTensor
(tp 1, cp 1, ep 1, ZeRO 0), "live": parameters + optimizer state + the most bytes of live storages that torch's
operators created during one step (`autopp.measure.memory.LiveBytes`, as the profiler measures a unit's peak:
activations, the stage's outputs torch keeps, gradients, temporaries); otherwise "estimate": parameters + gradients +
optimizer state plus the peak of the bytes autograd keeps saved for backward (saved-tensor hooks, each storage
counted once, parameters excluded), the held model without outputs and temporaries. With ZeRO 1/3 the static part
follows the planner's terms per unit, P + P/d + G + O/d (docs/parallelism.md), and FSDP2's gathered parameters are
parameters, not saved activations.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.tensor import DTensor

from ..data.layout import Layout
from ..data.zero import NO_ZERO, ZeroStage
from ..measure.memory import live_peak, storage_key
from .parallel import local

__all__ = ["ActionRecord", "StepRecorder", "SavedBytes", "static_bytes", "record_waits", "cpu_memory_method",
           "probe_peak"]


@dataclass
class ActionRecord:
    """One compute action on this rank: torch's text (e.g. `1I0`), start and end in seconds from the step start."""

    action: str
    start_s: float
    end_s: float


@dataclass
class StepRecorder:
    """Collects the actions and communication waits of the current step of this rank's stages."""

    t0: float = 0.0
    actions: list[ActionRecord] = field(default_factory=list)
    waits: list[tuple[float, float]] = field(default_factory=list)

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.actions, self.waits = [], []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wrap_stages(self, stages: Sequence[Any]) -> None:
        """Time every F, I/B and W the schedule calls on `stages` (instance attributes shadow the methods)."""
        for stage in stages:
            self._wrap_stage(stage, stage.stage_index)

    def _wrap_stage(self, stage: Any, s: int) -> None:
        stage.forward_one_chunk = self._timed(stage.forward_one_chunk, lambda a, k: f"{s}F{a[0]}")
        stage.backward_one_chunk = self._timed(stage.backward_one_chunk, lambda a, k: (
            f"{s}{'B' if k.get('full_backward', True) else 'I'}{a[0]}"))
        stage.backward_weight_one_chunk = self._timed(stage.backward_weight_one_chunk, lambda a, k: f"{s}W{a[0]}")

    def _timed(self, fn: Callable[..., Any], name: Callable[[tuple[Any, ...], dict[str, Any]], str]
               ) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.actions.append(ActionRecord(name(args, kwargs), start, self.now()))
        return timed

    def timed_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """`loss_fn` with its time counted in the F action it follows. torch's schedules compute a last stage's loss
        after `forward_one_chunk` returns (`_maybe_compute_loss`), outside the timed F, while the profile times the
        last unit's forward with the loss in it (autopp.measure.timing, `Piece.finish`): examples/gpt.py's loss (a
        softmax over 8192 logits per token) is about as long as its head's matmul, so a last stage's F read 0.6-0.9x
        its prediction. Extending that F to the loss's end measures like with like (docs/splits.md)."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            try:
                return loss_fn(*args, **kwargs)
            finally:
                if self.actions and "F" in self.actions[-1].action:
                    self.actions[-1].end_s = self.now()
        return timed

    @property
    def wait_s(self) -> float:
        return sum(end - start for start, end in self.waits)


@contextlib.contextmanager
def record_waits(recorder: StepRecorder) -> Iterator[None]:
    """Time each wait for a batch of sends/receives (torch's private `_wait_batch_p2p`) while inside."""
    original = _torch_schedules._wait_batch_p2p

    def waited(work: Any) -> Any:
        start = recorder.now()
        try:
            return original(work)
        finally:
            recorder.waits.append((start, recorder.now()))

    _torch_schedules._wait_batch_p2p = waited
    try:
        yield
    finally:
        _torch_schedules._wait_batch_p2p = original


class _Saved:
    """A saved tensor wrapped so that its release (the autograd node freeing it) can be observed."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedBytes:
    """Bytes autograd holds saved for backward, now and at peak; storages shared by several saves count once."""

    def __init__(self, params: Sequence[torch.Tensor], modules: Sequence[torch.nn.Module] = ()) -> None:
        """`params` are never counted; nor are the parameters registered on `modules` when a tensor is saved (FSDP2
        registers a unit's gathered parameters only while it computes: ZeRO's parameters, not activations)."""
        self.exclude = {_storage_key(p) for p in params}
        self.modules = tuple(modules)
        self.live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.current

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        own = local(t)  # a DTensor's rank-local shard: its wrapper reports the global tensor's bytes
        key = _storage_key(own)
        if key is None or key in self.exclude or key in self._registered():
            return t
        entry = self.live.setdefault(key, [0, own.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, key)
        return saved

    def _registered(self) -> set[int | None]:
        """Storages of the parameters now registered on `self.modules` (local shards of DTensors)."""
        return {_storage_key(local(p)) for m in self.modules for p in m.parameters()}

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]


def _storage_key(t: torch.Tensor) -> int | None:
    """autopp.measure.memory.storage_key, None for tensors without a storage (sparse, some subclasses)."""
    try:
        return storage_key(t)
    except (RuntimeError, NotImplementedError):
        return None


def static_bytes(params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 zero: ZeroStage = NO_ZERO) -> int:
    """Replicated: parameters + gradients (one per parameter) + optimizer state tensors, of the rank's own (tensor-
    parallel) shards. ZeRO 1/3 (`params` are FSDP2 shards over the mesh's "dp" dimension): the planner's terms,
    P + P/d + G + O/d (docs/parallelism.md): the whole parameters and gradients torch's pipeline stages hold during
    the step, the rank's parameter shard, and the optimizer state of that shard."""
    shard = sum(_nbytes(local(p)) for p in params)
    state = sum(_nbytes(local(v)) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    if zero.replicated:
        return 2 * shard + state
    whole = sum(_unsharded_bytes(p) for p in params)
    return whole + shard + whole + state


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def _unsharded_bytes(p: torch.Tensor) -> int:
    """Bytes of `p` gathered over the data-parallel ("dp") mesh dimension only: its tensor-parallel shard stays."""
    if not isinstance(p, DTensor):
        return _nbytes(p)
    names = p.device_mesh.mesh_dim_names or ()
    tp = 1
    for i, placement in enumerate(p.placements):
        if placement.is_shard() and i < len(names) and names[i] == "tp":
            tp *= p.device_mesh.size(i)
    return _nbytes(p) // tp


def cpu_memory_method(layout: Layout) -> str:
    """How a CPU rank's peak is found (the report's `memory_method`): "live" where the step's tensors are plain ones
    (tp 1, cp 1, ep 1, ZeRO 0), which `LiveBytes` sees whole; "estimate" where DTensors (tensor, context and expert
    parallelism, FSDP2) hide their storages from a dispatch mode."""
    plain = layout.tp == 1 and layout.cp == 1 and layout.ep == 1 and layout.zero.replicated
    return "live" if plain else "estimate"


def probe_peak(step: Callable[[], None], method: str, saved: SavedBytes, params: Sequence[torch.nn.Parameter],
               optimizer: torch.optim.Optimizer, zero: ZeroStage) -> int:
    """A CPU rank's peak over one extra, untimed `step()` (its gradients made anew: none may exist before it) by
    `method` (`cpu_memory_method`): "live", parameters + optimizer state + the most bytes of storages created during
    it and alive at once (the gradients among them), Python's garbage collector held off as the profiler holds it
    (`autopp.measure.memory.peak_bytes`); "estimate", `static_bytes` + the peak of the bytes saved for backward."""
    saved.reset_peak()
    if method == "live":
        if any(p.grad is not None for p in params):
            raise RuntimeError("a live memory probe needs the step's gradients made within it: zero_grad first")
        peak = live_peak(step)
        state = sum(_nbytes(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        return sum(_nbytes(p) for p in params) + state + peak
    with saved.hooks():
        step()
    return static_bytes(params, optimizer, zero) + saved.peak
