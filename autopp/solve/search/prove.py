"""Branch and bound over the configurations: is the short-list's best the simulator's best?

The short-list (search._options) ranks configurations by a closed-form estimate, which the simulator does not
share: on Llama 3 405B over 8,192 H100s it dropped TP4 PP16 DP128 ZeRO 1, which the simulator ranks first
(docs/planner.md, "Outer search"). So after the short-list is judged, every configuration (the short-listed ones
included) is taken in order of a lower bound of its simulated step that holds for every split and every activation
policy (`bounds.lower_bound(simulated=True)`, checked against the judge in tests/solve/test_bounds.py), judged
(the DP's split, the memory walk, the simulator) and its split and policies refined under the simulator
(refine.py), until the next bound reaches the best step found less a relative gap (`GAP`, 1 %, as MIP solvers stop
at a relative optimality gap): branch and bound (Land and Doig, Econometrica 1960), the configurations the branches
and the bound the pruning test. What it leaves is within the gap: no configuration left has any split or policy
whose simulated step beats the best step found by more than 1 % (without the gap, configurations whose bound equals
the best step to a few digits, as at pp 1 where the bound is the step's compute, were each judged and refined: a
newcomer's 16-GPU plan took 126 s instead of 2 s). A budget of configurations
(`PlanRequest.judge_budget`) caps the work; when it is spent first, the plan says so (`Proof.words`), with the
least bound left.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Callable

from ...progress import PROGRESS_LOG, share_line
from .judge import Verdict

__all__ = ["Proof", "Attempt", "prove"]

log = logging.getLogger(__name__)
_progress = logging.getLogger(PROGRESS_LOG)

#: The relative optimality gap: a configuration whose lower bound is within it of the best step found is not judged.
GAP = 0.01

#: Seconds between progress lines (a display clock only: nothing planned depends on it).
_EVERY_S = 1.0

#: (configuration index, the best step found) -> the verdict of its best split found (the DP's under the first
#: activation mode whose DP finds one in memory, refined when that is not faster than the best step); None: none
#: fits or the runner refuses it.
Attempt = Callable[[int, float], "Verdict | None"]


@dataclass(frozen=True)
class Proof:
    """How the branch and bound ended."""

    judged: int
    """Configurations it took from its queue (those whose memory no split fits too)."""
    left: int
    """Configurations it left unjudged with a lower bound more than the gap below the best step (0: within the gap)."""
    least_s: float
    """The least lower bound among those left (inf when none is)."""
    best_s: float
    """The best simulated step when it ended."""

    @property
    def exact(self) -> bool:
        return self.left == 0

    def words(self) -> str:
        """One line for the plan's notes when the budget stopped it."""
        return (f"search stopped early: {self.judged} configurations judged in order of their lower bounds "
                f"(`judge_budget`), {self.left} left whose bound (least {self.least_s:.4g} s) is more than "
                f"{GAP * 100:g} % below the best step judged, {self.best_s:.4g} s: one of them may be faster "
                "(docs/planner.md, outer search)")


def prove(bounds: list[tuple[float, int]], attempt: Attempt, best_s: float,
          budget: int, gap: float = GAP) -> tuple[dict[int, Verdict], Proof]:
    """By index, the fitting verdicts of the configurations `bounds` lists ((lower bound of the simulated step under any
    activation policies, index)) judged in order of bound while it is below the best step found (starting at
    `best_s`, the short-list's) less the relative `gap`, at most `budget` of them."""
    queue = sorted(bounds)
    found: dict[int, Verdict] = {}
    judged = 0
    start = shown = time.monotonic()
    while judged < len(queue) and queue[judged][0] < best_s * (1 - gap) and judged < budget:
        bound, idx = queue[judged]
        judged += 1
        if time.monotonic() - shown >= _EVERY_S:
            shown = time.monotonic()
            _progress.info(_line(judged, bisect.bisect_left(queue, (best_s, -1)), budget, shown - start, best_s))
        got = attempt(idx, best_s)
        if got is not None and got.fits:
            log.info("branch and bound: configuration %d (bound %.6g s) simulated %.6g s", idx, bound, got.step_s)
            found[idx] = got
            best_s = min(best_s, got.step_s)
    left = [b for b, _ in queue[judged:] if b < best_s * (1 - gap)]
    return found, Proof(judged, len(left), min(left, default=float("inf")), best_s)


def _line(judged: int, below: int, budget: int, took_s: float, best_s: float) -> str:
    """`[###.....] 15%, about 2 min left: bounding configurations: 120 of 800 whose bound is below 15.47 s`: the
    share of those below the best step so far (or of the budget, when smaller) judged, at the rate so far."""
    total = max(min(below, budget), judged)
    f = (judged - 1) / total
    left = took_s * (1 - f) / f if f > 0 else None
    return share_line(f, left, f"bounding configurations: {judged} of {below} whose bound is below {best_s:.4g} s")
