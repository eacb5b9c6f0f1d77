"""What each unit of a plan is to a trainer: the input part (embedding), one repeated block, or the output part."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from ..data.profile_values import LiveValue, ValueAction
from ..errors import AutoppError

__all__ = ["ExportError", "ModelLayers", "model_layers", "skip_problem"]

_BLOCK = re.compile(r"^(?P<container>.+)\.(?P<index>\d+)$")


class ExportError(AutoppError):
    """A plan cannot be written for (or a trainer's configuration cannot be read into) the requested trainer."""


@dataclass(frozen=True)
class ModelLayers:
    """Unit indices by role: trainers count transformer layers, and place the embedding and the head apart."""

    pre: int | None
    """The unit before the first block (embedding), if any: always unit 0."""
    blocks: tuple[int, ...]
    """Units that are one block each, `container.0`, `container.1`, ... in order."""
    post: int | None
    """The unit after the last block (final norm, head, loss), if any: always the last unit."""
    container: str
    """The blocks' container, e.g. `model.layers`."""

    @property
    def num_units(self) -> int:
        return len(self.blocks) + (self.pre is not None) + (self.post is not None)


def model_layers(unit_names: Sequence[str], where: str) -> ModelLayers:
    """Classify units as [input part] + blocks of one container numbered from 0 + [output part]; an ExportError
    (naming `where`) when the units are not in that form (e.g. two block containers, or SPLIT_POINTS inside blocks)."""
    matches = [_BLOCK.match(n) for n in unit_names]
    blocks = [k for k, m in enumerate(matches) if m]
    if not blocks:
        raise ExportError(f"{where}: no unit is a numbered block (like layers.0); trainers count transformer "
                          f"layers, and the units are {list(unit_names)} (DeepSpeed's export and torch-csv take any "
                          "units)")
    containers = {matches[k].group("container") for k in blocks}  # type: ignore[union-attr]
    first, last = blocks[0], blocks[-1]
    indices = [int(matches[k].group("index")) for k in blocks]  # type: ignore[union-attr]
    if len(containers) > 1 or blocks != list(range(first, last + 1)) or indices != list(range(len(blocks))):
        raise ExportError(f"{where}: trainers need one stack of blocks numbered from 0 with the embedding before it "
                          f"and the head after it; the units are {list(unit_names)} (DeepSpeed's export and "
                          "torch-csv take any units)")
    if first > 1 or len(unit_names) - 1 - last > 1:
        raise ExportError(f"{where}: more than one unit before or after the blocks ({list(unit_names)}); a trainer "
                          "has one embedding part and one output part")
    return ModelLayers(pre=0 if first == 1 else None, blocks=tuple(blocks),
                       post=len(unit_names) - 1 if last < len(unit_names) - 1 else None, container=containers.pop())


def skip_problem(values: Sequence[LiveValue], unit_names: Sequence[str]) -> str | None:
    """Why a trainer whose layers pass one hidden state from each to the next cannot express the model, or None: the
    first value a unit makes that a unit further on than the next reads (a skip connection: `ValueAction.RELAY` in
    the profile's live values, autopp.data.profile_values)."""
    for v in values:
        if v.action is ValueAction.RELAY and v.src >= 0:
            last = max(v.dsts)
            return (f"unit {last} ({unit_names[last]}) reads {v.name!r} of unit {v.src} ({unit_names[v.src]}), "
                    f"{last - v.src - 1} units back (a skip connection: the profile's live values)")
    return None
