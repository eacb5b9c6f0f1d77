"""Validate a pipelined run against a single-process reference: same weights, same batches (each step from the
pipeline's own parameters: autopp.run.steps), compared with the tolerances below.

Tolerance (float32). Pipelining changes only the order of floating-point sums: each microbatch's gradient is
computed separately, summed and divided by the microbatch count (scale_grads=True), where the reference reduces
over the whole batch at once. Measured on examples/gpt.py split at h.2 (2 ranks, gloo, CPU, 3 SGD steps, lr 0.01;
1F1B 2x2, GPipe 4x1 and 1F1B 4x2 microbatches): worst relative gradient difference 1.1e-6 (max |a - b| / max |ref|
per parameter; max abs 6.5e-9), worst relative loss difference 1.6e-7. The tolerances below leave ~100x headroom
for deeper models, more steps, other CPUs and GPUs, while a real bug (a microbatch's gradient missed, a tied
weight's gradient on one rank only, a wrong scale) shows up as 1e-2 or more (a GPT-2 embedding tied to the head
and not summed across ranks: 0.8).

Absolute floor. A parameter whose gradient is zero in exact arithmetic has only rounding noise on both sides, and
noise divided by noise is any number: the key bias of softmax attention (softmax is shift-invariant per query, so
the key bias gets sum_j dL/dk_j = 0) gave 5.8e-2 "relative" at 7.4e-13 absolute on HF BERT. A gradient element is
a sum of products of activations and upstream gradients; its rounding error is a few units of roundoff eps(dtype)
times the magnitudes of its terms, which are of the size of the gradients the same backward produces. So, as
`torch.testing.assert_close` adds an `atol` to its `rtol`, a parameter passes when

    max |a - b| <= max(rtol * max |ref|, atol),   atol = eps(dtype) * G,
    G = the largest |reference gradient| element among the parameters of the parameter's stage,
    eps: float32 1.2e-7, bfloat16 7.8e-3, float16 9.8e-4, float64 2.2e-16 (GRAD_ATOL).

G is the stage's, not the whole model's: the terms of a gradient are of the size of the gradients its own stage's
backward produces, and a model-wide G let one large stage (an embedding, a head) decide for the others -- in
bfloat16 a parameter whose gradient is below eps / rtol = 15.6 % of the model's largest was checked only at an
absolute 7.8e-3 G. The stage's G is never larger, so no check is looser than with the model's; a tied weight held by
several stages is checked against each holder's G.

Measured (float32, 2 ranks, 1F1B, 2 steps). A tiny HF ViT (ViTForImageClassification, 4 layers of width 64, split at
layer 2, 2 x 2 microbatches, G = 1.02) FAILED before the floor: k_proj.bias 2.0 "relative" at 2.2e-10 absolute;
with it every key bias's max_rel is at most 1.8e-7 against rtol 1e-4 (~560x headroom; noise <= 2.1e-10 G = 1.8e-3 eps).
examples/hf_bert.py (G 0.19) and a tiny HF DistilBERT (G 0.057) pass either way (key bias gradients exactly 0 on
both sides; with 4 x 1 microbatches BERT's key biases differ by at most 1.5e-11 G). Those were measured with the
model's G; with the stage's (ViT: 1.00 and 0.92) the ViT's key biases stay at most 2.3e-7 (~430x). The floor
decides only for a parameter whose whole gradient is below eps * G / rtol (1.2e-3 G in float32); a failure it
decided says "vs floor". A real bug still fails: with the
cross-rank sum of tied copies switched off, GPT-2's embedding copy differs by 1.00 and T5's shared embedding by
1.01 (tests/run/test_real_models.py fails both); any error larger than eps * G does, unless the parameter's entire
gradient is within a few roundoffs of its stage's largest, where no comparison could tell right from wrong.

Non-finite values. Every comparison with NaN is false, so a NaN would pass any tolerance: a NaN or infinity in
either side's losses or gradients fails the run first, naming the side, the step or the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..errors import RunError
from .report import ParamDiff

__all__ = [
    "GRAD_RTOL",
    "LOSS_RTOL",
    "TOLERANCES",
    "GRAD_ATOL",
    "tolerances",
    "grad_atol",
    "stage_atols",
    "non_finite",
    "failure",
    "Reference",
    "tensor_diff",
    "check_coverage",
    "compare_grads",
    "compare_losses",
    "model_grads",
    "model_dtype",
]

#: Max allowed max|pipelined - reference| / max|reference| of any parameter's gradient at any step (float32).
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
#: A gradient difference up to this fraction of the largest reference gradient element of the parameter's stage passes
#: whatever the parameter's own scale: one unit of roundoff (machine epsilon) of the dtype; see the module docstring.
GRAD_ATOL: dict[str, float] = {name: torch.finfo(getattr(torch, name)).eps for name in TOLERANCES}


@dataclass(frozen=True)
class Reference:
    """The single-process run: loss per step and every parameter's gradient at the first step."""

    losses: tuple[float, ...]
    grads: dict[str, torch.Tensor]
    dtype: str = "float32"
    """The dtype of the model's floating-point parameters (the widest, when mixed)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Every parameter name (a tied weight under each of its names) -> the name `grads` uses."""
    first_step: int = 1
    """The step (from 1) of `losses[0]`."""


