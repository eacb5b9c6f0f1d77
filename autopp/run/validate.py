"""Validate a pipelined run against a single-process reference: same weights, same batches, same SGD.

Tolerance (float32). Pipelining changes only the order of floating-point sums: each microbatch's gradient is
computed separately, summed and divided by the microbatch count (scale_grads=True), where the reference reduces
over the whole batch at once. Measured on examples/gpt.py split at h.2 (2 ranks, gloo, CPU, 3 SGD steps, lr 0.01;
1F1B 2x2, GPipe 4x1 and 1F1B 4x2 microbatches): worst relative gradient difference 1.1e-6 (max |a - b| / max |ref|
per parameter; max abs 6.5e-9), worst relative loss difference 1.6e-7. The tolerances below leave ~100x headroom
for deeper models, more steps, other CPUs and GPUs, while a real bug (a microbatch's gradient missed, a tied
weight's gradient on one rank only, a wrong scale) shows up as 1e-2 or more (a GPT-2 embedding tied to the head
and not summed across ranks: 0.8).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..errors import RunError
from ..modelfile import ModelFile
from .report import ParamDiff
from .tied import aliases

__all__ = [
    "GRAD_RTOL",
    "LOSS_RTOL",
    "TOLERANCES",
    "tolerances",
    "Reference",
    "tensor_diff",
    "check_coverage",
    "compare_grads",
    "compare_losses",
    "reference_run",
]

logger = logging.getLogger(__name__)

#: Max allowed max|pipelined - reference| / max|reference| of any parameter's first-step gradient (float32).
GRAD_RTOL = 1e-4
#: Max allowed |pipelined - reference| / |reference| of any step's loss (float32).
LOSS_RTOL = 1e-5
#: (gradient, loss) relative tolerances by the model's parameter dtype. Measured on tests/models/linrelu.py cast to
#: the dtype (2 ranks, 1F1B and ZBVZeroBubble, 4 microbatches of 4, 3 steps): bfloat16 gradients 6.4e-3, losses
#: 3.3e-3; float16 8.7e-4 and 4.1e-4 -- the unit roundoff (2^-8 = 3.9e-3, 2^-11 = 4.9e-4) times a small factor,
#: since the loss itself is rounded to the dtype. The tolerances leave ~8-10x headroom; float32 leaves ~100x.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-11),
    "float32": (GRAD_RTOL, LOSS_RTOL),
    "float16": (1e-2, 4e-3),
    "bfloat16": (5e-2, 3e-2),
}


@dataclass(frozen=True)
class Reference:
    """The single-process run: loss per step and every parameter's gradient at the first step."""

    losses: tuple[float, ...]
    grads: dict[str, torch.Tensor]
    dtype: str = "float32"
    """The dtype of the model's floating-point parameters (the widest, when mixed)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Every parameter name (a tied weight under each of its names) -> the name `grads` uses."""


def tolerances(dtype: str) -> tuple[float, float]:
    """(gradient, loss) relative tolerances for a model whose parameters are `dtype` (float32's when unknown)."""
    return TOLERANCES.get(dtype, TOLERANCES["float32"])


def model_dtype(model: nn.Module) -> str:
    """The widest floating-point parameter dtype, as a name ("float32"); float32 for a model without any."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes:
        return "float32"
    return str(max(dtypes, key=lambda d: torch.finfo(d).bits)).removeprefix("torch.")


def tensor_diff(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |got - ref|, that divided by max |ref|); rel is 0 for two zero tensors and inf when only ref is zero."""
    if got.shape != ref.shape:
        raise RunError(f"gradient shapes differ: pipelined {tuple(got.shape)} vs reference {tuple(ref.shape)}")
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    abs_diff = float((got - ref).abs().max()) if ref.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    if scale == 0.0:
        return abs_diff, 0.0 if abs_diff == 0.0 else float("inf")
    return abs_diff, abs_diff / scale


def check_coverage(reference_names: Sequence[str], stage_names: Mapping[int, Sequence[str]]
                   ) -> dict[str, list[int]]:
    """Every parameter of the model is held by at least one stage, and stages hold nothing else; returns the
    parameters held by several stages (tied weights: the ranks summed their copies' gradients) with their stages.
    `stage_names` must use the reference's names (see `Reference.aliases`)."""
    owners: dict[str, list[int]] = {}
    for stage, names in sorted(stage_names.items()):
        for name in names:
            owners.setdefault(name, []).append(stage)
    missing = [n for n in reference_names if n not in owners]
    if missing:
        raise RunError(f"{len(missing)} parameters are on no stage, e.g. {missing[0]!r}")
    extra = [n for n in owners if n not in set(reference_names)]
    if extra:
        raise RunError(f"stages hold {len(extra)} parameters the model does not have, e.g. {extra[0]!r}")
    return {n: s for n, s in owners.items() if len(s) > 1}


def compare_grads(reference: Mapping[str, torch.Tensor], stage_grads: Mapping[int, Mapping[str, torch.Tensor]]
                  ) -> list[ParamDiff]:
    """One ParamDiff per reference parameter and stage holding it (a tied weight once per copy: each copy's summed
    gradient against the tensor's reference gradient), in the reference's order (check coverage first)."""
    where: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for stage, grads in sorted(stage_grads.items()):
        for name, grad in grads.items():
            where.setdefault(name, []).append((stage, grad))
    diffs = []
    for name, ref in reference.items():
        for stage, got in where[name]:
            max_abs, max_rel = tensor_diff(got, ref)
            diffs.append(ParamDiff(name=name, stage=stage, max_abs=max_abs, max_rel=max_rel))
    return diffs


def compare_losses(pipelined: Sequence[float], reference: Sequence[float]) -> tuple[float, float]:
    """(max |a - b|, max |a - b| / |b|) over steps."""
    if len(pipelined) != len(reference):
        raise RunError(f"pipelined run reported {len(pipelined)} losses, reference {len(reference)}")
    abs_diffs = [abs(a - b) for a, b in zip(pipelined, reference)]
    rel_diffs = [d / abs(b) if b else (0.0 if d == 0 else float("inf")) for d, b in zip(abs_diffs, reference)]
    return max(abs_diffs, default=0.0), max(rel_diffs, default=0.0)


def reference_run(mf: ModelFile, seed: int, global_batch: int, steps: int, lr: float) -> Reference:
    """Train the whole model in this process on the batches the ranks used: loss_fn on the full batch, plain SGD."""
    model = mf.build(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        inputs, target = mf.sample_batch(global_batch, seed=seed + step)
        loss = mf.loss_fn(model(*inputs), target)
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = _grads(model)
        optimizer.step()
        optimizer.zero_grad()
    logger.debug("reference losses %s", losses)
    return Reference(tuple(losses), grads, model_dtype(model), aliases(model))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient by name (zeros for a parameter that received none)."""
    return {name: _grad_or_zeros(p) for name, p in model.named_parameters()}


def _grad_or_zeros(p: Any) -> torch.Tensor:
    return p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p.detach())
