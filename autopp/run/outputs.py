"""The loss on the last stage sees the model's own output structure (a transformers ModelOutput reading `.logits`),
rebuilt from the last piece's tensors as the profiler does."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.distributed.pipelining import Pipe
from torch.utils import _pytree as pytree

from ..errors import RunError
from ..model.split import output_spec
from .chain import Source, pick, value_path

__all__ = ["output_sources", "rebuild_last_output", "model_loss"]

LossFn = Callable[[Any, Any], torch.Tensor]


def output_sources(pipe: Pipe) -> list[Source | None] | None:
    """For each tensor of the model's output (flattened, in the model's order), where the last piece returns it, or
    None when an earlier piece made it (T5's `encoder_last_hidden_state`: the last stage does not have it). None
    overall when an output is not a piece's value (a constant, or computed between pieces)."""
    gm = pipe.split_gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    piece_index = {str(n.target): i for i, n in enumerate(calls)}
    result = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out: list[Source | None] = []
    for leaf in pytree.tree_leaves(result):
        try:
            src = value_path(leaf, piece_index, placeholders) if isinstance(leaf, fx.Node) else None
        except RunError:
            src = None
        if src is None:
            return None
        out.append(src if src.piece == len(calls) - 1 else None)
    return out


def rebuild_last_output(spec: pytree.TreeSpec, sources: Sequence[Source | None] | None, piece_output: Any) -> Any:
    """The model's output structure around the last piece's tensors; outputs made by earlier stages are None. Without
    `sources`, or when the split does not mirror the structure, the piece's output as it is."""
    if sources is None or spec.num_leaves != len(sources):
        return piece_output
    leaves = [None if s is None else pick(piece_output, s.path) for s in sources]
    return pytree.tree_unflatten(leaves, spec)


def model_loss(loss_fn: LossFn, model: nn.Module, example: tuple[Any, ...], pipe: Pipe) -> LossFn:
    """`loss_fn` called on the model's output structure instead of the last piece's bare tensors."""
    spec = output_spec(model, example)
    sources = output_sources(pipe)

    def loss(output: Any, target: Any) -> torch.Tensor:
        return loss_fn(rebuild_last_output(spec, sources, output), target)
    return loss
