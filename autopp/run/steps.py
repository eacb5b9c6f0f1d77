"""Validate every step of a pipelined run from shared parameters: the reference's step k starts from the parameters
the pipeline held before its step k, on the same batch, so rounding does not compound over steps.

Why. A free-running single-process reference (its own SGD from the same seed) drifts from the pipeline by rounding
alone: every step's update differs by a few roundoffs, and training amplifies the difference step by step. Issue
26 reported a GroupNorm CNN (`--steps 30`, SGD lr 0.01) whose gradients agreed to 3.7e-6 relative while its losses
differed by 1.44e-4 at step 7, over the loss tolerance 1e-5; tests/models/gncnn.py (2 ranks, 1F1B, 4 x 2
microbatches, lr 2, 30 steps) drifted to 3.55e-2 with first-step gradients 7.4e-7 apart. How fast such a difference
grows depends on the model's curvature and the learning rate, so no fixed tolerance suits both a 3-step and a
300-step run. Started from the same parameters, each step differs from its reference by one step's rounding only,
exactly as a first step does, so the tolerances of autopp.run.validate hold for a run of any length (torch's own
pipelining tests likewise compare gradients with a deep-copied reference from equal weights).

What it compares, per step: the loss (the mean of the microbatch losses against the loss of the whole global
batch) and every parameter's gradient after the ranks' tied-copy sum and data-parallel average (each copy of a
tied weight against the tensor's gradient), with the floors of autopp.run.validate. A real error still fails on the
step where it happens: a microbatch missed, a tied copy's gradient on one rank only (GPT-2 and T5:
tests/run/test_real_models.py), a wrong scale. The optimizer's update itself is torch's, over each rank's
parameters; the parameters it produces are the next step's shared starting point.

With an optimizer (`ReferenceModel(..., optimizer=, lr=)`) the reference also steps the same way: after step k it
takes its own optimizer step (torch's, its state fed every step) with the ranks' gradients of step k from the
ranks' parameters before it, and the ranks' parameters before step k + 1 must equal the result (each element within
UPDATE_RTOL of the update's largest element, plus a few roundoffs of the parameter): an optimizer step skipped, taken
twice or with another learning rate on either side fails on that step, which gradients from shared parameters
alone cannot show. The last step's update is checked against the ranks' parameters after it (`checks(steps)`: the
worker's check{STEPS}.pt, parameters without gradients), so a one-step run checks its update too. A parameter the
ranks hold in row shards (vocabulary parallelism: `shards`) is compared shard by shard under the name `name[lo:hi]`.

The failure names the first failing step and its reason (one line: one parameter or one pair of losses), then at
most five further failing steps by number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from ..data.plan import Plan
from ..measure.options import make_optimizer
from ..model.contract import ModelFile, batch_norms
from .collect import StageTensors
from .report import ParamDiff
from .tied import aliases
from .validate import Reference, compare_grads, failure, model_dtype, model_grads, stage_atols, \
    tolerances

__all__ = ["ReferenceModel", "StepsVerdict", "validate_steps", "batch_norm_refusal", "update_failure", "shard_name",
           "MAX_LISTED_STEPS", "UPDATE_RTOL"]

#: Failing steps listed by number after the first one's reason.
MAX_LISTED_STEPS = 5

#: An optimizer update agrees when every element is within this share of the update's largest element (plus
#: UPDATE_ULPS roundoffs of the parameter's largest element: the ranks' and the reference's additions round alike,
#: but not always identically).
UPDATE_RTOL = 1e-4
UPDATE_ULPS = 8

Checks = Callable[[int], tuple[StageTensors, StageTensors]]
"""Step (from 0) -> (replica 0's parameters before it, its gradients), by stage, under the stages' names; step
`steps` (one past the last): the parameters after the last step, and no gradients."""


def shard_name(name: str, lo: int, hi: int) -> str:
    """The name of rows [lo, hi) of parameter `name`, as the ranks and the reference report them."""
    return f"{name}[{lo}:{hi}]"


def _rows(name: str) -> tuple[str, slice | None]:
    """'w[2:5]' -> ('w', rows 2..4); 'w' -> ('w', None)."""
    base, _, rows = name.partition("[")
    if not rows:
        return name, None
    lo, hi = (int(x) for x in rows.rstrip("]").split(":"))
    return base, slice(lo, hi)


class ReferenceModel:
    """The whole model in this process: one step's loss and gradients from given parameters, on the batch the ranks
    used for that step (`sample_batch(global_batch, seed + step)`); with `optimizer`, its update from the ranks'
    gradients (`update`). `shards`: parameters (canonical names) the ranks hold in row shards, reported as
    `shard_name(name, lo, hi)` for each (lo, hi) given."""

    def __init__(self, mf: ModelFile, seed: int, global_batch: int, *, optimizer: str | None = None,
                 lr: float = 0.0, shards: Mapping[str, Sequence[tuple[int, int]]] | None = None) -> None:
        self.mf, self.seed, self.global_batch = mf, seed, global_batch
        self.model = mf.build(seed)
        self.aliases = aliases(self.model)
        self.dtype = model_dtype(self.model)
        self._params = dict(self.model.named_parameters())
        self.shards = {n: tuple(rows) for n, rows in (shards or {}).items()}
        self.optimizer_name = optimizer
        self.optimizer = make_optimizer(optimizer, list(self._params.values()), lr=lr) if optimizer else None

    @property
    def names(self) -> list[str]:
        """The model's parameter names, each tensor once (a tied weight under its first name; a sharded one as its
        shards)."""
        return list(self._split({n: p for n, p in self._params.items()}))

    def _split(self, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`named` (canonical names) with each sharded parameter replaced by its row shards."""
        out: dict[str, torch.Tensor] = {}
        for name, value in named.items():
            for lo, hi in self.shards.get(name, ()):
                out[shard_name(name, lo, hi)] = value[lo:hi]
            if name not in self.shards:
                out[name] = value
        return out

    def _assign(self, tensors: Mapping[int, Mapping[str, torch.Tensor]], target: Callable[[str], torch.Tensor]
                ) -> None:
        """Copy each named tensor (the first stage's copy of a tied one; a shard into its rows) into
        `target(canonical name)`."""
        done: set[str] = set()
        with torch.no_grad():
            for _, named in sorted(tensors.items()):
                for name, value in named.items():
                    base, rows = _rows(name)
                    canonical = self.aliases.get(base, base)
                    key = canonical if rows is None else shard_name(canonical, rows.start, rows.stop)
                    if canonical in self._params and key not in done:
                        whole = target(canonical)
                        (whole if rows is None else whole[rows]).copy_(value)
                        done.add(key)

    def load(self, params: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Set every parameter to the pipeline's (a tied weight: the first stage's copy)."""
        self._assign(params, lambda n: self._params[n])

    def step(self, step: int, params: Mapping[int, Mapping[str, torch.Tensor]] | None = None) -> Reference:
        """Loss and gradients of step `step` (from 0) from `params` (None: the parameters it holds)."""
        if params is not None:
            self.load(params)
        self.model.zero_grad(set_to_none=True)
        inputs, target = self.mf.sample_batch(self.global_batch, seed=self.seed + step)
        loss = self.mf.loss_fn(self.model(*inputs), target)
        loss.backward()
        return Reference((float(loss.detach()),), self._split(model_grads(self.model)), self.dtype, self.aliases,
                         step + 1)

    def update(self, grads: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The optimizer's step from the parameters it holds with the ranks' gradients `grads` (by stage); returns
        the parameters after it (reference names, shards split). A RuntimeError without an optimizer."""
        if self.optimizer is None:
            raise RuntimeError("ReferenceModel.update needs an optimizer")
        for p in self._params.values():
            p.grad = torch.zeros_like(p)
        self._assign(grads, lambda n: self._grad(n))
        self.optimizer.step()
        return self._split({n: p.detach().clone() for n, p in self._params.items()})

    def _grad(self, name: str) -> torch.Tensor:
        grad = self._params[name].grad
        assert grad is not None  # set by update
        return grad


