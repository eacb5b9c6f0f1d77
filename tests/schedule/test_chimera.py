"""Chimera (Li and Hoefler, SC'21): the bidirectional order, its size rules, and how the simulator runs its two
pipelines (each rank holds two replicas; the up half of the microbatches runs stage s on rank p - 1 - s)."""

from __future__ import annotations

import random

import pytest

from autopp.errors import ScheduleError
from autopp.schedule import Action, Activation, Kind, ScheduleName, StageCost, build_schedule, describe, simulate, simulate_named
from autopp.schedule.effects import order_peaks, rank_static_bytes

CHIMERA = ScheduleName.CHIMERA


def _costs(p: int, seed: int = 0) -> list[StageCost]:
    rng = random.Random(seed)
    return [StageCost(forward_s=rng.uniform(0.5, 1.5), backward_input_s=rng.uniform(0.5, 1.5),
                      backward_weight_s=rng.uniform(0.2, 1), static_bytes=10 * (s + 1),
                      activation_bytes=rng.randint(1, 9), input_bytes=1) for s in range(p)]


def _uniform(p: int) -> list[StageCost]:
    return [StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0, backward_s=2.0,
                      activation_bytes=1) for _ in range(p)]


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 6), (4, 4), (4, 8), (4, 10), (6, 6), (8, 8), (8, 32)])
def test_each_rank_runs_its_two_replicas_and_every_microbatch_once(p: int, m: int) -> None:
    order = build_schedule(CHIMERA, p, m)
    half = m // 2
    for r, acts in order.items():
        want = {(r, k, i) for k in (Kind.F, Kind.B) for i in range(half)}
        want |= {(p - 1 - r, k, i) for k in (Kind.F, Kind.B) for i in range(half, m)}
        assert len(acts) == len(want) and set(acts) == {Action(*x) for x in want}
        for s in (r, p - 1 - r):  # each replica runs its microbatches in order, forwards and backwards
            for kind in (Kind.F, Kind.B):
                mbs = [a.microbatch for a in acts if a.stage == s and a.kind is kind]
                assert mbs == sorted(mbs)


def test_the_paper_basic_unit_has_fewer_bubbles_than_1f1b() -> None:
    # Unit F, B = 2F (the paper's assumption): 1F1B idles 2(p - 1) forward slots per rank on top of m (F + B);
    # Chimera's order idles fewer (the paper's basic unit of m = p: p - 2 slots with F = B).
    for p in (2, 4, 8):
        chimera = simulate_named(CHIMERA, p, p, _uniform(p), [0.0] * (p - 1)).step_time_s
        one = simulate_named(ScheduleName.ONE_F_ONE_B, p, p, _uniform(p), [0.0] * (p - 1)).step_time_s
        assert one == 3 * p + 3 * (p - 1)
        assert chimera < one
    assert simulate_named(CHIMERA, 4, 4, _uniform(4), [0.0] * 3).step_time_s == 16.0  # against 1F1B's 21


@pytest.mark.parametrize(("p", "m", "message"), [
    (3, 6, "Chimera needs an even number of ranks (3 % 2 = 1)"),
    (4, 5, "Chimera needs an even number of microbatches, half per direction (5 % 2 = 1)"),
    (4, 4, None),
])
def test_size_rules_name_numbers(p: int, m: int, message: str | None) -> None:
    if message is None:
        assert describe(CHIMERA).validate(p, m) == 1
        return
    with pytest.raises(ScheduleError) as err:
        build_schedule(CHIMERA, p, m)
    assert str(err.value) == message


def test_layout_is_the_down_pipeline_and_the_up_half_is_mirrored() -> None:
    d = describe(CHIMERA)
    assert d.stage_to_rank(4) == [0, 1, 2, 3] and d.mirror(8) == 4 and d.mirrored
    assert describe(ScheduleName.ONE_F_ONE_B).mirror(8) is None


def test_events_respect_both_chains_and_each_rank_holds_two_replicas() -> None:
    p, m = 4, 8
    costs, comm = _costs(p, 3), [0.2, 0.1, 0.3]
    result = simulate_named(CHIMERA, p, m, costs, comm)
    end = {e.action: e.end_s for e in result.events}
    rank = {e.action: e.rank for e in result.events}
    for e in result.events:
        a, up = e.action, e.action.microbatch >= m // 2
        assert e.rank == (p - 1 - a.stage if up else a.stage)
        if a.kind is Kind.F and a.stage > 0:
            assert e.start_s >= end[Action(a.stage - 1, Kind.F, a.microbatch)] + comm[a.stage - 1] - 1e-12
        if a.kind is Kind.B and a.stage < p - 1:
            assert e.start_s >= end[Action(a.stage + 1, Kind.B, a.microbatch)] + comm[a.stage] - 1e-12
            assert rank[Action(a.stage + 1, Kind.B, a.microbatch)] != e.rank
    for r in range(p):
        static = costs[r].static_bytes + costs[p - 1 - r].static_bytes  # weights, grads, optimizer: twice
        assert rank_static_bytes(costs, list(range(p)), r, mirrored=True) == static
        assert result.memory_timeline[r][-1][1] == static
    order = build_schedule(CHIMERA, p, m)
    assert order_peaks(order, costs, list(range(p)), [Activation.KEEP] * p, True) == result.peak_memory_bytes


def test_progress_delays_wait_on_the_up_replicas_sender() -> None:
    p, m = 4, 8
    costs, comm = _costs(p, 11), [0.1, 0.2, 0.1]
    plain = simulate_named(CHIMERA, p, m, costs, comm)
    delayed = simulate_named(CHIMERA, p, m, costs, comm, progress_s=[0.7] * (p - 1))
    assert len(delayed.events) == len(plain.events) == 2 * p * m
    assert plain.step_time_s - 1e-12 <= delayed.step_time_s <= plain.step_time_s + 0.7 * 2 * m * p


def test_an_up_action_on_the_down_rank_is_refused() -> None:
    order = build_schedule(CHIMERA, 2, 2)
    order[0] = [Action(0, Kind.F, 1), *order[0]]  # microbatch 1 goes up: stage 0 runs on rank 1
    with pytest.raises(ScheduleError, match="0F1 is on rank 0 but stage 0's up replica lives on rank 1"):
        simulate(order, _uniform(2), [0, 1], [0.0], mirror=1)
