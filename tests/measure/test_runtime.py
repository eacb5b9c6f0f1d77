"""torch's pipelining runtime's own time per action (autopp.measure.runtime), measured in a one-rank gloo group."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from autopp.measure.runtime import runtime_cost
from autopp.measure.timing import Budget, Timer


def test_forward_one_chunk_and_backward_one_chunk_cost_more_than_the_compute_they_run() -> None:
    cost = runtime_cost(Timer(torch.device("cpu")), Budget(warmup=1, repeats=5))
    assert cost is not None
    # the median action minus the median bare call of the same Linear(8, 8): torch's bookkeeping is more than none
    assert cost.forward_s > 0 and cost.backward_s > 0
    assert not dist.is_initialized()  # the one-rank group it made is gone


def test_no_cost_is_measured_for_a_gpu() -> None:
    timer = Timer(torch.device("cuda"), now=time.perf_counter)
    assert runtime_cost(timer, Budget(warmup=0, repeats=1)) is None
