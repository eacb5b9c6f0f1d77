"""What a profile's and a plan's `tp_plan` record about the output layer, and whether a profile's tensor-parallel
rows are those a plan needs. No torch, no pandas here (`autopp devices` and the CPU ranks import it)."""

from __future__ import annotations

__all__ = ["LOSS_PARALLEL", "tp_outdated"]

#: The TP style of an output layer whose logits stay sharded on the vocabulary into a vocabulary-parallel
#: cross-entropy (torch's `loss_parallel`; torchtitan's and Megatron-LM's output layer under TP),
#: as a profile's (and a plan's) `tp_plan` records it: a model file names it in TP_PLAN; an HF config's
#: colwise_gather_output head takes it (autopp.model.tp.find_tp_plan), its loss being autopp's cross-entropy of the
#: logits. Its meaning and torch style: autopp.model.tp.
LOSS_PARALLEL = "colwise_loss_parallel"


def tp_outdated(recorded: dict[str, str], has: tuple[int, ...], needs: tuple[int, ...] | None,
                current: dict[str, str] | None) -> str | None:
    """Why a profile's tensor-parallel rows (counted with the TP plan `recorded`, at the degrees it `has`) are not
    those a plan needs (None: they are): a degree it `needs` missing (None: any it has, ()  none), or rows counted
    with another plan than the model's `current` one (an HF config's gathered head, counted before it took
    `LOSS_PARALLEL`; a transformers release that changed the plan)."""
    missing = sorted(set(needs or ()) - set(has))
    if missing:
        return f"it has no tensor-parallel rows of degree {', '.join(map(str, missing))}"
    if has and needs != () and current is not None and recorded != current:
        key = sorted(set(recorded.items()) ^ set(current.items()))[0][0]
        return (f"its tensor-parallel rows were counted with another TP plan (at {key!r}: "
                f"{recorded.get(key, 'none')} then, {current.get(key, 'none')} now)")
    return None
