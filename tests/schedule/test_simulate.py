"""Simulator: agreement with pipeline theory, communication, memory, recomputation, deadlock and input errors."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from autopp.errors import ScheduleError
from autopp.schedule.actions import Action, Kind
from autopp.schedule import (NAMED, Activation, Pairing, ScheduleName, build_schedule, describe, pairing,
                             stage_to_rank, stages_per_rank)
from autopp.schedule.effects import StageCost
from autopp.schedule.simulate import SimResult, simulate, simulate_named

MB = 2**20


def _uniform(stages: int, f: float = 1.0, i: float = 1.0, w: float = 1.0, act: int = MB) -> list[StageCost]:
    return [StageCost(forward_s=f, backward_input_s=i, backward_weight_s=w, activation_bytes=act)] * stages


def _run(name: ScheduleName, p: int, m: int, v: int = 1, scale: float = 1.0, w_share: float = 0.5) -> SimResult:
    """Same model (F = 1, B = 2 per microbatch in total) split into p * v equal stages, free communication."""
    v = stages_per_rank(name, v)
    n = p * v
    costs = _uniform(n, 1.0 / v * scale, 2.0 * (1 - w_share) / v * scale, 2.0 * w_share / v * scale)
    return simulate_named(name, p, m, costs, [0.0] * (n - 1), v=v)


def _idle(result: SimResult) -> float:
    return max(result.bubble_fraction) * result.step_time_s


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (8, 32), (3, 7)])
def test_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p: int, m: int) -> None:
    result = _run(ScheduleName.ONE_F_ONE_B, p, m)
    assert result.step_time_s == pytest.approx(3.0 * (m + p - 1))
    assert result.bubble_fraction == pytest.approx([(p - 1) / (m + p - 1)] * p)


def test_gpipe_keeps_m_activations_1f1b_keeps_p_on_first_stage() -> None:
    p, m = 4, 12
    assert _run(ScheduleName.GPIPE, p, m).peak_memory_bytes == [m * MB] * p
    assert _run(ScheduleName.ONE_F_ONE_B, p, m).peak_memory_bytes == [(p - r) * MB for r in range(p)]


@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_cuts_bubble_about_v_times(v: int) -> None:
    p, m = 4, 16
    plain = _idle(_run(ScheduleName.ONE_F_ONE_B, p, m))
    interleaved = _idle(_run(ScheduleName.INTERLEAVED_1F1B, p, m, v))
    assert plain == pytest.approx(3.0 * (p - 1))
    assert plain / interleaved == pytest.approx(v, rel=0.2)


@pytest.mark.parametrize(
    ("name", "v"),
    [(ScheduleName.INTERLEAVED_ZERO_BUBBLE, 1), (ScheduleName.INTERLEAVED_ZERO_BUBBLE, 2),
     (ScheduleName.ZBV_ZERO_BUBBLE, 2), (ScheduleName.DUAL_PIPE_V, 2)],
)
def test_zero_bubble_beats_1f1b_when_w_is_a_third_of_backward(name: ScheduleName, v: int) -> None:
    p, m = 4, 16
    baseline = _run(ScheduleName.ONE_F_ONE_B, p, m, w_share=1 / 3).step_time_s
    assert _run(name, p, m, v, w_share=1 / 3).step_time_s < baseline


def test_communication_only_between_ranks() -> None:
    costs = _uniform(2, 1.0, 2.0, 0.0)
    two_ranks = simulate({0: [Action(0, Kind.F, 0), Action(0, Kind.B, 0)], 1: [Action(1, Kind.F, 0), Action(1, Kind.B, 0)]},
                         costs, [0, 1], [0.5])
    assert two_ranks.step_time_s == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    one_rank = simulate({0: [Action(0, Kind.F, 0), Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(0, Kind.B, 0)]},
                        costs, [0, 0], [0.5])
    assert one_rank.step_time_s == pytest.approx(6.0)
    assert one_rank.bubble_fraction == [0.0]


def test_recompute_adds_forward_and_keeps_only_inputs() -> None:
    cost = StageCost(forward_s=1.0, backward_input_s=2.0, backward_weight_s=1.0, static_bytes=100,
                     activation_bytes=1000, input_bytes=10)
    order = {0: [Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0), Action(0, Kind.B, 1)]}
    plain = simulate(order, [cost], [0], [])
    again = simulate(order, [cost], [0], [], activations=[Activation.RECOMPUTE])
    assert plain.step_time_s == 8.0 and again.step_time_s == 10.0
    assert plain.peak_memory_bytes == [100 + 2000]
    assert again.peak_memory_bytes == [100 + 2 * 10 + 1000]
    assert again.memory_timeline[0] == [(0.0, 110), (1.0, 120), (2.0, 1120), (6.0, 1110), (10.0, 100)]


def test_split_backward_frees_activations_after_w() -> None:
    cost = StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0, activation_bytes=7)
    result = simulate({0: [Action(0, Kind.F, 0), Action(0, Kind.I, 0), Action(0, Kind.W, 0)]}, [cost], [0], [])
    assert result.memory_timeline[0] == [(0.0, 7), (3.0, 0)]

ONE_OWNER = [n for n in NAMED if not describe(n).mirrored]  # Chimera: tests/schedule/test_chimera.py


def _random_case(name: ScheduleName, seed: int) -> tuple[int, int, int, list[StageCost], list[float]]:
    """3 ranks, 6 microbatches, random stage costs and transfer times: (p, m, v, costs, comm)."""
    rng = random.Random(seed)
    p, m = 3, 6
    v = 2 if name in (ScheduleName.INTERLEAVED_1F1B, ScheduleName.LOOPED_BFS) else stages_per_rank(name)
    n = p * v
    costs = [StageCost(forward_s=rng.uniform(0.5, 1.5), backward_input_s=rng.uniform(0.5, 1.5),
                       backward_weight_s=rng.uniform(0.2, 1), static_bytes=5, activation_bytes=rng.randint(1, 9),
                       input_bytes=1) for _ in range(n)]
    return p, m, v, costs, [rng.uniform(0, 0.3) for _ in range(n - 1)]


@pytest.mark.parametrize("name", ONE_OWNER, ids=lambda n: n.value)
def test_events_respect_dependencies_and_memory_returns_to_static(name: ScheduleName) -> None:
    p, m, v, costs, comm = _random_case(name, 7)
    n = p * v
    owner = stage_to_rank(name, p, v)
    result = simulate_named(name, p, m, costs, comm, v=v,
                            activations=[Activation.RECOMPUTE if s % 2 == 0 else Activation.KEEP for s in range(n)])
    end = {e.action: e.end_s for e in result.events}
    for e in result.events:
        a = e.action
        if a.kind is Kind.F and a.stage > 0:
            hop = comm[a.stage - 1] if owner[a.stage - 1] != owner[a.stage] else 0.0
            assert e.start_s >= end[Action(a.stage - 1, Kind.F, a.microbatch)] + hop - 1e-12
        if a.kind in (Kind.B, Kind.I):
            assert e.start_s >= end[Action(a.stage, Kind.F, a.microbatch)] - 1e-12
    for r in range(p):
        spans = sorted((e.start_s, e.end_s) for e in result.events if e.rank == r)
        assert all(b[0] >= a[1] - 1e-12 for a, b in zip(spans, spans[1:]))
        assert result.memory_timeline[r][-1][1] == sum(c.static_bytes for s, c in enumerate(costs) if owner[s] == r)


def test_idle_slots_and_comm_actions_are_ignored() -> None:
    order = build_schedule(ScheduleName.ONE_F_ONE_B, 2, 2)
    noisy = {0: [None, *order[0], Action(0, Kind.SEND_F, 0)], 1: [Action(1, Kind.RECV_F, 0), *order[1], None]}
    costs = _uniform(2)
    assert simulate(noisy, costs, [0, 1], [0.1]).step_time_s == simulate(order, costs, [0, 1], [0.1]).step_time_s


def test_deadlock_names_missing_producer() -> None:
    order = build_schedule(ScheduleName.GPIPE, 2, 4)
    order[0] = [a for a in order[0] if a != Action(0, Kind.F, 3)]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 1 waits for 0F3 before 1F3 .*not scheduled on any rank"):
        simulate(order, _uniform(2), [0, 1], [0.0])


def test_deadlock_names_cycle_between_ranks() -> None:
    order = {0: [Action(0, Kind.F, 0), Action(0, Kind.B, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 1)],
             1: [Action(1, Kind.F, 1), Action(1, Kind.B, 1), Action(1, Kind.F, 0), Action(1, Kind.B, 0)]}
    with pytest.raises(ScheduleError, match=r"rank 0 waits for 1B0 before 0B0 at position 1 \(rank 1 has it at position 3"):
        simulate(order, _uniform(2), [0, 1], [0.0])


@pytest.mark.parametrize(
    ("order", "owner", "comm", "message"),
    [
        ({0: [Action(1, Kind.F, 0)], 1: []}, [0, 1], [0.0], r"1F0 is on rank 0 but stage 1 lives on rank 1"),
        ({0: [Action(0, Kind.F, 0), Action(0, Kind.F, 0)], 1: []}, [0, 1], [0.0], r"0F0 is scheduled twice"),
        ({0: [Action(5, Kind.F, 0)], 1: []}, [0, 1], [0.0], r"stage 5 outside 0..1"),
        ({0: [], 1: []}, [0, 1], [], r"one entry per stage boundary \(0 != 1\)"),
        ({0: [], 2: []}, [0, 1], [0.0], r"ranks 0..1, got \[0, 2\]"),
    ],
)
def test_malformed_inputs(order: dict[int, list[Action]], owner: list[int], comm: list[float], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        simulate(order, _uniform(2), owner, comm)


def test_stage_count_must_match_schedule() -> None:
    with pytest.raises(ScheduleError, match=r"has 8 stages, but 4 stage costs"):
        simulate_named(ScheduleName.ZBV_ZERO_BUBBLE, 4, 8, _uniform(4), [0.0] * 3)


def test_negative_cost_rejected() -> None:
    with pytest.raises(ScheduleError, match="finite and >= 0"):
        StageCost(forward_s=-1.0, backward_input_s=1.0, backward_weight_s=1.0)


def test_message_overhead_keeps_the_rank_busy_on_f_and_b_not_w_nor_the_recompute() -> None:
    """The overhead is added to each F and each B or I action's busy time; W sends nothing; a recomputing stage's
    re-run forward sends nothing either."""
    base = StageCost(forward_s=1.0, backward_input_s=2.0, backward_weight_s=1.0)
    busy = StageCost(forward_s=1.0, backward_input_s=2.0, backward_weight_s=1.0, overhead_s=0.25)
    order = {0: [Action(0, Kind.F, 0), Action(0, Kind.I, 0), Action(0, Kind.W, 0)]}
    events = simulate(order, [busy], [0], []).events
    assert [round(e.end_s - e.start_s, 9) for e in events] == [1.25, 2.25, 1.0]
    full = {0: [Action(0, Kind.F, 0), Action(0, Kind.B, 0)]}
    assert simulate(full, [busy], [0], []).step_time_s == pytest.approx(simulate(full, [base], [0], []).step_time_s + 0.5)
    redo = simulate(full, [busy], [0], [], activations=[Activation.RECOMPUTE]).step_time_s
    assert redo == pytest.approx(1.25 + (1.0 + 2.0 + 1.0 + 0.25))
    with pytest.raises(ScheduleError, match="finite and >= 0"):
        StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0, overhead_s=-1.0)


def test_an_action_after_a_wait_takes_resume_s_longer_and_back_to_back_ones_do_not() -> None:
    # 1F1B, 2 ranks, 2 microbatches; stage 0 short (F 1, B 1), stage 1 long (F 3, B 4), resume 0.5. Rank 1 waits
    # for 0F0 (1F0 ends at 1 + 3 + 0.5), then runs back to back; rank 0 waits for each gradient (0B0 at 8.5, 0B1 at
    # 15.5), so each of its backwards takes 1.5; its forwards start at once.
    short = StageCost(forward_s=1.0, backward_input_s=0.5, backward_weight_s=0.5, resume_s=0.5)
    long = StageCost(forward_s=3.0, backward_input_s=2.0, backward_weight_s=2.0, resume_s=0.5)
    order = build_schedule(ScheduleName.ONE_F_ONE_B, 2, 2)
    result = simulate(order, [short, long], [0, 1], [0.0])
    spans = {(str(e.action)): (e.start_s, e.end_s) for e in result.events}
    assert spans == {"0F0": (0.0, 1.0), "0F1": (1.0, 2.0), "1F0": (1.0, 4.5), "1B0": (4.5, 8.5),
                     "1F1": (8.5, 11.5), "1B1": (11.5, 15.5), "0B0": (8.5, 10.0), "0B1": (15.5, 17.0)}
    plain = simulate(order, [replace(short, resume_s=0.0), replace(long, resume_s=0.0)], [0, 1], [0.0])
    assert (plain.step_time_s, result.step_time_s) == (16.0, 17.0)
    with pytest.raises(ScheduleError, match="finite and >= 0"):
        replace(short, resume_s=-1.0)


def test_full_backward_time_apart_from_the_split_passes() -> None:
    """B actions take `backward_s` when given; I and W their own times (torch's two passes cost more than one B)."""
    cost = StageCost(forward_s=1.0, backward_input_s=1.5, backward_weight_s=1.5, backward_s=2.0)
    full = {0: [Action(0, Kind.F, 0), Action(0, Kind.B, 0)]}
    split = {0: [Action(0, Kind.F, 0), Action(0, Kind.I, 0), Action(0, Kind.W, 0)]}
    assert simulate(full, [cost], [0], []).step_time_s == pytest.approx(3.0)
    assert simulate(split, [cost], [0], []).step_time_s == pytest.approx(4.0)


@pytest.mark.parametrize(("delay", "step"), [(0.0, 9.0), (0.5, 10.0), (10.0, 12.0)])
def test_progress_delay_holds_a_message_while_its_sender_computes(delay: float, step: float) -> None:
    # GPipe, 2 stages, 2 microbatches, F = 1, B = 2. Rank 0's output of 0F0 could move at 1, but rank 0 computes
    # 0F1 until 2: it moves at min(2, 1 + delay). The gradient of 1B0 could move at 5 (+ the delay above), while
    # rank 1 computes 1B1 for 2 more: it moves then or `delay` later. Senders that are idle deliver at once.
    costs = _uniform(2, 1.0, 1.0, 1.0)
    order = build_schedule(ScheduleName.GPIPE, 2, 2)
    result = simulate(order, costs, [0, 1], [0.0], progress_s=[delay])
    assert result.step_time_s == pytest.approx(step)
    if delay == 0.0:
        assert result.events == simulate(order, costs, [0, 1], [0.0]).events


def test_progress_delay_costs_nothing_when_the_sender_is_idle() -> None:
    costs = _uniform(2)
    order = build_schedule(ScheduleName.GPIPE, 2, 1)
    delayed = simulate(order, costs, [0, 1], [0.25], progress_s=[5.0])
    assert delayed.step_time_s == pytest.approx(6.5)
    assert delayed.events == simulate(order, costs, [0, 1], [0.25]).events


@pytest.mark.parametrize("name", ONE_OWNER)
def test_progress_delays_never_deadlock_nor_speed_up(name: ScheduleName) -> None:
    p, m, v, costs, comm = _random_case(name, 11)
    n = p * v
    plain = simulate_named(name, p, m, costs, comm, v=v)
    delayed = simulate_named(name, p, m, costs, comm, v=v, progress_s=[0.7] * (n - 1))
    assert len(delayed.events) == len(plain.events)
    assert delayed.step_time_s >= plain.step_time_s - 1e-12
    assert delayed.step_time_s <= plain.step_time_s + 0.7 * 2 * m * n


def test_progress_delays_are_checked() -> None:
    order = build_schedule(ScheduleName.GPIPE, 2, 1)
    with pytest.raises(ScheduleError, match=r"progress_s must be finite and >= 0"):
        simulate(order, _uniform(2), [0, 1], [0.0], progress_s=[-1.0])
    with pytest.raises(ScheduleError, match=r"progress_s needs one entry per stage boundary \(2 != 1\)"):
        simulate(order, _uniform(2), [0, 1], [0.0], progress_s=[0.0, 0.0])


def _rule(sender: list[tuple[float, float]], t: float, delay: float) -> float:
    """The progress rule on a sender's final timeline: at t if idle, else the end of its busy run, at most t + delay."""
    busy = [(a, b) for a, b in sender if a <= t < b]
    if not busy:
        return t
    end = busy[0][1]
    for a, b in sender:
        if a == end and end < t + delay:
            end = b
    return min(end, t + delay)


@pytest.mark.parametrize("name", [ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B])
def test_progress_rule_holds_for_every_action_with_one_stage_per_rank(name: ScheduleName) -> None:
    rng = random.Random(5)
    for _ in range(40):
        p, m = rng.choice([2, 3, 4]), rng.choice([4, 6, 8])
        costs = [StageCost(forward_s=rng.choice([0.5, 1, 2, 3]), backward_input_s=rng.choice([1, 2, 3]),
                           backward_weight_s=rng.choice([0.5, 1, 2])) for _ in range(p)]
        comm, delays = [rng.choice([0, 0.1, 0.5]) for _ in range(p - 1)], [rng.choice([0.5, 1, 3, 10]) for _ in range(p - 1)]
        result = simulate_named(name, p, m, costs, comm, progress_s=delays)
        spans = {r: [(e.start_s, e.end_s) for e in result.events if e.rank == r] for r in range(p)}
        end = {(e.action.stage, e.action.kind if e.action.kind is Kind.F else Kind.B, e.action.microbatch): e.end_s
               for e in result.events}
        for r in range(p):
            free = 0.0
            for e in (e for e in result.events if e.rank == r):
                s, mb = e.action.stage, e.action.microbatch
                ready = 0.0
                if e.action.kind is Kind.F and s > 0:
                    ready = _rule(spans[s - 1], max(end[(s - 1, Kind.F, mb)] + comm[s - 1], free), delays[s - 1])
                elif e.action.kind is Kind.B:
                    ready = end[(s, Kind.F, mb)]
                    if s < p - 1:
                        ready = max(ready, _rule(spans[s + 1], max(end[(s + 1, Kind.B, mb)] + comm[s], free), delays[s]))
                assert e.start_s == pytest.approx(max(free, ready)), (name, p, m, e.action)
                free = e.end_s


def _with_comm(stages: int, comm: float) -> list[StageCost]:
    """F = 1, full B = 2 (I = W = 1) per stage, `comm` of each inside the stage (expert all-to-alls)."""
    return [StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0, backward_s=2.0,
                      forward_comm_s=comm, backward_comm_s=comm, activation_bytes=MB)] * stages


