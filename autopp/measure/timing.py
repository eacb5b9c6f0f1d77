"""Time the pieces of a split model as a pipeline stage runs them: forward, full backward, input- then
weight-gradient backward, and forward without saving (recompute), each a median over timed runs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from .memory import ReplaySaved, SavedOps, tensors_in

__all__ = ["KINDS", "Clock", "Timer", "Budget", "Piece", "Phase", "outputs_and_grads", "backward", "splits_backward",
           "backward_input", "backward_weight", "run_phases", "time_pieces", "summarize"]

#: Kinds of timed sample kept per unit: forward, full backward, input-gradient, weight-gradient, forward without saving,
#: and the part of a forward that selective recomputation reruns (`selective_recompute`: the ops it does not keep).
KINDS = ("forward", "backward", "backward_input", "backward_weight", "recompute", "selective_recompute")

Clock = Callable[[], float]
"""Seconds from an arbitrary origin (time.perf_counter; tests inject a fake one that the model advances)."""



def _leaf_inputs(values: tuple[Any, ...], grad: Sequence[bool] | None = None) -> tuple[Any, ...]:
    """Detached copies of the inputs; floating-point ones require grad, like a received pipeline activation, unless
    `grad` says otherwise (the model's own inputs need no gradient)."""
    def leaf(v: Any, g: bool) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().requires_grad_(g and v.is_floating_point())
        return v
    return tuple(leaf(v, grad[i] if grad is not None else True) for i, v in enumerate(values))


@dataclass
class Timer:
    """Times a call: with `now` (the wall clock by default) on CPU; CUDA events (and a synchronize) on a GPU unless
    a clock was injected."""

    device: torch.device
    now: Clock | None = None
    """An injected clock; None: time.perf_counter, or CUDA events on a GPU."""

    def time(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """`fn()`'s result and how many seconds it took."""
        if self.device.type == "cuda" and self.now is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return result, start.elapsed_time(end) / 1e3
        now = self.now or time.perf_counter
        t0 = now()
        result = fn()
        return result, now() - t0


@dataclass(frozen=True)
class Budget:
    """How many times to run: `warmup` untimed, then timed until `repeats` runs or `seconds` spent (at least 1)."""

    warmup: int
    repeats: int
    seconds: float | None = None
    now: Clock = time.perf_counter
    """The clock that `seconds` is measured on (the timings' clock)."""

    def runs(self) -> Iterable[bool]:
        """Yields True for each timed run, False for each warm-up run."""
        for _ in range(self.warmup):
            yield False
        start = self.now()
        for i in range(self.repeats):
            if i and self.seconds is not None and self.now() - start >= self.seconds:
                return
            yield True


@dataclass
class Piece:
    """One unit's piece of the split model, with its real inputs and how to turn its output into what backward needs."""

    module: nn.Module
    args: tuple[Any, ...]
    finish: Callable[[Any], Any]  # output -> loss for the last unit, identity otherwise
    first: bool
    grad: tuple[bool, ...]  # per argument: whether it is an activation (needs a gradient) or a model input

    def forward(self) -> tuple[tuple[Any, ...], Any]:
        leaves = _leaf_inputs(self.args, self.grad)
        return leaves, self.finish(self.module(*leaves))

    def forward_backward(self) -> None:
        """One forward and full backward (for the peak memory), its gradients freed after."""
        _, out = self.forward()
        backward(*outputs_and_grads(out))
        _drop_grads(self)



def outputs_and_grads(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors of `out` that need a gradient, and a gradient of ones for each."""
    outs = [t for t in tensors_in(out) if t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


def backward(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Backward from `outs` with `grads` (nothing when no output needs a gradient)."""
    if outs:
        torch.autograd.backward(outs, grads)


def splits_backward(piece: Piece, leaves: tuple[Any, ...], out: Any) -> bool:
    """Whether the piece's backward splits into input then weight gradients: like torch's first stage, a unit none
    of whose inputs needs a gradient runs one full backward, counted as weight time."""
    return not (piece.first or not outputs_and_grads(out)[0]
                or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves))


def backward_input(outs: list[torch.Tensor], grads: list[torch.Tensor], leaves: tuple[Any, ...],
                   params: list[nn.Parameter]) -> Any:
    """Input gradients only, the graph kept (torch's private `stage_backward_input`, the one place it is called);
    returns what `backward_weight` needs."""
    return stage_backward_input(outs, grads, list(leaves), iter(params))[1]


def backward_weight(params: list[nn.Parameter], groups: Any) -> None:
    """The weight gradients after `backward_input` (torch's private `stage_backward_weight`)."""
    stage_backward_weight(iter(params), groups)


def _drop_grads(piece: Piece) -> None:
    """Free the piece's parameter gradients, so that the next backward makes one beside the weights instead of a
    second one accumulated into the first (a 2 GB embedding would need 6 GB)."""
    for p in piece.module.parameters():
        p.grad = None


Phase = Callable[[int, str, "Callable[[], Any] | None"], Any]
"""Runs one phase: (piece index, kind in KINDS, the phase or None where the piece has none) -> the phase's result."""


def run_phases(pieces: Sequence[Piece], phase: Phase) -> None:
    """One run of every piece through the phases of KINDS in the order a pipeline stage runs them, each through
    `phase`: forward through all pieces then full backward in reverse order; forward again (not a phase), then
    input-gradient backward in reverse order (graph kept), then weight-gradient backward in reverse order, as
    zero-bubble schedules compute them (a piece whose backward does not split: no input phase, its full backward
    as the weight phase); then forward without grad (recompute); then, per piece, what selective recomputation
    reruns: a forward whose kept ops (`SAVED_OPS`, recorded by an untimed forward) hand back their outputs
    (`ReplaySaved`). Gradients are dropped after each backward."""
    n = len(pieces)
    forwards = [phase(i, "forward", piece.forward) for i, piece in enumerate(pieces)]
    for i in reversed(range(n)):
        outs, grads = outputs_and_grads(forwards[i][1])
        phase(i, "backward", lambda: backward(outs, grads))
        _drop_grads(pieces[i])
    forwards = [piece.forward() for piece in pieces]
    groups: dict[int, Any] = {}
    for i in reversed(range(n)):
        (leaves, out), piece = forwards[i], pieces[i]
        outs, grads = outputs_and_grads(out)
        params = list(piece.module.parameters())
        if splits_backward(piece, leaves, out):
            groups[i] = phase(i, "backward_input", lambda: backward_input(outs, grads, leaves, params))
            continue
        phase(i, "backward_input", None)
        phase(i, "backward_weight", lambda: backward(outs, grads))
        _drop_grads(piece)
    for i in reversed(sorted(groups)):
        params = list(pieces[i].module.parameters())
        phase(i, "backward_weight", lambda: backward_weight(params, groups[i]))
        _drop_grads(pieces[i])
    forwards, groups = [], {}  # free the graphs before the no-grad forwards
    with torch.no_grad():
        for i, piece in enumerate(pieces):
            phase(i, "recompute", piece.forward)
        for i, piece in enumerate(pieces):
            with SavedOps() as kept:
                piece.forward()
            phase(i, "selective_recompute", lambda: _replayed(piece, kept.outputs))


def _replayed(piece: Piece, outputs: list[Any]) -> Any:
    with ReplaySaved(outputs):
        return piece.forward()


def time_pieces(pieces: Sequence[Piece], budget: Budget, clock: Timer, progress: Callable[[int], None]
                ) -> list[dict[str, list[float]]]:
    """Timed samples of each kind in KINDS, per piece: each run times every piece in model order, as a pipeline
    stage runs them (`run_phases`; a phase a piece lacks takes 0). Timing the pieces one after another rather than
    each in a loop of its own leaves the caches as a pipeline stage finds them: a unit timed in a tight loop finds
    its weights in the last-level cache, which a stage running the model's other units in between does not
    (examples/mlp.py: sum of forwards 0.8 ms in tight loops vs 3.4 ms with the cache flushed, at microbatch 2 on a
    32 MiB L3)."""
    samples: list[dict[str, list[float]]] = [{k: [] for k in KINDS} for _ in pieces]
    for run, timed in enumerate(budget.runs()):
        progress(run)

        def timed_phase(i: int, kind: str, fn: Callable[[], Any] | None) -> Any:
            result, t = clock.time(fn) if fn is not None else (None, 0.0)
            if timed:
                samples[i][kind].append(t)
            return result
        run_phases(pieces, timed_phase)
    return samples


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    """Per kind, the median (`KIND_s`) and the spread (`KIND_spread_s`) of the samples."""
    row = {}
    for kind, values in samples.items():
        row[f"{kind}_s"] = statistics.median(values)
        row[f"{kind}_spread_s"] = max(values) - min(values)
    return row
