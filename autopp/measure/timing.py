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

from .memory import tensors_in

__all__ = ["KINDS", "Clock", "Timer", "Budget", "Piece", "outputs_and_grads", "backward", "time_pieces",
           "summarize"]

#: Kinds of timed sample kept per unit: forward, full backward, input-gradient, weight-gradient, forward without saving.
KINDS = ("forward", "backward", "backward_input", "backward_weight", "recompute")

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
        """One forward and full backward (for the peak memory on CUDA)."""
        _, out = self.forward()
        backward(*outputs_and_grads(out))



def outputs_and_grads(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors of `out` that need a gradient, and a gradient of ones for each."""
    outs = [t for t in tensors_in(out) if t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


def backward(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Backward from `outs` with `grads` (nothing when no output needs a gradient)."""
    if outs:
        torch.autograd.backward(outs, grads)


def _input_then_weight(piece: Piece, leaves: tuple[Any, ...], out: Any) -> bool:
    """Whether the piece's backward splits into input then weight gradients: like torch's first stage, a unit none
    of whose inputs needs a gradient runs one full backward, counted as weight time."""
    return not (piece.first or not outputs_and_grads(out)[0]
                or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves))


def time_pieces(pieces: Sequence[Piece], budget: Budget, clock: Timer, progress: Callable[[int], None]
                ) -> list[dict[str, list[float]]]:
    """Timed samples of each kind in KINDS, per piece. Each run times every piece in model order, as a pipeline
    stage runs them: forward through all pieces then full backward in reverse order; forward again, then
    input-gradient backward in reverse order (torch's `stage_backward_input`, graph kept), then weight-gradient
    backward in reverse order (`stage_backward_weight`), as zero-bubble schedules compute them; then forward
    without grad (recompute). Timing the pieces one after another rather than each in a loop of its own leaves the
    caches as a pipeline stage finds them: a unit timed in a tight loop finds its weights in the last-level cache,
    which a stage running the model's other units in between does not (examples/mlp.py: sum of forwards 0.8 ms in
    tight loops vs 3.4 ms with the cache flushed, at microbatch 2 on a 32 MiB L3)."""
    samples: list[dict[str, list[float]]] = [{k: [] for k in KINDS} for _ in pieces]
    n = len(pieces)
    for run, timed in enumerate(budget.runs()):
        progress(run)

        def keep(i: int, kind: str, value: float) -> None:
            if timed:
                samples[i][kind].append(value)

        forwards = []
        for i, piece in enumerate(pieces):
            forward, f = clock.time(piece.forward)
            keep(i, "forward", f)
            forwards.append(forward)
        for i in reversed(range(n)):
            outs, grads = outputs_and_grads(forwards[i][1])
            keep(i, "backward", clock.time(lambda: backward(outs, grads))[1])
        forwards = [piece.forward() for piece in pieces]
        groups: dict[int, Any] = {}
        for i in reversed(range(n)):
            (leaves, out), piece = forwards[i], pieces[i]
            outs, grads = outputs_and_grads(out)
            if not _input_then_weight(piece, leaves, out):
                keep(i, "backward_input", 0.0)
                keep(i, "backward_weight", clock.time(lambda: backward(outs, grads))[1])
                continue
            params = list(piece.module.parameters())
            (_, groups[i]), t = clock.time(lambda: stage_backward_input(outs, grads, list(leaves), iter(params)))
            keep(i, "backward_input", t)
        for i in reversed(sorted(groups)):
            params = list(pieces[i].module.parameters())
            keep(i, "backward_weight", clock.time(lambda: stage_backward_weight(iter(params), groups[i]))[1])
        forwards, groups = [], {}  # free the graphs before the no-grad forwards
        with torch.no_grad():
            for i, piece in enumerate(pieces):
                keep(i, "recompute", clock.time(piece.forward)[1])
    return samples


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    """Per kind, the median (`KIND_s`) and the spread (`KIND_spread_s`) of the samples."""
    row = {}
    for kind, values in samples.items():
        row[f"{kind}_s"] = statistics.median(values)
        row[f"{kind}_spread_s"] = max(values) - min(values)
    return row