def test_an_overlapped_pair_takes_the_longer_of_its_compute_and_its_communication() -> None:
    """One rank, stages 0 and 1 both on it: F(0, 1) listed right before B(1, 0) runs with it as one pair, which
    ends max(Fc + Bc, Fm + Bm) after it starts (DeepSeek-V3 s.3.2.1); without the flag, or without communication,
    the two run one after the other."""
    order = {0: [Action(0, Kind.F, 0), Action(1, Kind.F, 0), Action(0, Kind.F, 1), Action(1, Kind.B, 0),
                 Action(0, Kind.B, 0), Action(1, Kind.F, 1), Action(1, Kind.B, 1), Action(0, Kind.B, 1)]}
    for comm, pair in ((0.4, (1 - 0.4) + (2 - 0.4)), (1.0, 1.0 + 1.0), (0.0, 3.0)):
        costs = _with_comm(2, comm)
        plain = simulate(order, costs, [0, 0], [0.0]).step_time_s
        overlapped = simulate(order, costs, [0, 0], [0.0], pairing=Pairing.STAGES)
        assert plain == pytest.approx(2 * 3 * 2)
        assert overlapped.step_time_s == pytest.approx(plain - 3.0 + pair)
        f, b = overlapped.events[2], overlapped.events[3]
        assert (f.action, b.action) == (Action(0, Kind.F, 1), Action(1, Kind.B, 0))
        assert b.end_s - f.start_s == pytest.approx(pair)


