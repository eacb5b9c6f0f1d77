"""Fake-tensor runs (autopp.model.fake): `aten._grouped_mm` (mixture-of-experts layers) given a fake kernel in
float32 while autopp traces, with the CPU kernel's output shape in every case, and nothing left behind after."""

from __future__ import annotations

import pytest
import torch

from autopp.model.fake import fake_mode, faking, grouped_mm_on_fake, grouped_mm_shape

#: Offsets of 4 groups over 16 rows, columns or contraction elements, one group empty (as an expert with no token).
OFFS = (3, 3, 9, 16)

#: (mat_a, mat_b, grouped by offs) for each case torch's grouped matmul takes.
CASES = {
    "2d x 3d, rows grouped (MoE experts)": ((16, 8), (4, 8, 12), True),
    "3d x 3d, batched": ((4, 16, 8), (4, 8, 12), False),
    "2d x 2d, contraction grouped (expert weight gradient)": ((12, 16), (16, 8), True),
    "3d x 2d, columns grouped": ((4, 12, 8), (8, 16), True),
}


def _operands(case: str, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    a, b, grouped = CASES[case]
    offs = torch.tensor(OFFS, dtype=torch.int32, device=device) if grouped else None
    return torch.randn(a, device=device), torch.randn(b, device=device), offs


def _fake_grouped_mm(case: str) -> torch.Tensor:
    mode = fake_mode()
    with mode:
        a, b, offs = _operands(case)
        return torch._grouped_mm(a, b, offs=offs)


@pytest.mark.parametrize("case", list(CASES))
def test_fake_grouped_mm_has_the_cpu_kernels_shape_and_dtype(case: str) -> None:
    a, b, offs = _operands(case)
    real = torch._grouped_mm(a, b, offs=offs)
    assert grouped_mm_shape(a, b, offs) == tuple(real.shape)
    with grouped_mm_on_fake():
        fake = _fake_grouped_mm(case)
    assert (tuple(fake.shape), fake.dtype, fake.device) == (tuple(real.shape), torch.float32, torch.device("cpu"))


def test_fake_grouped_mm_backward_gives_gradients_of_the_operands_shapes() -> None:
    mode = fake_mode()
    with faking(mode):
        a = torch.randn(16, 8, requires_grad=True)
        b = torch.randn(4, 8, 12, requires_grad=True)
        torch._grouped_mm(a, b, offs=torch.tensor(OFFS, dtype=torch.int32)).sum().backward()
    assert a.grad is not None and b.grad is not None
    assert (a.grad.shape, b.grad.shape) == (a.shape, b.shape)


def test_torchs_own_meta_kernel_refuses_float32_outside_and_after_the_scope() -> None:
    # The reason for the override (torch 2.13): if this starts passing, torch's meta kernel takes float32 itself.
    case = next(iter(CASES))
    with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        _fake_grouped_mm(case)
    with grouped_mm_on_fake(), grouped_mm_on_fake():  # re-entrant: the inner exit keeps the outer scope
        assert _fake_grouped_mm(case).shape == (16, 12)
    with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):  # same shapes: no cached answer either
        _fake_grouped_mm(case)


@pytest.mark.parametrize("a, b, offs, message", [
    ((16, 8), (4, 6, 12), 4, r"contraction sizes differ \(8 != 6"),
    ((16, 8), (3, 8, 12), 4, r"has 3 matrices but 4 offsets"),
    ((4, 16, 8), (2, 8, 12), None, r"batch sizes differ \(4 != 2"),
    ((16, 8), (8, 12), None, r"2d x 2d operands needs offs"),
    ((16,), (4, 8, 12), 4, r"2d or 3d operands, not 1d x 3d"),
])
def test_grouped_mm_shape_names_the_shapes_that_do_not_fit(a: tuple[int, ...], b: tuple[int, ...],
                                                           offs: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        grouped_mm_shape(torch.empty(a, device="meta"), torch.empty(b, device="meta"),
                         None if offs is None else torch.empty(offs, device="meta"))
