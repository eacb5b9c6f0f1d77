"""Activation policies as descriptors: what a stage keeps of a microbatch's forward for its backward, what it redoes,
and how the runner and each trainer spell it.

One registry, like the schedules' (`descriptors.py`): the simulator's memory and time effects (`effects.py`), the
planner's split and its memory bounds, the runner and the exporters all read a policy's behaviour from here. A plan
gives each stage one policy. Full recomputation is Chen et al., "Training Deep Nets with Sublinear Memory Cost"
(arXiv:1604.06174) as torch's `torch.utils.checkpoint` runs it per stage: only the stage's input is kept, and the
forward runs again at the start of the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol

import numpy as np

from autopp.errors import ScheduleError

__all__ = ["Activation", "ActivationPolicy", "StageFigures", "UnitFigures", "POLICIES", "policy", "parse_activation",
           "order_key", "chosen", "by_saving"]


class Activation(Enum):
    """A stage's activation policy; its value is the JSON and flag spelling."""

    KEEP = "keep"
    RECOMPUTE = "recompute"


class StageFigures(Protocol):
    """What a policy reads of one microbatch of a stage (`autopp.schedule.effects.StageCost` has these)."""

    @property
    def forward_s(self) -> float: ...
    @property
    def activation_bytes(self) -> int: ...
    @property
    def input_bytes(self) -> int: ...


class UnitFigures(Protocol):
    """What a policy reads of a profile's units at one microbatch size (`autopp.costmodel.UnitArrays` has these)."""

    @property
    def forward(self) -> np.ndarray: ...
    @property
    def recompute(self) -> np.ndarray: ...
    @property
    def activation(self) -> np.ndarray: ...


def _none(a: UnitFigures) -> np.ndarray:
    return np.zeros(len(a.forward))


def _always(a: UnitFigures) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class ActivationPolicy:
    """What one policy keeps, redoes and is called. Each policy reads its own figures: the simulator, the split's
    memory check and the bounds pass the stage's or the units' figures whole (`StageFigures`, `UnitFigures`)."""

    name: Activation
    summary: str
    """One line for tables and docs."""
    saving: int
    """Rank by memory saved (0: keeps everything): the search tries policies in this order, each cheaper in time
    and dearer in memory than the next (`by_saving`)."""
    redo_s: Callable[[StageFigures], float]
    """What the policy adds to a B or I of the stage: the forward again, part of it, or 0."""
    kept: Callable[[StageFigures], int]
    """Bytes one microbatch holds from its F until the backward that frees it."""
    redone: Callable[[StageFigures], int]
    """Bytes allocated again when the backward starts (the recomputed activations), freed with the kept ones."""
    unit_redo: Callable[[UnitFigures], np.ndarray]
    """Per unit, what the policy adds to one microbatch's compute (the split's objective, and with the units'
    forward as a ceiling the bounds)."""
    unit_bytes: Callable[[UnitFigures, int], np.ndarray]
    """Per unit, the activation bytes the split's memory check charges a stage with this many microbatches in flight
    (a relaxation where only inputs are kept: the kept inputs are charged by the simulator and the order walks, which
    judge every plan)."""
    offered: Callable[[UnitFigures], bool] = _always
    """Whether the units carry this policy's figures (a profile without them: the search does not offer it)."""
    checkpoint: bool
    """The runner wraps the stage's forward in `torch.utils.checkpoint.checkpoint` (non-reentrant)."""
    torchtitan: str
    """torchtitan's `activation_checkpoint.mode` for it."""
    megatron: tuple[str, ...]
    """Megatron-LM's arguments for it."""
    deepspeed_interval: int
    """DeepSpeed PipelineModule's `activation_checkpoint_interval` for it."""
    trainer_note: str = ""
    """What the trainers' version leaves out that autopp counted (empty: nothing)."""

    @property
    def redoes_forward(self) -> bool:
        """The backward (B, or I of split-backward schedules) first runs some of the stage's forward again."""
        return self.saving > 0


_FULL_NOTE = ("the trainer's full recomputation covers the transformer blocks only; the embedding and the output "
              "part keep their activations, which autopp counted as recomputed")

#: Every activation policy.
POLICIES: dict[Activation, ActivationPolicy] = {p.name: p for p in (
    ActivationPolicy(name=Activation.KEEP, summary="keep every activation for the backward", saving=0,
                     redo_s=lambda c: 0.0, kept=lambda c: c.activation_bytes, redone=lambda c: 0, unit_redo=_none,
                     unit_bytes=lambda a, inflight: inflight * a.activation,
                     checkpoint=False, torchtitan="none", megatron=(), deepspeed_interval=0),
    ActivationPolicy(name=Activation.RECOMPUTE, summary="keep the stage input; recompute the forward in the backward",
                     saving=2, redo_s=lambda c: c.forward_s, kept=lambda c: c.input_bytes,
                     redone=lambda c: c.activation_bytes, unit_redo=lambda a: a.recompute,
                     unit_bytes=lambda a, inflight: a.activation,
                     checkpoint=True, torchtitan="full",
                     megatron=("--recompute-granularity full", "--recompute-method uniform",
                               "--recompute-num-layers 1"),
                     deepspeed_interval=1, trainer_note=_FULL_NOTE),
)}


def policy(a: Activation) -> ActivationPolicy:
    """The descriptor of activation policy `a`."""
    return POLICIES[a]


def parse_activation(text: object, where: str = "activation") -> Activation:
    """The policy spelled `text` (its value); a ScheduleError naming the policies otherwise."""
    names = [a.value for a in Activation]
    if not isinstance(text, str) or text not in names:
        raise ScheduleError(f"{where}: activation policy {text!r} does not exist; give one of {names}")
    return Activation(text)


def order_key(activations: tuple[Activation, ...]) -> tuple[int, ...]:
    """A sort key of per-stage policies: each by its place in `Activation` (KEEP first), so ties between plans break
    the same way on every run."""
    order = list(Activation)
    return tuple(order.index(a) for a in activations)


def chosen(stages: int, recomputed: set[int] | frozenset[int] | tuple[int, ...]) -> tuple[Activation, ...]:
    """Per-stage policies of `stages` stages: RECOMPUTE for the stages in `recomputed`, KEEP for the others."""
    return tuple(Activation.RECOMPUTE if s in recomputed else Activation.KEEP for s in range(stages))


def by_saving(activations: tuple[Activation, ...] | list[Activation] | set[Activation]) -> tuple[Activation, ...]:
    """`activations` without repeats, least memory saved first (`ActivationPolicy.saving`): the order the search
    climbs when a rank does not fit."""
    return tuple(sorted(set(activations), key=lambda a: POLICIES[a].saving))
