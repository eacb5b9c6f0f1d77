"""What the profiler can be asked to assume: the optimizer (and the state it keeps per parameter) and the parameter
dtype. Shared by the profiler and its co-runner processes."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["OPTIMIZER_STATES", "DTYPES", "make_optimizer", "check_options"]

#: Optimizer state kept per parameter, in multiples of the parameter's element count (fp32 states).
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
#: Parameter dtypes that can be profiled; below float32, an fp32 master copy is counted with the optimizer state.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer that OPTIMIZER_STATES[`name`] describes, over `params`."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if name == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=1e-3)


def check_options(sizes: list[int], optimizer: str, dtype: str) -> None:
    """ValueError unless the microbatch `sizes` are positive and the optimizer and dtype are known (measured and
    analytic profiles take the same options)."""
    if not sizes or sizes[0] < 1:
        raise ValueError(f"microbatch sizes must be positive integers, got {sizes}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
