"""The refinement of the search's verdicts under the simulator (refine.py), within a budget of simulated actions,
and the test that leaves a configuration unjudged when its DP split cannot beat the best step found."""

from __future__ import annotations

import math
from typing import Callable

from ...costmodel import UnitArrays
from ...schedule import pairing
from ..partition.dp import Bounds
from ..partition.refine import EXACT_LIMIT, SLACK, candidate_floor, refine
from .judge import Candidate, Verdict
from .request import PlanRequest
from .views import Views

__all__ = ["refined", "refine_one", "beyond"]


#: Simulated actions the local search may spend per configuration (about 0.3 s on the development machine): its budget
#: of simulations is this over one simulation's actions, at most 32; below one, the configuration is not refined.
_REFINE_ACTIONS = 25_000
#: Other short-listed configurations are refined when their DP split is within this factor of the best step found.
_REFINE_WITHIN = 1.02


def refined(n: int, views: Views, fitting: list[Verdict],
            runs: Callable[[Candidate], Callable[[Bounds], bool]]) -> list[Verdict]:
    """Short-listed verdicts replaced by the simulator's best split and recompute choice for their configuration
    (refine.py), fastest first: always the fastest (so the chosen configuration's split is the simulator's optimum
    where refine is exact, and never worse than the DP's elsewhere), then each other one whose splits are few enough
    to visit all and whose DP split is within `_REFINE_WITHIN` of the best found so far."""
    out: list[Verdict] = []
    for k, v in enumerate(sorted(fitting, key=lambda x: x.key)):
        c = v.candidate
        exact = math.comb(n - 1, len(c.bounds) - 1) <= EXACT_LIMIT
        if k and (not exact or v.step_s > _REFINE_WITHIN * min(x.step_s for x in out)):
            out.append(v)
            continue
        beat = min((x.step_s for x in out), default=math.inf)  # splits that cannot beat it need no simulation
        out.append(refine_one(views, v, runs(c), beat))
    return out


def refine_one(views: Views, v: Verdict, runs: Callable[[Bounds], bool], beat: float) -> Verdict:
    """`v`, or the simulator's better split and recompute choice for its configuration (refine.py; splits that
    cannot beat `beat` are not simulated); as it is when one simulation costs more than `_REFINE_ACTIONS`."""
    c = v.candidate
    budget = _refine_budget(c)
    if budget < 1:  # one simulation costs more than the whole allowance: the DP's split stands
        return v
    req = views.request(c.layout)
    a = views.arrays(c.microbatch_size, c.layout)
    found = refine(a, req.cluster, c, req.ladder(a), admissible=runs, budget=budget,
                   fixed=req.pinned_activations(len(c.bounds)), beat=beat).best
    return found if found is not None and found.key < v.key else v


def _refine_budget(c: Candidate) -> int:
    """Simulations the local search may spend on `c`'s configuration (`_REFINE_ACTIONS`)."""
    return min(32, _REFINE_ACTIONS // (3 * len(c.bounds) * c.microbatches))


def beyond(a: UnitArrays, req: PlanRequest, cand: Candidate, best_s: float) -> bool:
    """Whether `cand`'s configuration is left as the DP split (no refinement: `_refine_budget` below 1) and that
    split's floor under its policies (refine.candidate_floor) is above `best_s`: its verdict is slower."""
    if _refine_budget(cand) >= 1 or pairing(cand.schedule, a.overlap.ep_a2a, cand.layout.v) is not None:
        return False
    return candidate_floor(a, req.cluster, cand) > best_s * SLACK
