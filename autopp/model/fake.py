"""Run a model whose parameters live on the meta device: forwards under torch's FakeTensorMode, inputs moved to meta
first and then made fake (transformers' `is_tracing` treats fake tensors as tracing, so its masking code takes no
`.item()` of a meta tensor); `aten._grouped_mm` (mixture-of-experts layers) given a fake kernel for every dtype while
autopp traces (`grouped_mm_on_fake`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

__all__ = ["on_meta", "fake_mode", "to_fake", "to_meta", "run_fake", "grouped_mm_shape", "grouped_mm_on_fake",
           "faking"]

T = TypeVar("T")

_GROUPED_MM = torch.ops.aten._grouped_mm.default


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device (then forwards need `run_fake`)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return any(t.device.type == "meta" for t in tensors)


def fake_mode() -> FakeTensorMode:
    """A FakeTensorMode that accepts the meta model's (real, meta) parameters beside fake inputs."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def to_meta(value: Any) -> Any:
    """`value` with every tensor moved to meta (shape and dtype kept, no data)."""
    return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


def to_fake(mode: FakeTensorMode, value: Any) -> Any:
    """`value` with every tensor as a fake tensor of `mode` on meta (a fake CPU tensor beside meta parameters fails
    with FakeTensorDeviceMismatchError)."""
    return pytree.tree_map(lambda t: mode.from_tensor(t.to("meta")) if isinstance(t, torch.Tensor) else t, value)


def run_fake(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` under a fake mode, the tensors among `args` made fake first. What `fn` returns is fake."""
    mode = fake_mode()
    fake_args = to_fake(mode, args)
    with faking(mode):
        return fn(*fake_args)


def grouped_mm_shape(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, ...]:
    """The output shape of `torch._grouped_mm(mat_a, mat_b, offs)`, as torch's `_create_grouped_mm_output_tensor`
    (torch/_meta_registrations.py) gives it: 2d x 3d (rows grouped by `offs`, one weight per group: MoE experts)
    (M, N); 3d x 2d (columns grouped) (M, N); 2d x 2d (the contraction grouped: an expert weight's gradient)
    (G, M, N); 3d x 3d (a batched matmul) (G, M, N). Raises ValueError with the shapes when they do not fit."""
    a, b, groups = tuple(mat_a.shape), tuple(mat_b.shape), None if offs is None else int(offs.shape[0])
    if len(a) not in (2, 3) or len(b) not in (2, 3):
        raise ValueError(f"_grouped_mm takes 2d or 3d operands, not {len(a)}d x {len(b)}d ({a} x {b})")
    if (len(a) == 3 or len(b) == 3) and a[-1] != b[-2]:
        raise ValueError(f"_grouped_mm contraction sizes differ ({a[-1]} != {b[-2]} in {a} x {b})")
    if len(a) == 3 and len(b) == 3:
        if a[0] != b[0]:
            raise ValueError(f"_grouped_mm batch sizes differ ({a[0]} != {b[0]} in {a} x {b})")
        return (a[0], a[1], b[2])
    if groups is None:
        raise ValueError(f"_grouped_mm of {len(a)}d x {len(b)}d operands needs offs ({a} x {b})")
    if len(a) == 2 and len(b) == 2:
        return (groups, a[0], b[1])
    stacked = b[0] if len(b) == 3 else a[0]
    if stacked != groups:
        raise ValueError(f"_grouped_mm has {stacked} matrices but {groups} offsets ({a} x {b})")
    return (a[0], b[-1]) if len(a) == 2 else (a[1], b[1])


def _is_grouped_mm(func: Any) -> bool:
    return func is _GROUPED_MM


def _fake_grouped_mm(mode: FakeTensorMode, func: Any, mat_a: torch.Tensor, mat_b: torch.Tensor,
                     offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> Any:
    """`aten._grouped_mm` on fake tensors of any floating dtype: a contiguous output (as the CPU kernel's) of
    `grouped_mm_shape`, in `out_dtype` or `mat_a`'s; bfloat16 is left to torch's own meta kernel."""
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return NotImplemented
    if mat_a.dtype != mat_b.dtype:
        raise ValueError(f"_grouped_mm operands differ in dtype ({mat_a.dtype} and {mat_b.dtype})")
    meta = torch.empty(grouped_mm_shape(mat_a, mat_b, offs), dtype=out_dtype or mat_a.dtype, device="meta")
    return FakeTensor(mode, meta, mat_a.device)


_ACTIVE = [0]


@contextlib.contextmanager
def grouped_mm_on_fake() -> Iterator[None]:
    """While active, every FakeTensorMode (autopp's, and torch.export's inside `pipeline()`) runs `aten._grouped_mm`
    in float32 and float16 through `_fake_grouped_mm`; re-entrant, removed again on the way out.

    Why: torch 2.13's meta kernel of `_grouped_mm` (`_meta_grouped_mm_common`) checks its operands are bfloat16, the
    CUDA kernel's restriction, although the eager CPU kernel takes float32; so a float32 HF MoE model (transformers 5
    runs experts through `torch._grouped_mm`) cannot be traced on fake tensors or exported. The kernel goes in
    FakeTensorMode's own table of op implementations (`torch._subclasses.fake_impls.op_implementations_checks`,
    consulted before the meta kernel), not the dispatcher's Meta key: a Meta kernel registered with
    `torch.library.Library("aten", "IMPL").impl(..., "Meta")` (or `register_fake`) kept being used by fake tensors
    after the library was destroyed (checked on torch 2.13), so it would leak into user code; this table is a plain
    list. On the way out, FakeTensorMode's dispatch cache is cleared, so no result made here answers a later call.
    Tracing does not change what runs: the graph records `aten._grouped_mm` in float32, the CPU kernel runs it."""
    entry = (_is_grouped_mm, _fake_grouped_mm)
    if _ACTIVE[0] == 0:
        fake_impls.op_implementations_checks.insert(0, entry)
    _ACTIVE[0] += 1
    try:
        yield
    finally:
        _ACTIVE[0] -= 1
        if _ACTIVE[0] == 0:
            fake_impls.op_implementations_checks.remove(entry)
            FakeTensorMode.cache_clear()


@contextlib.contextmanager
def faking(mode: FakeTensorMode) -> Iterator[FakeTensorMode]:
    """`mode` entered with `grouped_mm_on_fake`: how autopp runs anything on fake tensors."""
    with grouped_mm_on_fake(), mode:
        yield mode
