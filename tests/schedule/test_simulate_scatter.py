"""The simulator's reduce-scatter stream (`StageCost.scatter_s`: ZeRO 2's first-unit scatter under FSDP2, issues 25
and 27): the rank goes on with its next action while the scatter runs, the stream queues, the step waits for it, and
a stage without one simulates as before."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from autopp.schedule import ScheduleName, build_schedule, describe, stage_to_rank, stages_per_rank
from autopp.schedule.actions import Action, Kind
from autopp.schedule.effects import StageCost
from autopp.schedule.simulate import SimResult, simulate, simulate_named

F, B, W, I = Kind.F, Kind.B, Kind.W, Kind.I


def _one_rank(scatter: float) -> SimResult:
    """One stage on one rank: F0 B0 F1 B1, F = 1, B = 2."""
    order = {0: [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)]}
    return simulate(order, [StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0,
                                      scatter_s=scatter)], [0], [])


def _starts(result: SimResult) -> dict[Action, tuple[float, float]]:
    return {e.action: (e.start_s, e.end_s) for e in result.events}


def test_the_next_forward_starts_right_after_the_backward_while_the_scatter_runs() -> None:
    """B0 ends at 3 and F1 starts then; the first scatter runs [3, 8], the second waits for the stream: [8, 13];
    the step ends with it, 7 s after the rank's last action."""
    result = _one_rank(5.0)
    at = _starts(result)
    assert at[Action(0, F, 1)] == (3.0, 4.0) and at[Action(0, B, 1)] == (4.0, 6.0)
    assert result.step_time_s == pytest.approx(13.0) and result.scatter_tail_s == pytest.approx((7.0,))
    assert result.bubble_fraction == pytest.approx([7.0 / 13.0])


def test_a_short_scatter_hides_but_the_last_one() -> None:
    """Scatters of 0.5 s: the first ends under F1, the last outlasts B1 by its whole 0.5 s."""
    result = _one_rank(0.5)
    assert _starts(result)[Action(0, B, 1)] == (4.0, 6.0)
    assert result.step_time_s == pytest.approx(6.5) and result.scatter_tail_s == pytest.approx((0.5,))


def _costs(n: int, seed: int, scatter: bool) -> list[StageCost]:
    rng = random.Random(seed)
    return [StageCost(forward_s=rng.uniform(0.5, 2), backward_input_s=rng.uniform(0.5, 2),
                      backward_weight_s=rng.uniform(0.5, 2), scatter_s=rng.uniform(0, 4) if scatter else 0.0)
            for _ in range(n)]


NAMES = [ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.INTERLEAVED_1F1B,
         ScheduleName.INTERLEAVED_ZERO_BUBBLE, ScheduleName.ZBV_ZERO_BUBBLE]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(3))
def test_the_step_ends_no_earlier_than_each_scatter_and_the_actions_do_not_wait_for_it(name: ScheduleName,
                                                                                       seed: int) -> None:
    """Every B or W (never an I) queues its stage's scatter; the stream runs them one after another, each from
    max(its action's end, the stream free), and the step ends after the last; the actions' times are those of the
    same step without the scatters."""
    p, m = 3, 6
    v = stages_per_rank(name, 1 if describe(name).fixed_v == 1 else 2)
    costs = _costs(p * v, seed, scatter=True)
    comm = [0.1] * (p * v - 1)
    result = simulate_named(name, p, m, costs, comm, v=v)
    plain = simulate_named(name, p, m, [replace(c, scatter_s=0.0) for c in costs], comm, v=v)
    assert _starts(result) == _starts(plain) and plain.scatter_tail_s == ()
    owner = stage_to_rank(name, p, v)
    free = [0.0] * p
    for e in sorted(result.events, key=lambda e: e.end_s):
        if e.action.kind in (B, W):
            r = owner[e.action.stage]
            free[r] = max(free[r], e.end_s) + costs[e.action.stage].scatter_s
    assert result.step_time_s == pytest.approx(max(plain.step_time_s, *free))
    ends = [max(e.end_s for e in result.events if e.rank == r) for r in range(p)]
    assert result.scatter_tail_s == pytest.approx(tuple(max(0.0, f - x) for f, x in zip(free, ends)))


def test_without_a_scatter_nothing_changes() -> None:
    """scatter_s 0 everywhere: the same result as the costs without the field, no tails."""
    costs = _costs(4, 7, scatter=False)
    order = build_schedule(ScheduleName.ONE_F_ONE_B, 4, 8)
    owner = stage_to_rank(ScheduleName.ONE_F_ONE_B, 4)
    result = simulate(order, costs, owner, [0.2] * 3)
    assert result.scatter_tail_s == () and result.step_time_s == pytest.approx(
        max(e.end_s for e in result.events))
