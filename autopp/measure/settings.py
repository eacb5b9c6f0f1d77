"""A measurement's options (ProfileOptions, MeasureOptions) with what they derive (the run budget, the timer), passed
down to every measurement, and the progress bar it reports through."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..model.contract import ModelFile
from .corun import co_running
from .options import MeasureOptions, ProfileOptions
from .timing import Budget, Timer

__all__ = ["Progress", "Settings", "Overall", "progress_bar"]

Progress = Callable[[str], None]


class Overall:
    """One progress line for a whole profile (issue 26: the bar restarted at every unit, with no ETA): the share of
    the work done and the time left at the rate so far. The work is walks of the model, `phases` their weights (one
    per microbatch size, its size; again per tensor-parallel degree t, size / t), and within a walk each measured
    piece weighs its parameter bytes: a transformer piece's compute grows with both. `now` is a display clock only."""

    def __init__(self, progress: Progress, phases: list[float], now: Callable[[], float] = time.monotonic) -> None:
        self.progress, self.phases, self.now = progress, phases, now
        self.start, self.phase = now(), -1

    @classmethod
    def counting(cls, progress: Progress, walks: int, now: Callable[[], float] = time.monotonic) -> Overall:
        """The analytic profile's line over `walks` walks of the model (each size, then each size again per TP
        degree), weighed the same: counting on fake tensors costs per op, whatever the size or the shard."""
        return cls(progress, [1.0] * max(walks, 1), now)

    def next_phase(self) -> None:
        """A walk of the model begins."""
        self.phase += 1

    def fraction(self, within: float) -> float:
        """The share of the whole profile done when the current walk is `within` (0-1) done."""
        k = min(max(self.phase, 0), len(self.phases) - 1)
        done = sum(self.phases[:k]) + self.phases[k] * min(max(within, 0.0), 1.0)
        return min(done / max(sum(self.phases), 1), 1.0)

    def line(self, within: float, text: str) -> str:
        """`[####....] 37%, about 4 min left: text` (the time left once a share is done to extrapolate from)."""
        f = self.fraction(within)
        left = (self.now() - self.start) * (1 - f) / f if f >= 0.01 else None
        eta = f", about {_duration(left)} left" if left is not None else ""
        return f"{progress_bar(round(f * 1000), 1000, '')}{f:.0%}{eta}: {text}"

    def __call__(self, within: float, text: str) -> None:
        self.progress(self.line(within, text))


def _duration(seconds: float) -> str:
    """A time left, rounded as people say it: 40 s, 3 min, 1.5 h."""
    if seconds < 90:
        return f"{max(round(seconds), 1)} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


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


def progress_bar(done: int, total: int, text: str, width: int = 20) -> str:
    """`[#####...............] text`, filled `done / total`."""
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {text}"