def tolerances(dtype: str) -> tuple[float, float]:
    """(gradient, loss) relative tolerances for a model whose parameters are `dtype` (float32's when unknown)."""
    return TOLERANCES.get(dtype, TOLERANCES["float32"])


def grad_atol(grads: Mapping[str, torch.Tensor], dtype: str) -> float:
    """GRAD_ATOL[dtype] x the largest finite |gradient| element of `grads` (0 when there is none)."""
    finite = [g.detach().abs().nan_to_num(0.0, 0.0, 0.0).max() for g in grads.values() if g.numel()]
    largest = float(torch.stack(finite).max()) if finite else 0.0
    return GRAD_ATOL.get(dtype, GRAD_ATOL["float32"]) * largest


def stage_atols(reference: Mapping[str, torch.Tensor], stage_grads: Mapping[int, Mapping[str, torch.Tensor]],
                dtype: str) -> dict[int, float]:
    """Per stage, `grad_atol` of the reference gradients of the parameters it holds (`stage_grads` uses the
    reference's names): the absolute floor of each of them."""
    return {s: grad_atol({n: reference[n] for n in grads if n in reference}, dtype) for s, grads in stage_grads.items()}


def model_dtype(model: nn.Module) -> str:
    """The widest floating-point parameter dtype, as a name ("float32"); float32 for a model without any."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes:
        return "float32"
    return str(max(dtypes, key=lambda d: torch.finfo(d).bits)).removeprefix("torch.")


def tensor_diff(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> tuple[float, float]:
    """(max |got - ref|, that divided by max(max |ref|, floor)); rel is 0 for two equal tensors and inf when the
    divisor is zero and they differ."""
    if got.shape != ref.shape:
        raise RunError(f"gradient shapes differ: pipelined {tuple(got.shape)} vs reference {tuple(ref.shape)}")
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    abs_diff = float((got - ref).abs().max()) if ref.numel() else 0.0
    scale = max(float(ref.abs().max()) if ref.numel() else 0.0, floor)
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


def compare_grads(reference: Mapping[str, torch.Tensor], stage_grads: Mapping[int, Mapping[str, torch.Tensor]],
                  floor: float | Mapping[int, float] = 0.0) -> list[ParamDiff]:
    """One ParamDiff per reference parameter and stage holding it (a tied weight once per copy: each copy's summed
    gradient against the tensor's reference gradient), in the reference's order (check coverage first); relative
    differences are taken against at least `floor` (atol / rtol: see `stage_atols`), one for all or per stage."""
    floors = floor if isinstance(floor, Mapping) else {s: floor for s in stage_grads}
    where: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for stage, grads in sorted(stage_grads.items()):
        for name, grad in grads.items():
            where.setdefault(name, []).append((stage, grad))
    diffs = []
    for name, ref in reference.items():
        for stage, got in where[name]:
            max_abs, max_rel = tensor_diff(got, ref, floors.get(stage, 0.0))
            diffs.append(ParamDiff(name=name, stage=stage, max_abs=max_abs, max_rel=max_rel))
    return diffs


def compare_losses(pipelined: Sequence[float], reference: Sequence[float]) -> tuple[float, float]:
    """(max |a - b|, max |a - b| / |b|) over steps."""
    if len(pipelined) != len(reference):
        raise RunError(f"pipelined run reported {len(pipelined)} losses, reference {len(reference)}")
    abs_diffs = [abs(a - b) for a, b in zip(pipelined, reference)]
    rel_diffs = [d / abs(b) if b else (0.0 if d == 0 else float("inf")) for d, b in zip(abs_diffs, reference)]
    return max(abs_diffs, default=0.0), max(rel_diffs, default=0.0)


def _bad_loss(losses: Sequence[float], first: int = 1) -> str | None:
    """'loss nan at step 2' for the first non-finite loss (`losses[0]` is step `first`), else None."""
    return next((f"loss {v} at step {i + first}" for i, v in enumerate(losses) if not math.isfinite(v)), None)


def _bad_grad(grads: Mapping[str, torch.Tensor], where: str = "") -> str | None:
    """'gradient of NAME (3 of 8 elements nan)' for the first parameter with a non-finite element, else None."""
    for name, grad in grads.items():
        bad = ~torch.isfinite(grad.detach())
        if bool(bad.any()):
            kinds = "/".join(k for k, m in (("nan", grad.isnan()), ("inf", grad.isinf())) if bool(m.any()))
            return f"gradient of {name}{where} ({int(bad.sum())} of {grad.numel()} elements {kinds})"
    return None


def non_finite(losses: Sequence[float], stage_grads: Mapping[int, Mapping[str, torch.Tensor]], ref: Reference
               ) -> str | None:
    """Why the run fails when either side has a NaN or infinite loss or gradient (one line naming the side and the
    step or parameter), else None."""
    ref_bad = _bad_loss(ref.losses, ref.first_step) or _bad_grad(ref.grads)
    pipe_bad = _bad_loss(losses, ref.first_step) or next(
        (b for s, g in sorted(stage_grads.items()) if (b := _bad_grad(g, f" (stage {s})"))), None)
    if ref_bad and pipe_bad:
        return (f"non-finite values on both sides: the single-process reference's {ref_bad}, the pipelined run's "
                f"{pipe_bad}; the model produces them without pipelining (check sample_batch, loss_fn and the "
                "weights of the model file)")
    if ref_bad:
        return f"the single-process reference has a non-finite {ref_bad} where the pipelined run is finite"
    if pipe_bad:
        return f"the pipelined run has a non-finite {pipe_bad} where the single-process reference is finite"
    return None


def failure(diffs: Sequence[ParamDiff], losses: Sequence[float], ref: Reference,
            stage_grads: Mapping[int, Mapping[str, torch.Tensor]], floors: Mapping[int, float] | None = None
            ) -> str | None:
    """The verdict: why the run fails validation (non-finite values first, then the worst gradient, then the
    losses), or None when it passes. `floors`: what `compare_grads` divided by at least, per stage; a gradient
    failure the floor decided (the parameter's own max |gradient| below it) says "vs floor"."""
    grad_rtol, loss_rtol = tolerances(ref.dtype)
    bad = non_finite(losses, stage_grads, ref)
    if bad:
        return bad
    worst = max(diffs, key=lambda d: d.max_rel)
    if worst.max_rel > grad_rtol:
        floor = (floors or {}).get(worst.stage, 0.0)
        own = float(ref.grads[worst.name].detach().abs().max()) if ref.grads[worst.name].numel() else 0.0
        against = (f" vs floor (the stage's atol {floor * grad_rtol:.2e} is above rtol x the parameter's max "
                   f"|gradient| = {own * grad_rtol:.2e})" if floor > own else "")
        return (f"gradient of {worst.name} (stage {worst.stage}) differs from the single-process reference by "
                f"{worst.max_rel:.2e} relative{against} (max abs {worst.max_abs:.2e}), above the tolerance "
                f"{grad_rtol:.0e}")
    loss_abs, loss_rel = compare_losses(losses, ref.losses)
    if loss_rel > loss_rtol:
        i = max(range(len(losses)), key=lambda k: abs(losses[k] - ref.losses[k]) / abs(ref.losses[k] or 1.0))
        return (f"loss differs from the single-process reference by {loss_rel:.2e} relative (max abs "
                f"{loss_abs:.2e}), above the tolerance {loss_rtol:.0e}: pipelined {losses[i]:.7g}, reference "
                f"{ref.losses[i]:.7g}")
    return None


def model_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient by name (zeros for a parameter that received none)."""
    return {name: _grad_or_zeros(p) for name, p in model.named_parameters()}


def _grad_or_zeros(p: Any) -> torch.Tensor:
    return p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p.detach())
