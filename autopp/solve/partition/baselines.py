"""Naive splits to compare against: even by unit count, balanced by parameters (DeepSpeed's default), min-max time."""

from __future__ import annotations

from ...costmodel import UnitArrays
from .dp import Bounds, balanced_bounds, even_bounds

__all__ = ["baseline_bounds"]


def baseline_bounds(a: UnitArrays, num_stages: int) -> dict[str, Bounds]:
    """name -> split into `num_stages` stages: `even` (unit count), `params` (min-max parameter bytes, as DeepSpeed's
    partition_method="parameters"), `time` (min-max F + B per microbatch, ignoring memory and communication)."""
    return {"even": tuple(even_bounds(a.n, num_stages)),
            "params": balanced_bounds(a, num_stages, a.params),
            "time": balanced_bounds(a, num_stages, a.work())}
