"""A clock that only moves when told to: the profiler reads it (`MeasureOptions(clock=CLOCK)`) and the layers of
ticking.py advance it, so profiled times are exact on a machine under any load."""

from __future__ import annotations

__all__ = ["FakeClock", "CLOCK"]


class FakeClock:
    """Seconds that advance only through `advance`."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        self.seconds += seconds


#: The one instance shared by the tests and ticking.py (a normal import, so one module however often the model file
#: itself is loaded).
CLOCK = FakeClock()
