"""Cut a model into consecutive pieces at module boundaries with torch.distributed.pipelining.pipeline (torch.export)."""

from __future__ import annotations

import copy
import warnings
from typing import Sequence

import torch
from torch import nn
from torch.distributed.pipelining import Pipe, SplitPoint, pipeline

from .errors import ModelFileError

__all__ = ["split_model", "piece_names"]


def split_model(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], split_points: Sequence[str]) -> Pipe:
    """A Pipe with one piece per gap between `split_points`; the model is deep-copied (pipeline() patches it)."""
    spec = {name: SplitPoint.BEGINNING for name in split_points}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = pipeline(copy.deepcopy(model), mb_args=example_inputs, split_spec=spec)
    except Exception as exc:
        raise ModelFileError(f"torch.export could not split the model at {list(split_points)}: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    if pipe.num_stages != len(split_points) + 1:
        raise ModelFileError(f"splitting at {len(split_points)} points gave {pipe.num_stages} pieces, "
                             f"expected {len(split_points) + 1}; a split point may be called inside a loop or not at all")
    return pipe


def piece_names(pipe: Pipe) -> list[str]:
    """Names of the pieces' call_module nodes in the split graph, in execution order."""
    return [node.target for node in pipe.split_gm.graph.nodes if node.op == "call_module"]  # type: ignore[misc]
