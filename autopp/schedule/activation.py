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
from typing import TypeVar

from autopp.errors import ScheduleError

__all__ = ["Activation", "ActivationPolicy", "POLICIES", "policy", "parse_activation", "order_key", "chosen"]

_T = TypeVar("_T")


class Activation(Enum):
    """A stage's activation policy; its value is the JSON and flag spelling."""

    KEEP = "keep"
    RECOMPUTE = "recompute"


@dataclass(frozen=True, kw_only=True)
class ActivationPolicy:
    """What one policy keeps, redoes and is called."""

    name: Activation
    summary: str
    """One line for tables and docs."""
    redoes_forward: bool
    """The backward (B, or I of split-backward schedules) first runs the stage's forward again."""
    keeps_input_only: bool
    """Between F and its backward a microbatch holds only the stage input, not its activations."""
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

    def redo_s(self, forward: _T) -> _T | float:
        """What the policy adds to a B or I: the forward again, or 0. Takes a stage's forward time or an array of
        units' forward times (the bounds)."""
        return forward if self.redoes_forward else 0.0

    def kept(self, activation_bytes: int, input_bytes: int) -> int:
        """Bytes one microbatch holds from its F until the backward that frees it."""
        return input_bytes if self.keeps_input_only else activation_bytes

    def redone(self, activation_bytes: int) -> int:
        """Bytes allocated again when the backward starts (the recomputed activations), freed with the kept ones."""
        return activation_bytes if self.redoes_forward else 0

    def held(self, inflight: int) -> int:
        """Microbatches whose activations a stage is charged for when `inflight` are in flight: all of them, or one
        when only inputs are kept (a relaxation for the split's memory check: the kept inputs are charged by the
        simulator and the order walks, which judge every plan)."""
        return 1 if self.keeps_input_only else inflight


_FULL_NOTE = ("the trainer's full recomputation covers the transformer blocks only; the embedding and the output "
              "part keep their activations, which autopp counted as recomputed")

#: Every activation policy.
POLICIES: dict[Activation, ActivationPolicy] = {p.name: p for p in (
    ActivationPolicy(name=Activation.KEEP, summary="keep every activation for the backward", redoes_forward=False,
                     keeps_input_only=False, checkpoint=False, torchtitan="none", megatron=(), deepspeed_interval=0),
    ActivationPolicy(name=Activation.RECOMPUTE, summary="keep the stage input; recompute the forward in the backward",
                     redoes_forward=True, keeps_input_only=True, checkpoint=True, torchtitan="full",
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
