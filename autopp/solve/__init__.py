"""Solvers: the exact dynamic program for contiguous splits, and the outer search that builds a Plan."""

from .dp import Split, best_split, even_bounds, min_peak_memory, evaluate_split
from .search import PlanRequest, make_plan

__all__ = ["Split", "best_split", "even_bounds", "min_peak_memory", "evaluate_split", "PlanRequest", "make_plan"]
