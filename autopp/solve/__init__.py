"""Solvers: exact dynamic programs for contiguous splits, CP-SAT for heterogeneous clusters, and the joint search."""

from .dp import Objective, PipeSpec, Split, best_split, even_bounds, evaluate_split, min_max_bounds, min_peak_memory, pipeline_bounds
from .pinned import Pinned, evaluate_pinned
from .search import PlanRequest, RecomputeMode, make_plan

__all__ = ["Objective", "PipeSpec", "Split", "best_split", "even_bounds", "evaluate_split", "min_max_bounds",
           "min_peak_memory", "pipeline_bounds", "PlanRequest", "RecomputeMode", "make_plan", "Pinned", "evaluate_pinned"]