@pytest.mark.parametrize("comm", [0.0, 0.3])
def test_dual_pipe_v_hides_the_all_to_alls_only_where_there_are_some(comm: float) -> None:
    """p 4, m 16, the same stages under DualPipeV and ZBV: with all-to-alls inside F and B, DualPipeV's overlapped
    pairs make it the faster; without, the overlap changes nothing and ZBV's step is no longer than DualPipeV's."""
    p, m = 4, 16
    costs = _with_comm(2 * p, comm)
    dual = simulate_named(ScheduleName.DUAL_PIPE_V, p, m, costs, [0.0] * (2 * p - 1), v=2).step_time_s
    zbv = simulate_named(ScheduleName.ZBV_ZERO_BUBBLE, p, m, costs, [0.0] * (2 * p - 1), v=2).step_time_s
    order = build_schedule(ScheduleName.DUAL_PIPE_V, p, m, 2)
    plain = simulate(order, costs, stage_to_rank(ScheduleName.DUAL_PIPE_V, p, 2), [0.0] * (2 * p - 1)).step_time_s
    if comm:
        assert dual < plain and dual < zbv
    else:
        assert dual == pytest.approx(plain) and zbv <= dual + 1e-9


def test_the_combined_1f1b_pairs_a_forward_with_a_backward_of_another_microbatch_only() -> None:
    """One rank, one stage: F0 F1 B0 F2 B1 B2. Megatron's combined 1F1B (`Pairing.MICROBATCHES`) runs F1 with B0 and
    F2 with B1 as pairs; DualPipeV's rule (another stage) pairs none of them; F B of one microbatch is never a pair."""
    order = {0: [Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0), Action(0, Kind.F, 2),
                 Action(0, Kind.B, 1), Action(0, Kind.B, 2)]}
    costs, comm = _with_comm(1, 0.4), 0.4
    plain = simulate(order, costs, [0], []).step_time_s
    assert plain == pytest.approx(3 * 3)
    assert simulate(order, costs, [0], [], pairing=Pairing.STAGES).step_time_s == pytest.approx(plain)
    combined = simulate(order, costs, [0], [], pairing=Pairing.MICROBATCHES)
    pair = (1 - comm) + (2 - comm)  # compute of F and B, longer than their communication (2 x 0.4)
    assert combined.step_time_s == pytest.approx(plain - 2 * (3 - pair))
    assert sum(combined.overlapped_s) == pytest.approx(2 * (3 - pair))
    same = {0: [Action(0, Kind.F, 0), Action(0, Kind.B, 0)]}
    assert simulate(same, costs, [0], [], pairing=Pairing.MICROBATCHES).step_time_s == pytest.approx(3.0)


