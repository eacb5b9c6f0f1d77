"""Measuring a large vocabulary head on slices of its vocabulary (issue 26, point 12): Llama-3-8B's LM head is
128,256 x 4,096, and timing it with its loss kept about 12 logits-sized tensors alive at once (0.79 GiB per 128 tokens
on top of its 3.9 GiB of weight and gradient). The last piece is measured on its head's weight cut to its first
r/8, r/2 and r rows instead (r = `rows[2]`; the logits and loss on that slice of the vocabulary, the targets taken
modulo the slice), and each number extrapolated to the whole vocabulary as an affine function of the rows: the head's
weight, its GEMMs, softmax and loss and the tensors they keep are linear in the vocabulary at a fixed number of
tokens, and the rest of the piece (the final norm, or a whole MLP when the last unit holds one) does not depend on it.
That is the optimizer step's assumption (autopp.measure.pieces.optimizer_step_s: time linear in the elements) with an
intercept for the rest of the piece. Bytes go through r/2 and r: they come out the full model's exactly
(tests/measure/test_head.py; the peak, a maximum over moments, nearly). Times go through r/8 and r, timed only
there: through two close points the noise of the times would be multiplied by about 2k (k = vocab / r); through
these, by about 1.3 k, as in scaling one time by k. Megatron's and torchtitan's loss-parallel heads rest on the same
linearity: each rank computes the logits and softmax statistics of its slice of the vocabulary (Megatron
`VocabParallelCrossEntropy`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..model.meta import MetaModel

__all__ = ["HeadSlice", "find_head", "sliced_head", "sliced_target", "extrapolate"]


@dataclass(frozen=True)
class HeadSlice:
    """The head measured on slices: its qualified name, vocabulary (rows of its weight) and hidden size, and the
    row counts it is measured at, r/8, r/2 and r (r bounds the weight slice's elements): times at the first and
    last, bytes at the last two."""

    name: str
    vocab: int
    hidden: int
    rows: tuple[int, int, int]

    def describe(self, unit: int) -> dict[str, Any]:
        """What a profile records (`meta.extra["head_slice"]`)."""
        return {"unit": unit, "module": self.name, "vocab": self.vocab, "rows": list(self.rows),
                "k": round(self.vocab / self.rows[2], 3),
                "how": "measured with the head's weight cut to `rows` rows, each number extrapolated to `vocab` "
                       "rows as an affine function of the rows: bytes through the last two, times through the "
                       "first and last"}


def find_head(piece: nn.Module, model: nn.Module, target: Any, slice_numel: int) -> HeadSlice | None:
    """The head of the last piece `piece` to measure on slices: the module its graph calls last, when that is a
    bias-free nn.Linear of `model` whose weight is no other module's (not tied) and has more than `slice_numel`
    elements, and the targets are one integer tensor (they are taken modulo the slice); else None."""
    graph = getattr(piece, "graph", None)
    calls = [n for n in graph.nodes if n.op == "call_module"] if isinstance(graph, fx.Graph) else []
    if not calls or not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None
    name = str(calls[-1].target)
    head = dict(model.named_modules()).get(name)
    if not isinstance(head, nn.Linear) or head.bias is not None or head.weight.numel() <= slice_numel:
        return None
    if sum(p is head.weight for _, p in model.named_parameters(remove_duplicate=False)) > 1:
        return None  # tied to the embedding: the slice would cut both
    vocab, hidden = head.weight.shape
    top = max(8, slice_numel // hidden)
    if top >= vocab:
        return None
    return HeadSlice(name, vocab, hidden, (max(1, top // 8), max(1, top // 2), top))


@contextmanager
def sliced_head(meta: MetaModel, piece: nn.Module, head: HeadSlice, rows: int) -> Iterator[None]:
    """Within: the head's weight is its first `rows` rows, in the meta model (so that `meta.load` materializes the
    slice only, its real initial values the first rows of the full ones) and in `piece`; restored on exit. Load and
    unload the piece inside."""
    owners = [meta.model.get_submodule(head.name), piece.get_submodule(head.name)]
    old = [o._parameters["weight"] for o in owners]
    key = f"{head.name}.weight"
    real = meta.real.get(key)
    weight = old[0]
    assert weight is not None
    small = nn.Parameter(torch.empty(rows, head.hidden, dtype=weight.dtype, device="meta"),
                         requires_grad=weight.requires_grad)
    for o in owners:
        o._parameters["weight"] = small
    if real is not None:
        meta.real[key] = real[:rows]
    try:
        yield
    finally:
        for o, p in zip(owners, old):
            o._parameters["weight"] = p
        if real is not None:
            meta.real[key] = real


def sliced_target(target: torch.Tensor, rows: int) -> torch.Tensor:
    """The targets on a slice of `rows` classes: each modulo `rows` (the loss's work does not depend on which)."""
    return target % rows


def extrapolate(at: tuple[dict[str, Any], dict[str, Any], dict[str, Any]], head: HeadSlice) -> dict[str, Any]:
    """A piece's row at the whole vocabulary from its rows at `head.rows` (module docstring): a time (`*_s`) an
    affine function of the rows through the first and last (at least 0), a spread the last's scaled by k, any other
    number an affine function through the last two (integers rounded); anything else as at the last."""
    rows, vocab = head.rows, head.vocab
    out: dict[str, Any] = {}
    for key, high in at[2].items():
        if isinstance(high, bool) or not isinstance(high, (int, float)):
            out[key] = high
        elif key.endswith("_spread_s"):
            out[key] = high * vocab / rows[2]
        elif key.endswith("_s"):
            out[key] = max(high + (high - at[0][key]) * (vocab - rows[2]) / (rows[2] - rows[0]), 0.0)
        else:
            value = high + (high - at[1][key]) * (vocab - rows[2]) / (rows[2] - rows[1])
            out[key] = round(value) if isinstance(high, int) else value
    return out
