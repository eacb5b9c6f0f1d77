"""torch's pipelining runtime's own time per action (autopp.measure.runtime), measured in a one-rank gloo group."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from autopp.measure import runtime
from autopp.measure.runtime import runtime_cost
from autopp.measure.timing import Budget, Timer


def test_forward_one_chunk_and_backward_one_chunk_cost_more_than_the_compute_they_run() -> None:
    """The median action minus the median bare call of the same Linear(8, 8): torch's bookkeeping is more than none.
    A measurement: on a machine loaded by other processes one of 5 repeats' medians came out 0 (clamped) once, so
    three measurements are allowed to show it."""
    for _ in range(3):
        cost = runtime_cost(Timer(torch.device("cpu")), Budget(warmup=1, repeats=5))
        assert cost is not None
        assert not dist.is_initialized()  # the one-rank group it made is gone
        if cost.forward_s > 0 and cost.backward_s > 0:
            break
    assert cost.forward_s > 0 and cost.backward_s > 0


class _WakingClock:
    """Advances 1 ms per reading, and 1 s more within the first call timed after a sleep (a cold action)."""

    def __init__(self) -> None:
        self.t, self.after_sleep = 0.0, -1

    def sleep(self, _seconds: float) -> None:
        self.after_sleep = 0

    def __call__(self) -> float:
        self.t += 1e-3
        if self.after_sleep >= 0:
            self.after_sleep += 1
            if self.after_sleep == 2:  # the reading that ends the first timed call after the sleep
                self.t, self.after_sleep = self.t + 1.0, -1
        return self.t


def test_the_resume_cost_is_an_action_after_a_sleep_minus_the_same_action_right_after_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _WakingClock()
    monkeypatch.setattr(runtime.time, "sleep", clock.sleep)
    cost = runtime.runtime_cost(Timer(torch.device("cpu"), now=clock), Budget(warmup=0, repeats=2))
    assert cost is not None and cost.resume_s == pytest.approx(1.0)


def test_no_cost_is_measured_for_a_gpu() -> None:
    timer = Timer(torch.device("cuda"), now=time.perf_counter)
    assert runtime_cost(timer, Budget(warmup=0, repeats=1)) is None
