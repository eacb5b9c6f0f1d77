"""Per-rank memory estimate on CPU (autopp.run.instrument): ZeRO's static bytes follow the planner's terms, and
FSDP2's gathered parameters are not counted as saved activations (one process, a fake process group)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from autopp.data.zero import ZERO, ZeroStage
from autopp.run.instrument import SavedBytes, StepRecorder, static_bytes

#: nn.Linear(8, 16) in float32: weight 16 x 8 + bias 16.
P = (16 * 8 + 16) * 4


def _sharded(zero: ZeroStage) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(8, 16))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)),
                reshard_after_forward=bool(zero.fsdp_reshard_after_forward))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():  # one momentum buffer per (sharded) parameter, as after the first step
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)  # a DTensor, as SGD makes it
    return model, optimizer


def test_zero_static_bytes_are_the_planners_terms(fake_world: Callable[[int], None]) -> None:
    """Issue 17 review (b): the estimate was 2 x the local shard + optimizer state (P/d + P/d + O/d); the planner
    counts P + P/d + G + O/d per unit with ZeRO 1 (and 3 under torch pipelining: grads whole during the step)."""
    fake_world(2)
    for zero in (ZERO[1], ZERO[3]):
        model, optimizer = _sharded(zero)
        params = list(model.parameters())
        assert static_bytes(params, optimizer, zero) == P + P // 2 + P + P // 2
    plain = nn.Linear(8, 16)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    assert static_bytes(list(plain.parameters()), sgd) == 2 * P  # ZeRO 0: parameters + gradients, no state


def test_gathered_parameters_are_not_saved_activations(fake_world: Callable[[int], None]) -> None:
    """Issue 17 review (b): linear saves its (FSDP2-gathered) weight for backward; that is the P term above, not an
    activation: only the input (4 x 8 floats) is saved bytes."""
    fake_world(2)
    model, _ = _sharded(ZERO[3])
    x = torch.randn(4, 8, requires_grad=True)
    saved = SavedBytes(list(model.parameters()), [model])
    with saved.hooks():
        y = model(x)
    assert saved.peak == 4 * 8 * 4
    unaware = SavedBytes(list(model.parameters()))
    with unaware.hooks():
        y = model(x)
    assert unaware.peak > 4 * 8 * 4  # without the modules, the gathered weight's storage counts as saved
    del y


class _Stage:
    """A stage whose F and B advance a fake clock by 3 and 4 seconds."""

    stage_index = 1

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def forward_one_chunk(self, mb: int) -> float:
        self.clock[0] += 3.0
        return 10.0 * mb

    def backward_one_chunk(self, mb: int, full_backward: bool = True) -> None:
        self.clock[0] += 4.0

    def backward_weight_one_chunk(self, mb: int) -> None:
        self.clock[0] += 1.0


def test_the_last_stages_loss_is_timed_in_its_forward() -> None:
    """Issue 29 item 1: torch computes a last stage's loss after `forward_one_chunk`, outside the timed F, while the
    profile's last unit counts it in its forward: the run's F of gpt's head stage read 0.6-0.9x its prediction. The
    loss now extends the F it follows; after a backward it extends nothing."""
    clock = [0.0]
    recorder = StepRecorder()
    recorder.now = lambda: clock[0]  # type: ignore[method-assign]
    stage = _Stage(clock)
    recorder.wrap_stages([stage])

    def loss(out: float, target: float) -> float:
        clock[0] += 2.0
        return out - target

    timed = recorder.timed_loss(loss)
    assert timed(stage.forward_one_chunk(2), 5.0) == 15.0
    stage.backward_one_chunk(2)
    assert timed(1.0, 1.0) == 0.0  # not after a forward: the B keeps its end
    assert [(a.action, a.start_s, a.end_s) for a in recorder.actions] == [("1F2", 0.0, 5.0), ("1B2", 5.0, 9.0)]


def test_a_saved_dtensor_counts_its_ranks_shard(fake_world: Callable[[int], None]) -> None:
    """A DTensor autograd saves (the sharded logits under loss parallelism) counts the rank's local shard, not the
    global tensor its wrapper reports."""
    from torch.distributed.tensor import Shard, distribute_tensor

    fake_world(2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = distribute_tensor(torch.randn(8, 16, requires_grad=True), mesh, [Shard(1)])
    saved = SavedBytes([])
    with saved.hooks():
        y = x.exp()  # saves its output: a DTensor whose shard is 8 x 8 float32
    assert saved.peak == 8 * 8 * 4
    del y


def test_a_live_probe_sees_what_the_step_holds_beyond_what_autograd_saves() -> None:
    """On CPU a plain layout's peak is live: parameters + optimizer state + the most bytes created during the step
    and alive at once (here the input autograd saves, the output the step keeps as torch's stage keeps its outputs,
    and the weight's gradient); the estimate sees the saved input and the static bytes only, not the kept output.
    A layout with DTensors (tp, cp, ep, FSDP2) is estimated."""
    from autopp.data.layout import Layout
    from autopp.data.zero import NO_ZERO
    from autopp.run.instrument import cpu_memory_method, probe_peak

    lin = nn.Linear(256, 256, bias=False)
    params = list(lin.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    kept: list[torch.Tensor] = []

    def step() -> None:
        x = torch.randn(64, 256)
        out = lin(x)
        kept.append(out)  # held until after the backward
        out.sum().backward()
        kept.clear()

    kib = 1024
    live = probe_peak(step, "live", SavedBytes(params), params, optimizer, NO_ZERO)
    assert 256 * kib + (64 + 64 + 256) * kib <= live <= 256 * kib + (64 + 64 + 256) * kib + kib
    with pytest.raises(RuntimeError, match="zero_grad first"):  # the gradient would not be counted
        probe_peak(step, "live", SavedBytes(params), params, optimizer, NO_ZERO)
    optimizer.zero_grad()
    estimate = probe_peak(step, "estimate", SavedBytes(params), params, optimizer, NO_ZERO)
    assert estimate == 2 * 256 * kib + 64 * kib  # parameters, gradient, the saved input
    assert cpu_memory_method(Layout(pp=2, dp=2)) == "live"
    assert {cpu_memory_method(Layout(pp=2, dp=2, tp=2)), cpu_memory_method(Layout(dp=2, zero=ZERO[3])),
            cpu_memory_method(Layout(pp=2, dp=2, ep=2)), cpu_memory_method(Layout(pp=2, cp=2))} == {"estimate"}
