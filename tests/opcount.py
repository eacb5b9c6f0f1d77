"""A dispatch mode that counts the aten ops reaching it, for the tests of what selective recomputation reruns."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCount"]


class OpCount(TorchDispatchMode):
    """`ops`: how often each op (its overload packet's name, e.g. "aten.mm") ran under the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))
