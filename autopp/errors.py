"""Typed errors: every user-facing failure is an AutoppError whose message says what is wrong and what would fix it."""

from __future__ import annotations

__all__ = [
    "AutoppError",
    "ModelFileError",
    "TpPlanError",
    "ProfileError",
    "InfeasibleError",
    "PlanError",
    "ScheduleError",
    "RunError",
    "ContextParallelError",
    "LayoutError",
]


class AutoppError(Exception):
    """Base class of autopp's errors; the CLI prints the message on one line and exits 2."""


class ModelFileError(AutoppError):
    """The user's model file breaks the contract (missing file or function, wrong signature, too few units)."""


class TpPlanError(ModelFileError):
    """A tensor-parallel plan names no module, a style autopp does not support, a module no style can shard, or a
    degree that does not divide a sharded dimension."""


class ProfileError(AutoppError):
    """A profile file is missing, malformed, or belongs to another model."""


class InfeasibleError(AutoppError):
    """No plan satisfies the request; the message says what would make it feasible."""


class PlanError(AutoppError):
    """A plan file is malformed, of an unknown version, or does not match its model."""


class ScheduleError(AutoppError):
    """A schedule is invalid for its stage and microbatch counts, or deadlocks."""


class RunError(AutoppError):
    """A pipelined run failed: a rank raised, died or timed out, or validation failed."""


class ContextParallelError(RunError):
    """A context-parallel run was asked for something torch's ring attention cannot compute (autopp.run.context)."""


class LayoutError(AutoppError):
    """A parallel layout's degrees do not fit together or do not fit the devices (autopp.data.layout)."""
