"""A measurement's options (ProfileOptions, MeasureOptions) with what they derive (the run budget, the timer), passed
down to every measurement, and the progress line it reports through (autopp.progress)."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ..model.contract import ModelFile
from ..progress import Overall, Progress, progress_bar
from .corun import co_running
from .options import MeasureOptions, ProfileOptions
from .timing import Budget, Timer

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """What profile_model was asked for, passed down to the per-size measurement."""

    options: ProfileOptions
    measuring: MeasureOptions
    progress: Progress = lambda _msg: None
    overall: Overall | None = None
    """The profile's one progress line; None: each message as its own bar (`say`)."""

    def say(self, within: float, text: str, done: int, total: int) -> None:
        """Report progress: on the overall line at `within` of the current walk, else a bar of `done / total`."""
        if self.overall is not None:
            self.overall(within, text)
        else:
            self.progress(progress_bar(done, total, text))

    @property
    def budget(self) -> Budget:
        """How many times each piece runs, on the measurement's clock."""
        m = self.measuring
        return Budget(m.warmup, m.repeats, m.time_budget_s, m.clock or time.perf_counter)

    @property
    def timer(self) -> Timer:
        """Times a call on the measured device."""
        return Timer(torch.device(self.measuring.device), self.measuring.clock)

    def beside(self, mf: ModelFile, b: int) -> AbstractContextManager[None]:
        """Context for the timings at microbatch `b`: with `co_runners` processes training the model at `b`."""
        return co_running(mf.path, b, self.options.dtype, self.measuring.co_runners)

    def batch(self, mf: ModelFile, b: int) -> tuple[Any, Any]:
        """sample_batch(`b`) on the profiled device, floating-point tensors in the profiled dtype."""
        return _to(mf.sample_batch(b), self.timer.device, self.options.torch_dtype)


def _to(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device, dtype) for v in value)
    return value