def update_failure(expected: Mapping[str, torch.Tensor], before: Mapping[int, Mapping[str, torch.Tensor]],
                   after: Mapping[int, Mapping[str, torch.Tensor]], aliases_: Mapping[str, str], optimizer: str
                   ) -> str | None:
    """Why the ranks' parameters `after` an optimizer step differ from the reference's `expected` (both from
    `before`), naming the parameter with the largest difference relative to its update; None when all agree."""
    worst: tuple[float, str, int, float, float] | None = None
    for stage, named in sorted(after.items()):
        for name, got in named.items():
            base, rows = _rows(name)
            canonical = aliases_.get(base, base)
            key = canonical if rows is None else shard_name(canonical, rows.start, rows.stop)
            want, prev = expected[key].to(got.dtype), before[stage][name]
            err, step = float((got - want).abs().max()), float((want - prev).abs().max())
            allowed = UPDATE_RTOL * step + UPDATE_ULPS * torch.finfo(got.dtype).eps * float(prev.abs().max())
            share = err / max(step, 1e-30)
            if err > allowed and (worst is None or share > worst[0]):
                worst = (share, name, stage, err, step)
    if worst is None:
        return None
    _, name, stage, err, step = worst
    return (f"parameters of {name} (stage {stage}) after the optimizer step differ from one process's {optimizer} "
            f"step by {err:.2e}, for an update of {step:.2e} (tolerance {UPDATE_RTOL:g} of the update)")