@pytest.mark.parametrize("comm", [0.0, 0.3])
def test_the_combined_1f1b_speeds_interleaved_1f1b_only_with_all_to_alls(comm: float) -> None:
    """p 4, v 2, m 16 under Interleaved1F1B: paired by the combined 1F1B's rule, the step is shorter where F and B
    hold all-to-alls and unchanged where they hold none; the pairing applies only with `ep_a2a` on that schedule."""
    p, m, v = 4, 16, 2
    costs = _with_comm(p * v, comm)
    order = build_schedule(ScheduleName.INTERLEAVED_1F1B, p, m, v)
    owner = stage_to_rank(ScheduleName.INTERLEAVED_1F1B, p, v)
    plain = simulate(order, costs, owner, [0.0] * (p * v - 1)).step_time_s
    combined = simulate(order, costs, owner, [0.0] * (p * v - 1),
                        pairing=pairing(ScheduleName.INTERLEAVED_1F1B, True, v)).step_time_s
    assert (combined < plain - 1.0) if comm else combined == pytest.approx(plain)
    assert pairing(ScheduleName.INTERLEAVED_1F1B, False, v) is None
    assert pairing(ScheduleName.INTERLEAVED_1F1B, True, 1) is None  # Megatron: no virtual pipeline, no overlap
    assert pairing(ScheduleName.ONE_F_ONE_B, True, 1) is None
    assert pairing(ScheduleName.DUAL_PIPE_V, False, 2) is Pairing.STAGES


