"""FLOPs and bytes of grouped matmuls (autopp.measure.counting): `aten._grouped_mm` counted on fake tensors equals
the sum of its groups' matmuls counted by torch on real ones; the expert weights a few routed rows leave unread; the
share of a causal attention its kernel computes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autopp.measure.counting import (CPU_TILES, GPU_TILES, OpCounter, Tiles, causal_computed,
                                     expert_weight_bytes_unread)
from autopp.model.fake import fake_mode, faking

from ..model.test_fake import CASES, OFFS, _operands


def _per_group_flops(case: str) -> int:
    """torch's own count of the case's groups, each a plain matmul of its slice (real tensors, real offsets)."""
    a, b, offs = _operands(case)
    bounds = list(zip((0, *OFFS[:-1]), OFFS))
    with FlopCounterMode(display=False) as counter:
        if offs is None:
            torch.bmm(a, b)
        elif a.dim() == 2 and b.dim() == 3:
            for g, (lo, hi) in enumerate(bounds):
                a[lo:hi] @ b[g]
        elif a.dim() == 2:
            for lo, hi in bounds:
                a[:, lo:hi] @ b[lo:hi]
        else:
            for g, (lo, hi) in enumerate(bounds):
                a[g] @ b[:, lo:hi]
    return counter.get_total_flops()


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_mm_flops_are_the_sum_of_its_groups_matmuls(case: str) -> None:
    mode = fake_mode()
    with faking(mode):
        a, b, offs = _operands(case)
        with OpCounter() as counter:
            torch._grouped_mm(a, b, offs=offs)
    assert counter.flops == [_per_group_flops(case)]
    assert counter.flops[0] > 0
    assert counter.linear == [True]  # experts' GEMMs: FP8 under the fp8 recipe, as dense linear layers


def test_backward_of_an_expert_layer_counts_both_gradients() -> None:
    # d input: (S, N) x (G, N, K) grouped by rows; d weight: (K, S) x (S, N), the contraction grouped: 2 S K N each.
    mode = fake_mode()
    with faking(mode):
        a, b = torch.randn(16, 8, requires_grad=True), torch.randn(4, 8, 12, requires_grad=True)
        out = torch._grouped_mm(a, b, offs=torch.tensor(OFFS, dtype=torch.int32))
        with OpCounter() as counter:
            out.backward(torch.ones_like(out))
    assert sorted(f for f in counter.flops if f) == [2 * 16 * 8 * 12] * 2


@pytest.mark.parametrize("rows, unread_experts", [(1, 7), (5, 3), (8, 0), (64, 0)])
def test_few_routed_rows_leave_expert_weights_unread(rows: int, unread_experts: int) -> None:
    # Balanced routing: `rows` routed pairs reach min(8, rows) of the 8 experts; the others' weights are not read.
    weight = torch.empty(8, 32, 16, device="meta")
    per_expert = 32 * 16 * 4
    args = (torch.empty(rows, 32, device="meta"), weight)
    assert expert_weight_bytes_unread("aten::_grouped_mm", args) == unread_experts * per_expert
    assert expert_weight_bytes_unread("aten::mm", args) == 0


def test_counted_bytes_of_a_grouped_mm_leave_out_idle_experts() -> None:
    mode = fake_mode()
    with faking(mode):
        a, b = torch.randn(2, 8), torch.randn(4, 8, 12)  # 2 routed rows: 2 of the 4 experts' weights read
        offs = torch.tensor((1, 2, 2, 2), dtype=torch.int32)
        with OpCounter() as counter:
            torch._grouped_mm(a, b, offs=offs)
    assert counter.bytes == [(2 * 8 + 2 * 8 * 12 + 4 + 2 * 12) * 4]


def test_linear_layers_matmuls_are_flagged_and_attention_is_not() -> None:
    """A linear layer's forward (addmm) and both gradients (mm) are the ops an FP8 recipe runs in FP8; a batched
    matmul (attention scores) and scaled_dot_product_attention are not."""
    linear = torch.nn.Linear(16, 32)
    x = torch.randn(2, 8, 16, requires_grad=True)
    with OpCounter() as counter:
        linear(x).sum().backward()
    assert [f for f, flag in zip(counter.flops, counter.linear) if flag] == [2 * 16 * 16 * 32] * 3
    assert counter.counts().linear == tuple(counter.linear)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with OpCounter() as counter:
        (torch.matmul(q, q.transpose(-1, -2)).sum() + torch.nn.functional.scaled_dot_product_attention(q, q, q).sum()
         ).backward()
    assert sum(counter.flops) > 0 and not any(counter.linear)


def test_metadata_checks_move_nothing() -> None:
    # was: torch.export's dtype/device check `_assert_tensor_metadata` charged its input's bytes, 0.69 ms of a
    # Qwen3-30B-A3B MoE layer's 10.55 ms forward on the H100 roofline (microbatch 4 x 4,096 tokens)
    mode = fake_mode()
    with faking(mode):
        x = torch.randn(64, 64)
        with OpCounter() as counter:
            torch.ops.aten._assert_tensor_metadata(x, dtype=torch.float32, device=x.device)
            x + x
    assert counter.bytes == [3 * 64 * 64 * 4]  # the addition's two inputs and output only


def test_expert_gemms_record_the_expert_weight_bytes_they_move() -> None:
    """Issue 30 (expert GEMMs under ep): per op, the stacked weights' bytes an expert GEMM reads (forward, input
    gradient) or writes (the weights' gradient), part of its bytes; 0 for every other op. `OpCounts.experts` sums
    the expert GEMMs' FLOPs, weight bytes and other bytes apart."""
    mode = fake_mode()
    with faking(mode):
        a, b = torch.randn(16, 8, requires_grad=True), torch.randn(4, 8, 12, requires_grad=True)
        offs = torch.tensor(OFFS, dtype=torch.int32)
        with OpCounter() as forward:
            out = torch._grouped_mm(a, b, offs=offs)
            scaled = out * 2
        with OpCounter() as backward:
            scaled.backward(torch.ones_like(scaled))
    weight = 4 * 8 * 12 * 4  # float32 (G, K, N)
    assert forward.expert_weight == [weight, 0]
    assert forward.bytes[0] == weight + (16 * 8 + 16 * 12) * 4 + 4 * 4  # rows in, rows out, the offsets
    assert sorted(w for w in backward.expert_weight if w) == [weight, weight]  # reads W (d input), writes dW
    flops, weight_bytes, other = forward.counts().experts()
    assert (flops, weight_bytes, other) == (2 * 16 * 8 * 12, weight, forward.bytes[0] - weight)
    assert forward.counts().experts(2.0)[0] == flops / 2  # FP8: a linear matmul at twice the phase's peak


def test_few_routed_rows_leave_expert_weights_out_of_the_expert_bytes() -> None:
    mode = fake_mode()
    with faking(mode):
        a, b = torch.randn(2, 8), torch.randn(4, 8, 12)  # 2 routed rows: 2 of the 4 experts' weights read
        with OpCounter() as counter:
            torch._grouped_mm(a, b, offs=torch.tensor((1, 2, 2, 2), dtype=torch.int32))
    assert counter.expert_weight == [2 * 8 * 12 * 4]


def test_a_linear_layers_reshape_of_its_result_moves_nothing() -> None:
    # was: `aten._unsafe_view` (F.linear's reshape of the `mm` result to (batch, seq, out)) charged its input and
    # output bytes: 2.75 GB and 1.06 ms of a Llama 3 70B block's 20.3 ms forward at 8,192 tokens (fp8, H100 roofline),
    # and at tp 8 the rowwise projections' full-size outputs kept it at 0.34 ms (scripts/tp_row_ops.py, issue 25)
    mode = fake_mode()
    linear = torch.nn.Linear(16, 32, bias=False)
    with faking(mode):
        x = torch.randn(2, 8, 16)
        with OpCounter() as counter:
            linear(x)
    assert counter.names == ["aten::mm"]
    assert counter.bytes == [(2 * 8 * 16 + 16 * 32 + 2 * 8 * 32) * 4]  # the matmul's operands and result only


@pytest.mark.parametrize("tokens, share", [(512, 1.0), (1024, 0.75), (2048, 0.625), (4096, 0.5625)])
def test_cpu_kernels_causal_work_is_its_key_blocks_up_to_the_diagonal(tokens: int, share: float) -> None:
    # torch's CPU flash kernel: 512 keys a block (its query blocks, 64 or 256 here, divide 512), top-left causal.
    assert causal_computed(tokens, tokens, CPU_TILES) == share


@pytest.mark.parametrize("tokens", [4096, 8192, 131072])
def test_gpu_kernels_causal_work_is_half_and_its_diagonal_blocks(tokens: int) -> None:
    # 128 x 128 blocks: n (n + 1) / 2 of the n^2 blocks, n = tokens / 128.
    n = tokens // 128
    assert causal_computed(tokens, tokens, GPU_TILES) == pytest.approx((n + 1) / (2 * n))
    assert causal_computed(tokens, tokens, GPU_TILES) > (tokens + 1) / (2 * tokens)  # never below the pairs kept


def test_short_queries_and_uneven_blocks() -> None:
    # 100 queries (blocks of 32: 0-31, 32-63, 64-95, 96-99) against 100 keys in blocks of 512: every block reaches
    # the one key block, whole; 1000 keys for 100 queries: still one block of 512 per query block.
    assert causal_computed(100, 100, CPU_TILES) == 1.0
    assert causal_computed(100, 1000, CPU_TILES) == pytest.approx(512 / 1000)
    assert causal_computed(0, 8, CPU_TILES) == 1.0


@pytest.mark.parametrize("tiles", [CPU_TILES, GPU_TILES])
def test_a_causal_attention_counts_the_share_its_kernel_computes(tiles: Tiles) -> None:
    """scaled_dot_product_attention with is_causal: its forward and backward FLOPs are torch's formula (every pair)
    times `causal_computed`; without is_causal, or with a mask (no causal skip), the formula whole."""
    def flops(**kw: object) -> tuple[int, int]:
        mode = fake_mode()
        with faking(mode):
            q, k, v = (torch.randn(1, 2, 2048, 16, requires_grad=True) for _ in range(3))
            with OpCounter(tiles) as fwd:
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
            with OpCounter(tiles) as bwd:
                out.sum().backward()
        return sum(fwd.flops), sum(bwd.flops)

    full, causal = flops(), flops(is_causal=True)
    share = causal_computed(2048, 2048, tiles)
    assert share < 0.7
    assert causal[0] == round(full[0] * share) and causal[1] == round(full[1] * share)
    assert flops(attn_mask=torch.ones(2048, 2048, dtype=torch.bool).tril()) == full


def test_gpu_attention_with_its_own_value_head_size_counts_the_gpus_blocks() -> None:
    """DeepSeek's attention (value head size other than the query's) runs the memory-efficient kernel under
    `fused_attention` (a GPU's count): forward and backward are scaled by the GPU's blocks; on the CPU's math path
    (batched matmuls, which compute every pair) nothing is scaled."""
    from autopp.model.fake_cpu import fused_attention

    def flops(attend: Any, causal: bool) -> tuple[list[str], int, int]:
        mode = fake_mode()
        with faking(mode):
            q, k = (torch.randn(1, 2, 1024, 24, requires_grad=True) for _ in range(2))
            v = torch.randn(1, 2, 1024, 16, requires_grad=True)
            with OpCounter(GPU_TILES) as fwd:
                out = attend(q, k, v, is_causal=causal)
            with OpCounter(GPU_TILES) as bwd:
                out.sum().backward()
        return [n for n, f in zip(fwd.names + bwd.names, fwd.flops + bwd.flops) if f], sum(fwd.flops), sum(bwd.flops)

    names, *full = flops(fused_attention, False)
    assert names == ["aten::_scaled_dot_product_efficient_attention",
                     "aten::_scaled_dot_product_efficient_attention_backward"]
    _, *causal = flops(fused_attention, True)
    share = causal_computed(1024, 1024, GPU_TILES)
    assert share == 9 / 16 and causal == [round(f * share) for f in full]
    math_names, *math_full = flops(torch.nn.functional.scaled_dot_product_attention, False)
    assert all(n.startswith("aten::bmm") for n in math_names)  # the CPU's math path: no fused kernel
    assert list(flops(torch.nn.functional.scaled_dot_product_attention, True)[1:]) == math_full
