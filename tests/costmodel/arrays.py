"""UnitArrays built by hand for the cost-model tests (one value per unit)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from autopp.costmodel import UnitArrays


def arrays(forward: Sequence[float], *, backward: Sequence[float] | None = None,
           backward_input: Sequence[float] | None = None, backward_weight: Sequence[float] | None = None,
           static: Sequence[float] | None = None, activation: Sequence[float] | None = None,
           grads: Sequence[float] | None = None, cut: Sequence[float] | None = None,
           optimizer: Sequence[float] | None = None) -> UnitArrays:
    """Defaults: B = 2 F split into halves, no bytes; `cut` has the n - 1 interior cuts."""
    n = len(forward)
    f = np.array(forward, dtype=np.float64)
    b = np.array(backward, dtype=np.float64) if backward is not None else 2 * f
    vec = lambda xs, default: np.array(xs if xs is not None else default, dtype=np.float64)  # noqa: E731
    return UnitArrays(f, vec(backward_input, b / 2), vec(backward_weight, b / 2), f.copy(), vec(static, [0] * n),
                      vec(activation, [0] * n), vec(grads, [0] * n), vec(grads, [0] * n),
                      np.array([0.0, *(cut if cut is not None else [0] * (n - 1)), 0.0]), False, b,
                      None if optimizer is None else np.array(optimizer, dtype=np.float64))