@dataclass(frozen=True)
class StepsVerdict:
    """Every step compared: the reference's losses, each parameter's worst difference, which steps failed and why."""

    reference_losses: tuple[float, ...]
    grad_diffs: tuple[ParamDiff, ...]
    """Per parameter and stage, the step with its largest relative difference."""
    grad_atol: float
    """The largest absolute floor of any stage and step."""
    failed_steps: tuple[int, ...]
    """Steps (from 1) out of tolerance."""
    error: str | None


def validate_steps(reference: ReferenceModel, checks: Checks, losses: Sequence[float]) -> StepsVerdict:
    """Compare each step of the pipelined run (`losses`, per step; `checks`, its parameters and gradients) with the
    reference's step from the same parameters."""
    ref_losses: list[float] = []
    worst: dict[tuple[str, int], ParamDiff] = {}
    failing: list[tuple[int, str]] = []
    atol = 0.0
    grad_rtol, _ = tolerances(reference.dtype)
    following = checks(0) if losses else None
    for k, loss in enumerate(losses):
        assert following is not None
        params, grads = following
        # the parameters after step k: the next step's, or after the last step the ranks' final ones (checks(steps))
        following = checks(k + 1) if k + 1 < len(losses) or reference.optimizer is not None else None
        ref = reference.step(k, params)
        stage_grads = {s: {reference.aliases.get(n, n): g for n, g in gs.items()} for s, gs in grads.items()}
        atols = stage_atols(ref.grads, stage_grads, ref.dtype)
        floors = {s: a / grad_rtol for s, a in atols.items()}
        diffs = compare_grads(ref.grads, stage_grads, floors)
        error = failure(diffs, [loss], ref, stage_grads, floors)
        if reference.optimizer is not None:
            assert following is not None
            moved = update_failure(reference.update(stage_grads), params, following[0], reference.aliases,
                                   reference.optimizer_name or "")
            error = error or moved
        ref_losses.append(ref.losses[0])
        atol = max(atol, *atols.values(), 0.0)
        for d in diffs:
            key = (d.name, d.stage)
            if key not in worst or d.max_rel > worst[key].max_rel:
                worst[key] = ParamDiff(name=d.name, stage=d.stage, max_abs=d.max_abs, max_rel=d.max_rel, step=k + 1)
        if error is not None:
            failing.append((k + 1, error))
    return StepsVerdict(tuple(ref_losses), tuple(worst.values()), atol, tuple(s for s, _ in failing),
                        _summary(failing, len(losses)))


def _summary(failing: Sequence[tuple[int, str]], steps: int) -> str | None:
    """'step 7 of 30: <why> (also steps 8, 9, 11, 12, 15 and 9 more)', or None when no step failed."""
    if not failing:
        return None
    step, why = failing[0]
    text = f"step {step} of {steps}: {why}"
    rest = [s for s, _ in failing[1:]]
    if rest:
        listed = ", ".join(str(s) for s in rest[:MAX_LISTED_STEPS])
        more = f" and {len(rest) - MAX_LISTED_STEPS} more" if len(rest) > MAX_LISTED_STEPS else ""
        text += f" (also step{'s' if len(rest) > 1 else ''} {listed}{more})"
    return text


def batch_norm_refusal(model: nn.Module, plan: Plan) -> str | None:
    """Why `plan` cannot be validated when `model` normalizes with BatchNorm (any `_BatchNorm`: BatchNorm1d/2d/3d,
    SyncBatchNorm) and a step has more than one microbatch: in training it normalizes by the statistics of the batch
    it is given, which pipelining makes a microbatch, so a pipelined step differs from the single-process step over
    the global batch by design, not by rounding (a BatchNorm ResNet-style CNN: 6.9e-1 relative on a norm's bias).
    GroupNorm and LayerNorm normalize each sample on its own, and agree. None when the model has none, or one
    microbatch of the whole batch."""
    norms = batch_norms(model)
    if not norms or plan.microbatch_size == plan.global_batch:
        return None
    return (f"the model normalizes with BatchNorm ({norms[0]}{f' and {len(norms) - 1} more' if len(norms) > 1 else ''})"
            f", whose statistics are per microbatch ({plan.microbatch_size} samples, not the global batch of "
            f"{plan.global_batch}), so a pipelined step cannot equal the single-process one: use GroupNorm or "
            "LayerNorm to validate, or run with validation off (`autopp run --no-validate`) to measure only")
