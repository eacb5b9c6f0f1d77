"""Solvers: exact dynamic programs for contiguous splits, CP-SAT for heterogeneous clusters, and the joint search."""

from .partition.dp import Objective, PipeSpec, even_bounds, min_max_bounds, min_memory, pipeline_bounds
from .assemble.make import make_plan
from .assemble.pinned import Pinned, evaluate_pinned
from .search.request import PlanRequest, RecomputeMode

__all__ = ["Objective", "PipeSpec", "even_bounds", "min_max_bounds", "min_memory", "pipeline_bounds", "PlanRequest",
           "RecomputeMode", "make_plan", "Pinned", "evaluate_pinned"]
