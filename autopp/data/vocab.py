"""Vocabulary parallelism's names (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism",
MLSys 2025): its two variants, as plans write them, and what a profile records of the model's vocabulary layers
(`meta.extra["vocab"]`, autopp.measure.profiler) so that the planner refuses a model it cannot split at plan time."""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["VocabVariant", "vocab_refusal", "vocab_tied"]


class VocabVariant(Enum):
    """The paper's two ways of combining the softmax across the vocabulary shards."""

    VOCAB_1 = "vocab-1"
    """Two collectives per microbatch (the maximum, then the sum of exponentials); activations of p + 2."""
    VOCAB_2 = "vocab-2"
    """One collective with online-softmax rescaling; activations of p + 1 (autopp.run.vocab runs either)."""

    @property
    def collectives(self) -> int:
        return 2 if self is VocabVariant.VOCAB_1 else 1

    @property
    def extra_inflight(self) -> int:
        """Microbatches of hidden states held beyond the schedule's own."""
        return 2 if self is VocabVariant.VOCAB_1 else 1


def vocab_refusal(extra: dict[str, Any]) -> str | None:
    """Why a profile's model cannot be planned with vocabulary parallelism (None: it can): its `meta.extra["vocab"]`
    says that unit 0 is the token embedding and the last unit the head whose mean cross-entropy is the loss
    (`{"embedding": name, "head": name, "vocab": V, "hidden": H, "tied": bool}`), or why not (`{"refused": why}`);
    profiles made before the field record neither. A model built from an HF config (`extra["hf_config"]`) is
    refused too: the runner does not build it for vocabulary parallelism yet."""
    facts = extra.get("vocab")
    if not isinstance(facts, dict):
        return "the profile does not record the model's vocabulary layers (made before autopp checked them): " \
               "profile again"
    if "refused" in facts:
        return str(facts["refused"])
    if extra.get("hf_config"):
        return "vocabulary parallelism: `autopp run` does not run it for a model built from an HF config yet"
    return None


def vocab_tied(extra: dict[str, Any]) -> bool:
    """Whether the profile's model ties its head to its token embedding (`meta.extra["vocab"]["tied"]`): one
    tensor, of which each rank holds one shard of rows serving both."""
    facts = extra.get("vocab")
    return isinstance(facts, dict) and bool(facts.get("tied"))
