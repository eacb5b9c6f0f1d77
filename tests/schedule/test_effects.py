"""Actions' effects: busy times, what a microbatch holds and when, in-flight counts, and the memory walks agree with
the simulator."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from autopp.errors import ScheduleError
from autopp.schedule import (NAMED, Action, Activation, Kind, ScheduleName, build_schedule, describe, policy,
                             simulate, stage_to_rank)
from autopp.schedule.effects import (FREES, Footprint, StageCost, added_at_start, durations, footprint, freed_at_end,
                                     RankWalk, inflight_peaks, live_change, memory_timeline, order_peaks,
                                     rank_peak, transient_peak)

KEEP, RECOMPUTE = Activation.KEEP, Activation.RECOMPUTE

COST = StageCost(forward_s=1.0, backward_input_s=2.0, backward_weight_s=3.0, overhead_s=0.5, activation_bytes=100,
                 input_bytes=7, static_bytes=1000)


def test_busy_time_per_kind_with_and_without_recompute() -> None:
    assert durations(COST, KEEP) == {Kind.F: 1.5, Kind.I: 2.5, Kind.W: 3.0, Kind.B: 5.5}
    assert durations(COST, RECOMPUTE) == {Kind.F: 1.5, Kind.I: 3.5, Kind.W: 3.0, Kind.B: 6.5}
    measured = StageCost(forward_s=1.0, backward_input_s=2.0, backward_weight_s=3.0, backward_s=4.0)
    assert durations(measured, KEEP)[Kind.B] == 4.0  # a measured full backward replaces I + W
    assert policy(RECOMPUTE).redo_s(COST) == 1.0 and policy(KEEP).redo_s(COST) == 0.0


def test_what_a_microbatch_holds_and_when() -> None:
    plain, again = footprint(COST, KEEP), footprint(COST, RECOMPUTE)
    assert plain == Footprint(kept=100, redone=0) and again == Footprint(kept=7, redone=100)
    for f in (plain, again):
        assert [added_at_start(k, f) for k in (Kind.F, Kind.I, Kind.W, Kind.B)] == [f.kept, f.redone, 0, f.redone]
        assert [freed_at_end(k, f) for k in (Kind.F, Kind.I, Kind.W, Kind.B)] == [0, 0, f.kept + f.redone,
                                                                                 f.kept + f.redone]
        for life in ((Kind.F, Kind.B), (Kind.F, Kind.I, Kind.W)):  # a finished microbatch leaves nothing behind
            assert sum(added_at_start(k, f) for k in life) == sum(freed_at_end(k, f) for k in life)
    assert FREES == {Kind.B, Kind.W}
    assert [live_change(k) for k in (Kind.F, Kind.I, Kind.W, Kind.B, Kind.SEND_F)] == [1, 0, -1, -1, 0]


def test_stage_costs_must_be_finite_and_non_negative() -> None:
    with pytest.raises(ScheduleError, match="finite and >= 0"):
        StageCost(forward_s=-1.0, backward_input_s=0.0, backward_weight_s=0.0)


@pytest.mark.parametrize("name", [ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B])
def test_inflight_peaks_equal_the_closed_forms(name: ScheduleName) -> None:
    exact = describe(name).exact_inflight
    assert exact is not None
    for p, m in ((1, 1), (2, 5), (4, 4), (4, 9)):
        order = build_schedule(name, p, m)
        walked = {s: n for r in order for s, n in inflight_peaks(order[r]).items()}
        assert tuple(walked[s] for s in range(p)) == exact(p, m)

ONE_OWNER = [n for n in NAMED if not describe(n).mirrored]  # Chimera: tests/schedule/test_chimera.py


def _case(name: ScheduleName, seed: int) -> tuple[dict[int, list[Action]], list[StageCost], list[int],
                                                  list[Activation]]:
    rng = random.Random(seed)
    v = 1 if describe(name).single_stage else 2
    owner = stage_to_rank(name, 3, v)
    costs = [StageCost(forward_s=rng.uniform(0.5, 2), backward_input_s=rng.uniform(0.5, 2),
                       backward_weight_s=rng.uniform(0.2, 1), static_bytes=rng.randint(0, 50),
                       activation_bytes=rng.randint(1, 90), input_bytes=rng.randint(0, 9)) for _ in owner]
    return build_schedule(name, 3, 6, v), costs, owner, [RECOMPUTE if rng.random() < 0.5 else KEEP for _ in owner]


@pytest.mark.parametrize("name", ONE_OWNER, ids=lambda n: n.value)
def test_memory_walks_equal_the_simulated_timeline(name: ScheduleName) -> None:
    order, costs, owner, activations = _case(name, 3)
    sim = simulate(order, costs, owner, [0.1] * (len(owner) - 1), activations)
    peaks = order_peaks(order, costs, owner, activations)
    for r in sorted(order):
        static = sum(c.static_bytes for c, o in zip(costs, owner) if o == r)
        timeline = memory_timeline([e for e in sim.events if e.rank == r], costs, activations, static)
        assert timeline == sim.memory_timeline[r] and timeline[-1] == (timeline[-1][0], static)
        assert rank_peak(order[r], costs, activations, static) == peaks[r] == sim.peak_memory_bytes[r]


@pytest.mark.parametrize("name", ONE_OWNER, ids=lambda n: n.value)
def test_a_rank_walk_gives_rank_peak_under_every_policy_choice(name: ScheduleName) -> None:
    order, costs, owner, _ = _case(name, 5)
    rng = random.Random(name.value)
    working = [replace(c, transient_bytes=rng.randint(0, 40)) for c in costs]
    for r in sorted(order):
        walk = RankWalk(order[r])
        for _ in range(6):
            activations = [rng.choice(list(Activation)) for _ in owner]
            assert walk.peak(working, activations, 17) == rank_peak(order[r], working, activations, 17)
    assert RankWalk([]).peak(working, [KEEP] * len(owner), 17) == rank_peak([], working, [KEEP] * len(owner), 17)


@pytest.mark.parametrize("name", ONE_OWNER, ids=lambda n: n.value)
def test_a_ranks_peak_adds_its_largest_transient_to_its_held_bytes(name: ScheduleName) -> None:
    order, costs, owner, activations = _case(name, 4)
    held = simulate(order, costs, owner, [0.1] * (len(owner) - 1), activations)
    working = [replace(c, transient_bytes=1000 * (s + 1)) for s, c in enumerate(costs)]
    sim = simulate(order, working, owner, [0.1] * (len(owner) - 1), activations)
    assert sim.memory_timeline == held.memory_timeline  # the timeline is held bytes only
    for r in sorted(order):
        top = 1000 * (max(s for s, o in enumerate(owner) if o == r) + 1)
        assert transient_peak((s for s, o in enumerate(owner) if o == r), working) == top
        walked = order_peaks(order, working, owner, activations)[r]
        assert sim.peak_memory_bytes[r] == held.peak_memory_bytes[r] + top == walked
