"""A split traced on meta, made to run as on a CPU on fake tensors (the analytic profile's counting)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import Pipe

from .meta import retarget

__all__ = ["as_fake_cpu", "fake_on_cpu"]


def as_fake_cpu(mode: Any, value: Any) -> Any:
    """`value` with every meta tensor as a fake tensor of `mode` on the CPU device (no data is allocated)."""
    convert = mode.fake_tensor_converter.from_meta_and_device
    return torch.utils._pytree.tree_map(
        lambda t: convert(mode, t, torch.device("cpu")) if isinstance(t, torch.Tensor) else t, value)


def fake_on_cpu(pipe: Pipe, mode: Any) -> None:
    """Make the split run as on a CPU, on fake tensors: the devices that tracing on meta baked into its graphs
    become the CPU (autopp.model.meta.retarget), its meta parameters and buffers fake CPU tensors (a tied tensor
    stays one). Torch then dispatches as on a CPU: scaled_dot_product_attention takes its fused kernel, which saves
    no attention matrix (as a GPU's fused kernels do), where on meta it decomposes into the math path."""
    retarget(pipe, "cpu")
    gm = pipe.split_gm
    done: dict[int, torch.Tensor] = {}
    for module in gm.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)  # Parameter, Tensor values
        for table in tables:
            for name, t in list(table.items()):
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in done:
                    fake = as_fake_cpu(mode, t.detach())
                    done[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
                table[name] = done[id(t)]
