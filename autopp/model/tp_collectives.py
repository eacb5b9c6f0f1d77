"""Each unit's tensor-parallel collectives per microbatch (Megatron's f/g operators, docs/parallelism.md), counted
from hooks on the planned modules (autopp.model.tp's styles) during one forward of the full model: rowwise and
embedding_rowwise all-reduce their output in the forward; colwise all-reduces the gradient of its input in the
backward, once per distinct input tensor of a unit (q/k/v read one tensor: one); colwise_gather_output all-gathers
its output in the forward and all-reduces its input gradient in the backward; colwise_loss_parallel (`LOSS_PARALLEL`)
all-reduces its input gradient in the backward and, in the forward, three numbers per token for the cross-entropy
over the vocabulary shards (torch's `loss_parallel`: each token's maximum logit and sum of exponentials, in float32,
and its target's log-probability, in the logits' dtype); replicated_with_grad_allreduce (Qwen3's per-head
q_norm/k_norm) all-reduces its parameters' gradients in the backward."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..data.tp_plan import LOSS_PARALLEL
from .tp import GRAD_ALLREDUCE, SEQUENCE_STYLE

__all__ = ["TpCollectives", "unit_collectives"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TpCollectives:
    """One unit's TP collectives per microbatch: bytes are nccl-tests' S (the full tensor), summed over them."""

    forward_allreduce_bytes: int = 0
    backward_allreduce_bytes: int = 0
    forward_allgather_bytes: int = 0
    forward_collectives: int = 0
    backward_collectives: int = 0
    sequence_bytes: int = 0
    """Bytes of the inputs of the unit's sequence-wise modules (`sequence_modules`: what a norm saves for its
    backward, Korthikanti et al. 2022's LayerNorm-input term): the activation bytes sequence parallelism divides by
    the degree."""

    def columns(self) -> dict[str, int]:
        """As the profile's tp.csv columns (`tp_` + field name; `sp_sequence_bytes`)."""
        return {("sp_" if k == "sequence_bytes" else "tp_") + k: int(v) for k, v in self.__dict__.items()}


def _bytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


def _unit_of(name: str, unit_modules: Sequence[Sequence[str]]) -> int | None:
    return next((i for i, mods in enumerate(unit_modules)
                 if any(name == m or name.startswith(m + ".") for m in mods)), None)


def _record(calls: list[tuple[int, str, Any, Any]], unit: int, style: str, module: nn.Module, args: Any,
            kwargs: dict[str, Any], out: Any) -> None:
    """Keep one call of a planned module: its unit, style, input tensor (first positional, else keyword) and output
    (for GRAD_ALLREDUCE: the bytes of its parameters, whose gradients it all-reduces)."""
    x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    if style == GRAD_ALLREDUCE:
        out = sum(_bytes(p) for p in module.parameters(recurse=False) if p.requires_grad)
    calls.append((unit, style, x, out))


def _fold(calls: list[tuple[int, str, Any, Any]]) -> TpCollectives:
    """One unit's calls (unit, style, input, output) as its collectives (module docstring)."""
    f_ar = b_ar = f_ag = f_n = b_n = seq = 0
    seen: set[int] = set()
    for _, style, x, out in calls:
        if style == SEQUENCE_STYLE:
            seq += _bytes(x)
        if style in ("rowwise", "embedding_rowwise"):
            f_ar, f_n = f_ar + _bytes(out), f_n + 1
        if style == "colwise_gather_output":
            f_ag, f_n = f_ag + _bytes(out), f_n + 1
        if style == LOSS_PARALLEL and isinstance(out, torch.Tensor):  # per token, as torch's loss_parallel sends them:
            tokens, size = out.numel() // max(1, int(out.shape[-1])), out.element_size()  # the maximum and the sum of
            f_ar, f_n = f_ar + tokens * (2 * max(4, size) + size), f_n + 3  # exponentials in float32, the target's
            # log-probability in the logits' dtype (torch/distributed/tensor/parallel/loss.py)
        if style == GRAD_ALLREDUCE and out:
            b_ar, b_n = b_ar + int(out), b_n + 1
        if style in ("colwise", "colwise_gather_output", LOSS_PARALLEL) and id(x) not in seen:
            seen.add(id(x))
            b_ar, b_n = b_ar + _bytes(x), b_n + 1
    return TpCollectives(f_ar, b_ar, f_ag, f_n, b_n, seq)


def unit_collectives(model: nn.Module, resolved: dict[str, str], unit_modules: Sequence[Sequence[str]],
                     run: Callable[[], Any], sequence: Sequence[str] = ()) -> list[TpCollectives]:
    """Per unit (`unit_modules`: each unit's module names), its TP collectives per microbatch, from hooks on the
    planned modules while `run()` runs one forward of the full `model` (e.g. on fake tensors) at that microbatch;
    with the `sequence` modules' input bytes (`TpCollectives.sequence_bytes`)."""
    calls: list[tuple[int, str, Any, Any]] = []
    handles = []
    for name, style in [*resolved.items(), *((n, SEQUENCE_STYLE) for n in sequence)]:
        unit = _unit_of(name, unit_modules)
        if unit is None:
            log.warning("TP-planned module %s lies in no unit; its collectives are not counted", name)
            continue
        handles.append(model.get_submodule(name).register_forward_hook(partial(_record, calls, unit, style),
                                                                       with_kwargs=True))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return [_fold([c for c in calls if c[0] == u]) for u in range(len(unit_modules))]
