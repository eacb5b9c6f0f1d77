"""Bytes a unit holds: the live-storage tracker that gives the peak on CPU, and the saved-tensor count."""

from __future__ import annotations

import gc

import pytest
import torch

from autopp.data.precision import RECIPES
from autopp.measure.memory import LiveBytes, peak_bytes, saved_bytes, static_bytes, storage_key


def test_live_bytes_counts_new_storages_until_freed() -> None:
    a = torch.ones(100)  # made before: not counted
    with LiveBytes() as live:
        b = a * 2  # 400 bytes
        c = b + 1  # 400 more
        view = c.view(10, 10)  # a view: nothing new
        c.add_(1)  # in place: nothing new
        assert live.now == live.peak == 800
        del b
        assert live.now == 400  # freed when Python drops the storage
        d = view.sum()  # 4 bytes
    assert (live.now, live.peak) == (404, 800)
    del c, view, d


def test_cpu_peak_of_a_forward_and_backward() -> None:
    """A Linear(64, 32) without bias on 8 rows: the output, its gradient (ones), the weight's gradient and the
    input's: what autograd allocates, each storage counted once."""
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64, requires_grad=True)

    def forward_backward() -> None:
        out = lin(x)
        out.backward(torch.ones_like(out))
    peak = peak_bytes(torch.device("cpu"), forward_backward)
    output, weight_grad, input_grad = 8 * 32 * 4, 64 * 32 * 4, 8 * 64 * 4
    assert output + weight_grad + input_grad <= peak <= 2 * output + weight_grad + input_grad + 64 * 32 * 4


@pytest.mark.integration  # about half a second: the unit tier stays under a minute
def test_saved_bytes_holds_no_tensor_after_counting() -> None:
    """A saved output kept with its grad_fn would be a cycle through autograd's C++ graph that gc cannot free."""
    def graphs() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.grad_fn is not None)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    params = {storage_key(p) for p in lin.parameters()}
    before = graphs()
    out, n = saved_bytes(lambda: torch.relu(lin(x)), params)
    assert n == 2 * 4 * 16 * 4  # Linear saves its input, ReLU its output
    del out
    assert graphs() == before


def test_storages_of_fake_tensors_are_told_apart() -> None:
    """Fake tensors have no data pointer: storages are keyed by `storage_key`, so two fake tensors count twice and a
    view of one adds nothing (analytic profiles count with the same functions as measured ones)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from autopp.measure.memory import storage_bytes, value_bytes
    with FakeTensorMode():
        a, b = torch.ones(10), torch.ones(20)
        assert storage_bytes([a, b, a.view(2, 5)]) == value_bytes({"x": (a, [b])}) == 30 * 4
        w = torch.ones(2, 4, requires_grad=True)
        _, saved = saved_bytes(lambda: torch.relu(a.view(2, 5) @ torch.ones(5, 4)) * w, {storage_key(w)})
    assert saved > 0


def test_selective_recomputation_keeps_the_saved_ops_outputs_and_replays_the_rest() -> None:
    """`SavedOps` records the matmul's output (3 x 5 floats, the parameter-free input left out); `ReplaySaved` hands
    it back, so a rerun forward reaches the modes below it with the ReLU only, and gives the same result."""
    from collections import Counter

    from autopp.measure.memory import ReplaySaved, SavedOps

    from ..opcount import OpCount as Count

    x, w = torch.randn(3, 4), torch.randn(4, 5)
    with SavedOps({storage_key(w)}) as kept:
        want = torch.mm(x, w).relu()
    assert kept.bytes == 3 * 5 * 4 and len(kept.outputs) == 1
    with Count() as below, ReplaySaved(kept.outputs):
        got = torch.mm(x, w).relu()
    assert below.ops == Counter({"aten.relu": 1}) and torch.equal(got, want)


def test_static_bytes_follow_the_recipe() -> None:
    """bf16 weights with Adam: 2 + 4 (fp32 gradients) + 12 (master copy and two moments) bytes per parameter, the
    18 of Megatron's distributed-optimizer guide; float32: 4 + 4 + 8."""
    numel = 8 * 4 + 4
    layer = torch.nn.Linear(8, 4)
    assert static_bytes(layer, "adam", RECIPES["fp32"]) == {"param_bytes": 4 * numel, "grad_bytes": 4 * numel,
                                                            "optimizer_bytes": 8 * numel, "expert_param_bytes": 0,
                                                            "moe_layers": 0}
    half = static_bytes(layer.to(torch.bfloat16), "adam", RECIPES["bf16"])
    assert (half["param_bytes"], half["grad_bytes"], half["optimizer_bytes"]) == (2 * numel, 4 * numel, 12 * numel)
    assert static_bytes(layer, "adam", RECIPES["fp8"]) == half
    pure = static_bytes(layer.to(torch.bfloat16), "adam", RECIPES["bf16-pure"])  # no master: 2 + 2 + 2 x 2
    assert (pure["param_bytes"], pure["grad_bytes"], pure["optimizer_bytes"]) == (2 * numel, 2 * numel, 4 * numel)


def test_a_cpu_peak_does_not_depend_on_when_the_garbage_collector_runs() -> None:
    """A full-suite run measured the tiny Llama's head 21 % above its unsliced peak: a collection triggered by the
    earlier tests' allocations freed a reference cycle inside one slice's run. With the collector held off, a cycle
    that holds a tensor counts until the run ends, however eager the collector, and the collector is on after."""
    import gc

    def forward_backward() -> None:
        cycle: list[object] = [torch.ones(1024)]  # 4 KiB held by a reference cycle
        cycle.append(cycle)
        del cycle
        for _ in range(200):  # allocations enough to trigger a collection at threshold 1
            [object() for _ in range(10)]
        torch.ones(2048)  # 8 KiB while the cycle is garbage, not yet freed
    thresholds = gc.get_threshold()
    try:
        gc.set_threshold(1, 1, 1)
        eager = peak_bytes(torch.device("cpu"), forward_backward)
    finally:
        gc.set_threshold(*thresholds)
    assert eager == 4096 + 8192 and gc.isenabled()


def test_rebase_counts_on_from_what_is_kept() -> None:
    """A fused run's backward (autopp.measure.counting.count_piece): what is dropped stops counting (its later free
    takes nothing off), what is kept and not live is added, and the peak restarts from there."""
    with LiveBytes() as live:
        a, b = torch.ones(100), torch.ones(50)
        assert (live.now, live.peak) == (600, 600)
        live.rebase({storage_key(a)}, {storage_key(b): 200, -1: 8})
        assert (live.now, live.peak) == (208, 208)
        del a
        c = torch.ones(25)
        assert (live.now, live.peak) == (308, 308)
    assert c.numel() == 25 and b.numel() == 50