def _synced(sync: float) -> list[StageCost]:
    """Two stages, F 1 and B 3, of which `sync` is the collective both ranks run for each microbatch."""
    return [StageCost(forward_s=1.0, backward_input_s=3.0, backward_weight_s=0.0, backward_s=3.0, sync_s=sync)] * 2


def test_a_collective_in_the_backward_runs_on_every_rank_at_once() -> None:
    """GPipe, 2 ranks, one microbatch: rank 0 joins the collective when its forward ends (1), rank 1 when it starts
    its B (2); the collective runs [2, 4] on both, rank 1 finishes its B at 5, rank 0 its B at max(4, 5) + 1 = 6.
    Charged one rank after the other (no sync_s), rank 0's B would run [5, 8]."""
    order = build_schedule(ScheduleName.GPIPE, 2, 1)
    assert simulate(order, _synced(2.0), [0, 1], [0.0]).step_time_s == pytest.approx(6.0)
    assert simulate(order, _synced(0.0), [0, 1], [0.0]).step_time_s == pytest.approx(8.0)


def test_a_late_rank_holds_the_collective_back() -> None:
    """GPipe, 2 ranks, 2 microbatches: rank 0's B0(1) (joining collective 1) waits for its B0(0), which ends at 7,
    while rank 1 is ready at 6: collective 1 runs [7, 9], rank 1 ends at 10, rank 0 at max(9, 10) + 1 = 11."""
    order = build_schedule(ScheduleName.GPIPE, 2, 2)
    sim = simulate(order, _synced(2.0), [0, 1], [0.0])
    assert sim.step_time_s == pytest.approx(11.0)
    ends = {(e.action.stage, e.action.microbatch): e.end_s for e in sim.events if e.action.kind is Kind.B}
    assert ends == pytest.approx({(1, 0): 6.0, (0, 0): 7.0, (1, 1): 10.0, (0, 1): 11.0})


