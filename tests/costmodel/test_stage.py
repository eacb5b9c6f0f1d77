"""A stage's simulator costs, device speeds, memory (static + held activations) and the ideal step time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autopp.data.cluster import Cluster, Device
from autopp.costmodel import (ideal_step_time, memory_prefix, stage_costs, stage_speeds,
                              stage_transient, unit_memory)
from autopp.schedule import Activation

from .arrays import arrays


def test_stage_costs_keep_the_measured_split_and_the_full_backward_and_stage_0_has_no_i() -> None:
    a = arrays([1.0, 1.0], backward=[2.0, 2.0], backward_input=[1.5, 1.5], backward_weight=[1.0, 1.0])
    first, second = stage_costs(a, [(0, 1), (1, 2)], [1.0, 1.0])
    assert (second.backward_input_s, second.backward_weight_s, second.backward_s) == (1.5, 1.0, 2.0)
    # torch's first stage skips the input-gradient pass and runs one full backward as its W
    assert (first.backward_input_s, first.backward_weight_s, first.backward_s) == (0.0, 2.0, 2.0)


def test_stage_costs_sum_units_scale_by_speed_and_keep_the_input_for_recompute() -> None:
    a = arrays([1.0, 2.0, 3.0], static=[10, 20, 30], activation=[1, 2, 3], cut=[7.0, 9.0])
    first, second = stage_costs(a, [(0, 1), (1, 3)], [1.0, 2.0], overheads=[0.25, 0.5])
    assert (second.forward_s, second.backward_input_s, second.backward_weight_s) == (2.5, 2.5, 2.5)  # 5 / 2
    assert (second.static_bytes, second.activation_bytes, second.input_bytes) == (50, 5, 7)
    assert (first.input_bytes, first.overhead_s, second.overhead_s) == (0, 0.25, 0.5)


def test_the_runtime_cost_is_charged_once_per_action_of_every_stage_however_many_units() -> None:
    # Issue 29: torch's forward_one_chunk / backward_one_chunk cost a fixed time per action, and an action after a
    # wait runs slower, which the per-unit sums lacked (docs/splits.md, "Why resnet's short last stage ran 1.4x").
    a = replace(arrays([1.0, 1.0, 1.0], backward=[2.0, 2.0, 2.0], backward_input=[1.5, 1.5, 1.5],
                       backward_weight=[1.0, 1.0, 1.0]), runtime_forward_s=0.25, runtime_backward_s=0.5, resume_s=0.125)
    first, second = stage_costs(a, [(0, 2), (2, 3)], [1.0, 2.0])
    assert (first.resume_s, second.resume_s) == (0.125, 0.125)  # the simulator adds it after a wait only
    assert (first.forward_s, second.forward_s) == (2.25, 0.75)  # not scaled by the device's speed
    assert (second.backward_input_s, second.backward_weight_s, second.backward_s) == (1.25, 0.5, 1.5)
    assert (first.backward_input_s, first.backward_weight_s, first.backward_s) == (0.0, 4.5, 4.5)
    plain = stage_costs(replace(a, runtime_forward_s=0.0, runtime_backward_s=0.0), [(0, 2), (2, 3)], [1.0, 2.0])
    assert [c.forward_s for c in plain] == [2.0, 0.5] and plain[1].backward_s == 1.0


def test_stage_speeds_follow_the_rank_of_each_stage() -> None:
    cluster = Cluster(num_devices=2, memory_bytes=1, devices=(Device(memory_bytes=1, speed=1.0),
                                                              Device(memory_bytes=1, speed=3.0)))
    assert stage_speeds(cluster, [0, 1, 1, 0]) == [1.0, 3.0, 3.0, 1.0]
    assert stage_speeds(cluster.reordered((1, 0)), [0, 1]) == [3.0, 1.0]


def test_memory_is_static_plus_held_activations_and_recompute_holds_one() -> None:
    a = arrays([1.0] * 3, static=[10, 20, 30], activation=[1, 2, 3])
    p = memory_prefix(a, 2)
    assert list(p) == [0.0, 12.0, 36.0, 72.0]
    assert p[3] - p[1] == 20 + 30 + 2 * (2 + 3)  # the stage of units 1 and 2
    assert list(unit_memory(a, 2)) == [12.0, 24.0, 36.0]
    assert list(memory_prefix(a, 3, Activation.RECOMPUTE)) == [0.0, 11.0, 33.0, 66.0]  # one microbatch's worth
    assert list(unit_memory(a, 3, Activation.RECOMPUTE)) == [11.0, 22.0, 33.0]


def test_ideal_step_time_is_total_work_over_total_speed() -> None:
    a = arrays([1.0, 1.0], backward=[2.0, 2.0], backward_input=[1.5, 1.5], backward_weight=[1.5, 1.5])
    cluster = Cluster(num_devices=2, memory_bytes=1, devices=(Device(memory_bytes=1, speed=1.0),
                                                              Device(memory_bytes=1, speed=3.0)))
    assert ideal_step_time(a, cluster, 2, 4) == 6.0  # 4 microbatches x (1 + min(2, 3)) x 2 units / (1 + 3)


def test_a_stage_carries_its_units_largest_transient() -> None:
    a = arrays([1.0] * 3)
    assert stage_transient(a, 0, 3) == 0 and stage_costs(a, [(0, 3)], [1.0])[0].transient_bytes == 0
    a = replace(a, transient=np.array([5.0, 9.0, 2.0]))
    assert [stage_transient(a, i, j) for i, j in ((0, 1), (1, 3), (2, 3), (2, 2))] == [5, 9, 2, 0]
    assert [c.transient_bytes for c in stage_costs(a, [(0, 1), (1, 3)], [1.0, 2.0])] == [5, 9]


def test_a_stage_keeps_its_outputs_and_recomputes_its_units_recompute_time() -> None:
    """Review (2026-12-06): torch's PipelineStage holds each microbatch's outputs (fwd_cache) until its backward,
    under every policy; and a recomputed forward is the units' `recompute_s` (with the collectives a forward
    repeats), not `forward_s`, which also carries ZeRO 3's gather before each forward and the runtime's per-action
    time (the backward's gather serves the recomputation)."""
    from autopp.schedule.effects import Kind, durations, footprint
    a = replace(arrays([1.0, 2.0, 3.0], activation=[1, 2, 3], cut=[7.0, 9.0]), runtime_forward_s=0.25)
    a = replace(a, forward=a.forward + 0.5)  # as ZeRO 3's gather adds to F (autopp.costmodel.parallel.data_sharded)
    first, second = stage_costs(a, [(0, 2), (2, 3)], [1.0, 2.0])
    assert (first.output_bytes, second.output_bytes) == (9, 0)  # the last stage's: not recorded (a known gap)
    assert (first.forward_s, first.recompute_s, second.recompute_s) == (4.25, 3.0, 1.5)
    assert footprint(first, Activation.KEEP).kept == 3 + 9
    assert footprint(first, Activation.RECOMPUTE) == (0 + 9, 3)  # the stage's input (none) and its output
    assert durations(first, Activation.RECOMPUTE)[Kind.B] == 3.0 + first.backward_s
    assert durations(first, Activation.KEEP)[Kind.B] == first.backward_s
    assert replace(first, recompute_s=None).redo_forward_s == first.forward_s  # costs made without the units
