"""The search's refinement helpers: a configuration the refinement would not search is left unjudged only when its
DP split's floor is above the best step, and never for a schedule that overlaps forward-backward pairs."""

from __future__ import annotations

from dataclasses import replace

from autopp.costmodel import UnitArrays
from autopp.schedule import Activation, ScheduleName
from autopp.solve.partition.refine import candidate_floor
from autopp.solve.search.judge import Candidate, judge
from autopp.solve.search.refining import beyond
from autopp.solve.search.request import PlanRequest

from .test_refine import _case


def _big(name: ScheduleName) -> tuple[UnitArrays, PlanRequest, Candidate]:
    a, cluster, c = _case(name, 0)
    c = replace(c, microbatches=5000)  # one simulation costs more than the refinement's allowance
    return a, PlanRequest(cluster=cluster, global_batch=5000), c


def test_a_split_whose_floor_is_above_the_best_is_beyond_it() -> None:
    a, req, c = _big(ScheduleName.ONE_F_ONE_B)
    floor = candidate_floor(a, req.cluster, c)
    assert floor <= judge(a, req.cluster, c).step_s
    assert beyond(a, req, c, floor / 2)
    assert not beyond(a, req, c, floor)


def test_a_recomputing_split_counts_what_it_redoes() -> None:
    a, req, c = _big(ScheduleName.ONE_F_ONE_B)
    redo = replace(c, activations=(Activation.RECOMPUTE,) * len(c.bounds))
    assert candidate_floor(a, req.cluster, c) < candidate_floor(a, req.cluster, redo) <= judge(a, req.cluster,
                                                                                              redo).step_s


def test_refined_or_overlapped_configurations_are_always_judged() -> None:
    a, cluster, c = _case(ScheduleName.ONE_F_ONE_B, 0)
    assert not beyond(a, PlanRequest(cluster=cluster, global_batch=4), c, 0.0)  # m 4: the refinement searches it
    a, req, dual = _big(ScheduleName.DUAL_PIPE_V)
    assert not beyond(a, req, dual, 0.0)