@pytest.mark.parametrize("progress", [0.0, 0.5])
@pytest.mark.parametrize("name,v", [(ScheduleName.ONE_F_ONE_B, 1), (ScheduleName.GPIPE, 1)])
def test_collectives_on_every_rank_never_deadlock(name: ScheduleName, v: int, progress: float) -> None:
    """A collective in the backward of every rank's stage (where vocabulary parallelism's output pass runs; the cost
    model marks it so with one stage per rank only), 2 and 4 ranks, with and without progress delays (a rank
    waiting at the collective is no sender to wait on: `delivery.next_to_force` once raised IndexError there, as
    `autopp plan examples/gpt_big_vocab.py --pp 2 --schedule GPipe --vocab 2` did): the step completes, no faster
    than m collectives nor than without them."""
    for p, m in ((2, 1), (2, 4), (4, 2), (4, 8)):
        owner = stage_to_rank(name, p, v)
        last = {len(owner) - 1 - owner[::-1].index(r) for r in range(p)}
        costs = [StageCost(forward_s=1.0, backward_input_s=2.0, backward_weight_s=1.0, sync_s=1.0 if s in last
                           else 0.0) for s in range(len(owner))]
        if m < p and name is ScheduleName.ONE_F_ONE_B:
            continue
        order, hops, delays = build_schedule(name, p, m, v), [0.1] * (len(owner) - 1), [progress] * (len(owner) - 1)
        synced = simulate(order, costs, owner, hops, progress_s=delays)
        lighter = [replace(c, backward_input_s=c.backward_input_s - c.sync_s, sync_s=0.0) for c in costs]
        assert synced.step_time_s >= max(m * 1.0, simulate(order, lighter, owner, hops).step_time_s) - 1e-9


def test_waited_and_resumed_name_the_actions_the_simulator_charged() -> None:
    """`waited` marks the actions that start after their rank idled, and `resumed_s` sums their stages' resume
    cost: the simulated ranks' busy time is exactly their actions' durations plus that."""
    from autopp.schedule import resumed_s, waited
    costs = [StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0, backward_s=2.0, resume_s=0.25),
             StageCost(forward_s=0.5, backward_input_s=0.5, backward_weight_s=0.5, backward_s=1.0, resume_s=0.5)]
    r = simulate_named(ScheduleName.ONE_F_ONE_B, 2, 4, costs, [0.0])
    cold = waited(r.events)
    assert cold[0] is False and any(cold)  # rank 0's first forward starts at 0
    plain = [c.forward_s if e.action.kind is Kind.F else c.backward_s
             for e in r.events for c in [costs[e.action.stage]]]
    charged = resumed_s(r, costs)
    assert sum(e.end_s - e.start_s for e in r.events) == pytest.approx(sum(plain) + sum(charged))
    assert charged[1] > 0 and charged[1] == pytest.approx(0.5 * sum(c for e, c in zip(r.events, cold)
                                                                    if e.action.stage == 1))
