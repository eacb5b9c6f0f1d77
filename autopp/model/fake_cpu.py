"""A split traced on meta, made to run as on a CPU on fake tensors (the analytic profile's counting), its attention
run as a GPU's fused kernels run it where the CPU's would not."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import Pipe

from .meta import retarget

__all__ = ["as_fake_cpu", "fake_on_cpu", "fused_attention", "fuse_attention"]


def as_fake_cpu(mode: Any, value: Any) -> Any:
    """`value` with every meta tensor as a fake tensor of `mode` on the CPU device (no data is allocated)."""
    convert = mode.fake_tensor_converter.from_meta_and_device
    return torch.utils._pytree.tree_map(
        lambda t: convert(mode, t, torch.device("cpu")) if isinstance(t, torch.Tensor) else t, value)


def fake_on_cpu(pipe: Pipe, mode: Any, fused: bool = False) -> None:
    """Make the split run as on a CPU, on fake tensors: the devices that tracing on meta baked into its graphs
    become the CPU (autopp.model.meta.retarget), its meta parameters and buffers fake CPU tensors (a tied tensor
    stays one). Torch then dispatches as on a CPU: scaled_dot_product_attention takes its fused kernel, which saves
    no attention matrix (as a GPU's fused kernels do), where on meta it decomposes into the math path. `fused` (a
    GPU is counted): the attention calls the CPU's fused kernel refuses run a GPU's instead (`fuse_attention`)."""
    retarget(pipe, "cpu")
    if fused:
        fuse_attention(pipe)
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


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor:
    """`scaled_dot_product_attention` as a GPU runs it. Where torch's CPU flash kernel takes it (query, key and value
    of one head size: `check_head_dim_size_cpp` in torch's sdp_utils_cpp.cpp), the call is left to it: it saves the
    output and the log-sum-exp, as the GPU's flash kernel (`_scaled_dot_product_flash_attention`) does. Where it
    does not (a value head size other than the query's, as in DeepSeek's multi-head latent attention: 192 and 128),
    the CPU falls back to the math path, which saves the `heads x s x s` scores and probabilities; a GPU runs the
    memory-efficient kernel instead (xFormers' kernel, which allows a different value head size), which saves the
    output and the log-sum-exp only (FlashAttention: Dao et al. 2022, arXiv:2205.14135, s.3.1): it runs here,
    under fake tensors (torch's meta kernel `meta__scaled_dot_product_efficient_attention`), with its own FLOP
    formula. Grouped key/value heads are repeated for it, as torch's math path repeats them."""
    if query.size(-1) == key.size(-1) == value.size(-1):
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and key.size(-3) != query.size(-3):
        repeats = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the additive bias the kernel takes, as torch makes it
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    grad = query.requires_grad or key.requires_grad or value.requires_grad
    out: torch.Tensor = torch.ops.aten._scaled_dot_product_efficient_attention.default(
        query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale)[0]
    return out


def fuse_attention(pipe: Pipe) -> int:
    """Make every `scaled_dot_product_attention` of the split's graphs call `fused_attention`; returns how many."""
    changed = 0
    for module in pipe.split_gm.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is _SDPA]
        for node in nodes:
            node.target = fused_attention
        changed += len(nodes)
        # An InterpreterModule runs the code of its `graph_module` (same graph) on itself: regenerate that code.
        code = module if isinstance(module, torch.fx.GraphModule) else getattr(module, "graph_module", None)
        if nodes and isinstance(code, torch.fx.GraphModule):
            code.recompile()
    return changed
