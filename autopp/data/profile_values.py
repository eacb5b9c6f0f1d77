"""The profile's records of the split graph: live values and tied parameter groups, each read from and written to
meta.json in one place (docs/profile-format.md). No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..errors import ProfileError

__all__ = ["REPROFILE", "ValueAction", "LiveValue", "TiedGroup"]

#: What to do about a profile that cannot be read.
REPROFILE = "re-profile with `autopp profile MODEL.py`"


class ValueAction(Enum):
    """What a runner whose stages talk to neighbours only does with a live value."""

    SEND = "send"
    """Read by the next unit only."""
    RELAY = "relay"
    """Read further on: the units in between pass it on (and its gradient back when it needs one)."""
    RECOMPUTE = "recompute"
    """Made from constants and buffers only: every stage that reads it computes it locally."""


@dataclass(frozen=True, kw_only=True)
class LiveValue:
    """One value of the split graph that a unit reads from another unit or from the model inputs (`live_values` in
    meta.json, docs/profile-format.md)."""

    name: str
    """Its node name in the split graph (e.g. `getitem_1`)."""
    src: int
    """Producing unit; -1 for a model input."""
    dsts: tuple[int, ...]
    """Units reading it, ascending."""
    action: ValueAction
    relayed_over: tuple[int, ...] = ()
    """Units strictly between `src` and the last reader."""
    needs_grad: bool | None = None
    """Computed from a parameter, so its gradient is sent back; None in profiles that predate the field."""
    reads: tuple[str, ...] | None = None
    """Names of the live values its producing unit computes it from; None in profiles that predate the field."""
    bytes: dict[int, int] = field(default_factory=dict)
    """Microbatch size -> bytes of the value."""

    def crosses(self, k: int) -> bool:
        """Whether it is live across the cut before unit k (made before k, read at k or later)."""
        return self.src < k <= max(self.dsts)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "src": self.src, "dsts": list(self.dsts),
                                "action": self.action.value, "relayed_over": list(self.relayed_over)}
        if self.needs_grad is not None:
            data["needs_grad"] = self.needs_grad
        if self.reads is not None:
            data["reads"] = list(self.reads)
        return {**data, "bytes": {str(b): n for b, n in self.bytes.items()}}

    @staticmethod
    def from_json(data: Any, where: str) -> LiveValue:
        try:
            value = LiveValue(name=str(data["name"]), src=int(data["src"]), dsts=tuple(int(d) for d in data["dsts"]),
                              action=ValueAction(data["action"]),
                              relayed_over=tuple(int(u) for u in data.get("relayed_over", ())),
                              needs_grad=None if data.get("needs_grad") is None else bool(data["needs_grad"]),
                              reads=None if data.get("reads") is None else tuple(str(r) for r in data["reads"]),
                              bytes={int(b): int(n) for b, n in data.get("bytes", {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"{where}: bad entry of 'live_values' ({type(exc).__name__}: {exc}): {REPROFILE}") \
                from None
        if not value.dsts:
            raise ProfileError(f"{where}: live value {value.name!r} has no reader ('dsts' is empty): {REPROFILE}")
        return value


@dataclass(frozen=True, kw_only=True)
class TiedGroup:
    """Parameter names that are one tensor in the model (e.g. token embedding and LM head): `tied_parameters` in
    meta.json."""

    names: tuple[str, ...]
    units: tuple[int, ...]
    """Units whose modules hold one of the names: each gets its own copy when the model is cut."""
    bytes: int
    """The tensor's bytes, once."""

    def to_json(self) -> dict[str, Any]:
        return {"names": list(self.names), "units": list(self.units), "bytes": self.bytes}

    @staticmethod
    def from_json(data: Any, where: str) -> TiedGroup:
        try:
            return TiedGroup(names=tuple(str(n) for n in data["names"]), units=tuple(int(u) for u in data["units"]),
                             bytes=int(data["bytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{where}: bad entry of 'tied_parameters' ({type(exc).__name__}: {exc}): "
                               f"{REPROFILE}") from None

