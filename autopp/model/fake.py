"""Run a model whose parameters live on the meta device: forwards under torch's FakeTensorMode, inputs moved to meta
first and then made fake (transformers' `is_tracing` treats fake tensors as tracing, so its masking code takes no
`.item()` of a meta tensor)."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

__all__ = ["on_meta", "fake_mode", "to_fake", "to_meta", "run_fake"]

T = TypeVar("T")


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
    with mode:
        return fn(*fake_args)
