"""One progress line with the share of the work done and the time left (issue 26: the bars restarted and gave no
time left), for the profilers and for CP-SAT's solves; torch-free, so the planning core reports through it too."""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["Progress", "Overall", "progress_bar", "share_line", "timed_line", "PROGRESS_LOG"]

Progress = Callable[[str], None]

#: The logger the planning core reports its progress lines on, at INFO (the command line shows them on its
#: progress line): a solve takes no callback through every layer above it.
PROGRESS_LOG = "autopp.progress"


class Overall:
    """One progress line for a whole profile: the share of the work done and the time left at the rate so far. The
    work is walks of the model, `phases` their weights (a measurement: one per microbatch size, its size; again per
    tensor-parallel degree t, size / t; a count: each walk the same, `counting`), and within a walk each piece weighs
    its share of the walk. `now` is a display clock only."""

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
        """`[####....] 37%, about 4 min left: text`: the time left once there is a rate to extrapolate from, which
        with several walks is once the first is done. Within a walk the pieces weigh the same, but repeats of a
        piece already measured or counted cost next to nothing, so a first walk's rate says little (a tester: a
        count said "about 19 min left" at 1 % and took 3.5 min); the walks cost alike."""
        f = self.fraction(within)
        rated = f >= 0.01 and (self.phase >= 1 or len(self.phases) == 1)
        return share_line(f, (self.now() - self.start) * (1 - f) / f if rated else None, text)

    def __call__(self, within: float, text: str) -> None:
        self.progress(self.line(within, text))


def timed_line(elapsed_s: float, limit_s: float, text: str) -> str:
    """A time-limited solve's line (CP-SAT's): the share of its limit spent, and the rest of the limit as the time
    left (it may stop sooner, with a proof of optimality)."""
    f = min(max(elapsed_s / limit_s, 0.0), 1.0) if limit_s > 0 else 1.0
    return share_line(f, max(limit_s - elapsed_s, 0.0), text)


def share_line(f: float, left_s: float | None, text: str) -> str:
    """`[####....] 37%, about 4 min left: text`, the time left said when known."""
    eta = f", about {_duration(left_s)} left" if left_s is not None else ""
    return f"{progress_bar(round(f * 1000), 1000, '')}{f:.0%}{eta}: {text}"


def _duration(seconds: float) -> str:
    """A time left, rounded as people say it: 40 s, 3 min, 1.5 h."""
    if seconds < 90:
        return f"{max(round(seconds), 1)} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def progress_bar(done: int, total: int, text: str, width: int = 20) -> str:
    """`[#####...............] text`, filled `done / total`."""
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {text}"
