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


def tp_outdated(tp_plan: dict[str, str], has: tuple[int, ...], needs: tuple[int, ...] | None, hf: bool
                ) -> str | None:
    """Why a profile's tensor-parallel rows (its `tp_plan`, the degrees it `has`) are not those a plan `needs` (None:
    they are): a degree missing, or, for an HF config (`hf`), rows that count the head's logits gathered
    (colwise_gather_output, counted before an HF config's head took `LOSS_PARALLEL`)."""
    missing = sorted(set(needs or ()) - set(has))
    if missing:
        return f"it has no tensor-parallel rows of degree {', '.join(map(str, missing))}"
    if hf and has and "colwise_gather_output" in tp_plan.values():
        return "its tensor-parallel rows gather the head's logits on every rank, counted before loss parallelism"
    return None
