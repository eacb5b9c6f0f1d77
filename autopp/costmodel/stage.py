"""Cost terms of a stage (a contiguous range of units on one device): its times for the simulator and its memory."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ..data.cluster import Cluster
from ..schedule import Activation, StageCost, policy
from ..schedule.activation import POLICIES, Figures
from .units import UnitArrays

__all__ = ["stage_speeds", "stage_costs", "memory_prefix", "unit_memory", "stage_transient", "stage_outputs",
           "ideal_step_time"]


def stage_speeds(cluster: Cluster, owner: Sequence[int]) -> list[float]:
    """Per stage, the relative speed of the device of its rank: a stage takes its profiled time / speed."""
    return [cluster.device(r).speed for r in owner]


def stage_costs(a: UnitArrays, bounds: Sequence[tuple[int, int]], speeds: Sequence[float],
                overheads: Sequence[float] | None = None, host_bandwidth: float = 0.0) -> list[StageCost]:
    """Simulator costs of each stage: times scaled by its device's speed; a recomputing stage keeps its input;
    `overheads`: per stage, the message overhead of each F and B/I (`message_overheads`; default none); the
    expert-parallel all-to-alls inside F and B (`UnitArrays.ep_time`) as the communication an overlapping schedule
    hides; a stage's `UnitArrays.start_s` in B and W, and its `UnitArrays.scatter_s` on the rank's reduce-scatter
    stream (`StageCost.scatter_s`; scaled by the speed as the scatters charged to B and W are). Like torch's first
    stage, stage 0 has no input-gradient pass: its I is 0 and its W one full backward. The
    pipelining runtime's own time per action (`UnitArrays.runtime_forward_s` / `runtime_backward_s`, measured once
    per profile: autopp.measure.runtime) is added once to every stage's F and to its B, and to its I where the
    backward splits (stage 0: to its W), however many units the stage has: host time, not scaled by the device's
    speed; so is the extra time of an action that starts after its rank waited (`UnitArrays.resume_s`, which the
    simulator adds to such actions only). The activation policies' own figures: summed over the units from the
    profile's columns, from the units' arrays (`from_units`), or, with the devices' host
    link (`host_bandwidth`, bytes/s per direction; `Cluster.host_bandwidth`), derived from the stages (`derive`)."""
    out = []
    rf, rb = a.runtime_forward_s, a.runtime_backward_s
    held = a.held_outputs()
    for s, ((i, j), sp) in enumerate(zip(bounds, speeds)):
        start = a.start_s(i) / sp  # what a stage starting at i adds (<= 0: first unit's scatter on the stream)
        full = float(a.backward[i:j].sum()) / sp + start + rb
        comm = 0.0 if a.ep_time is None else float(a.ep_time[i:j].sum()) / sp
        out.append(StageCost(forward_s=float(a.forward[i:j].sum()) / sp + rf,
                             backward_input_s=0.0 if s == 0 else float(a.backward_input[i:j].sum()) / sp + rb,
                             backward_weight_s=full if s == 0 else float(a.backward_weight[i:j].sum()) / sp + start,
                             backward_s=full,
                             static_bytes=int(a.static[i:j].sum()), activation_bytes=int(a.activation[i:j].sum()),
                             input_bytes=int(a.cut[i]), output_bytes=int(held[j]),
                             recompute_s=float(a.recompute[i:j].sum()) / sp,
                             overhead_s=overheads[s] if overheads else 0.0,
                             transient_bytes=stage_transient(a, i, j),
                             own=(*((p, Figures(int(kept[i:j].sum()), float(redo[i:j].sum()) / sp))
                                    for p, (kept, redo) in a.own.items()), *_from_units(a, i, j, sp)),
                             forward_comm_s=comm, backward_comm_s=comm, resume_s=a.resume_s,
                             scatter_s=a.scatter_s(i) / sp))
    derived = [p for p in POLICIES.values() if p.derive is not None] if host_bandwidth > 0 else []
    return [replace(c, own=c.own + tuple((p.name, p.derive(out, s, host_bandwidth)) for p in derived if p.derive))
            for s, c in enumerate(out)] if derived else out


def _from_units(a: UnitArrays, i: int, j: int, speed: float) -> tuple[tuple[Activation, Figures], ...]:
    """The figures of the policies that derive theirs from the units [i, j) (`ActivationPolicy.from_units`)."""
    return tuple((p.name, f._replace(redo_s=f.redo_s / speed)) for p in POLICIES.values() if p.from_units
                 for f in [p.from_units(a, i, j)])


def memory_prefix(a: UnitArrays, inflight: int, activation: Activation = Activation.KEEP) -> np.ndarray:
    """Prefix sums over units of a stage's memory with `inflight` microbatches in flight under `activation`: static
    (parameters, gradients, optimizer state) + the activation bytes the policy charges (`ActivationPolicy.unit_bytes`:
    inflight x activations when keeping); the stage [i, j) needs p[j] - p[i] bytes."""
    return a.prefix(a.static) + a.prefix(policy(activation).unit_bytes(a, inflight))


def stage_outputs(a: UnitArrays, inflight: int) -> np.ndarray:
    """Per end j (0..n), what a stage ending there keeps of its outputs with `inflight` microbatches in flight:
    torch's PipelineStage holds each microbatch's outputs from its forward until its backward
    (`StageCost.output_bytes`): the values crossing cut j (none where the pipeline frees them once sent,
    `UnitArrays.frees_outputs`), and at n the model's output (`UnitArrays.held_outputs`)."""
    return inflight * a.held_outputs()


def stage_transient(a: UnitArrays, i: int, j: int) -> int:
    """The working memory of the stage [i, j): the largest transient of its units (0 for none). The split's memory
    checks add it to `memory_prefix`'s bytes, as `autopp.schedule.effects` (TRANSIENT) adds a rank's largest to its
    held peak."""
    return int(a.transient_bytes()[i:j].max(initial=0.0))


def unit_memory(a: UnitArrays, inflight: int, activation: Activation = Activation.KEEP) -> np.ndarray:
    """Per unit, its share of a stage's memory with `inflight` microbatches in flight under `activation`
    (memory_prefix's terms, for the integer CP-SAT models)."""
    return a.static + policy(activation).unit_bytes(a, inflight)


def ideal_step_time(a: UnitArrays, cluster: Cluster, pp: int, microbatches: int) -> float:
    """Total work of one replica's microbatches / the summed speed of its `pp` ranks (no bubble, no communication)."""
    speed = sum(cluster.device(r).speed for r in range(pp))
    return microbatches * float(a.work().sum()) / speed
