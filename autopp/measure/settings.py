"""What profile_model was asked for (optimizer, dtype, run budget, timer, co-runners), passed down to every
measurement, and the progress bar it reports through."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..model.contract import ModelFile
from .corun import co_running
from .options import DTYPES
from .timing import Budget, Timer

__all__ = ["Progress", "Settings", "progress_bar"]

Progress = Callable[[str], None]


@dataclass
class Settings:
    """What profile_model was asked for, passed down to the per-size measurement."""

    optimizer: str
    dtype: torch.dtype
    budget: Budget
    clock: Timer
    progress: Progress
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    co_runners: int = 0
    """Processes training the model beside the timing (autopp.measure.corun), as other ranks on one host do."""

    def beside(self, mf: ModelFile, b: int) -> AbstractContextManager[None]:
        """Context for the timings at microbatch `b`: with `co_runners` processes training the model at `b`."""
        name = next(k for k, v in DTYPES.items() if v == self.dtype)
        return co_running(mf.path, b, name, self.co_runners)

    def batch(self, mf: ModelFile, b: int) -> tuple[Any, Any]:
        """sample_batch(`b`) on the profiled device, floating-point tensors in the profiled dtype."""
        return _to(mf.sample_batch(b), self.clock.device, self.dtype)


def _to(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device, dtype) for v in value)
    return value


def progress_bar(done: int, total: int, text: str, width: int = 20) -> str:
    """`[#####...............] text`, filled `done / total`."""
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {text}"
