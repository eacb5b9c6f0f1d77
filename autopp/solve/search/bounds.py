"""Lower bounds of a configuration's estimate, valid for every split: the outer search skips what they rule out.

A configuration's estimate (search._estimate) is its schedule descriptor's closed-form estimate of the DP's split
plus what the step does after the pipeline (costmodel.step_end_time). For ANY contiguous split into S = p x v stages
on ranks of speed sp_r (stage times T_s, rank times R_r, W = the replica's work per microbatch, recomputed forwards
included when every stage recomputes):
  1. max_r R_r >= W / sum_r sp_r           (rank r does at most max R x sp_r of work)
  2. sum_s T_s >= W / max_r sp_r           (all of W at the fastest speed)
  3. max_s T_s >= max(max_r R_r / v, the largest unit / max_r sp_r)
  4. max_s (F + I - W)_s^+ >= the mean over the S stages (for speed 1; / max sp_r otherwise); stage 0 has I = 0
     and W = B, so each unit counts the smaller of F + I - W and F - B; less every unit's positive
     `UnitArrays.stage_start` (the W a stage adds at its first unit: at most all of them; one that takes W off only
     raises F + I - W)
  W above is less the S largest amounts a stage's first unit sheds (a negative `UnitArrays.stage_start`: ZeRO 2's
  first-unit reduce-scatter, on the rank's stream instead of in the stage), and in (3) each unit's work less its own.
  5. sum of the p - 1 (x v for multi-stage layouts) rank-crossing transfers >= their count x the cheapest transfer
     of any interior cut over any link
  6. the step's end (costmodel.step_end_floor): some rank holds >= all gradients / p, and the ring all-reduce grows
     with bytes.
  7. one microbatch's round trip without its weight gradients >= sum over units of F + the smaller of B and I (+
     what the policy redoes), less the shed amounts of (1), at the fastest speed (`Floors.path`).
A schedule that overlaps forward-backward pairs (`schedule.pairing`: DualPipeV's own, Interleaved1F1B's under the
trainer's combined 1F1B) hides at most all of the expert-parallel all-to-alls inside F and B (`UnitArrays.ep_time`):
(1)-(4) are taken without them.
Hence, per formula (each descriptor's `estimate_bound`, fed `schedule.Floors` of (1)-(7)), the estimate: GPipe and
1F1B >= (2) + (m - 1) (3) + 2 (5); Interleaved1F1B and LoopedBFS >= (m + (p - 1) / v) (1) + 2 (5); the zero-bubble
schedules >= m (1) + (p - 1) / v (4) + 2 (5) / v (GPipe's (m - 1)(max F + max B) >= (m - 1) max T, so 1F1B's bound
serves it). The simulated step (`pipe_bound`): GPipe and 1F1B >= max(m (3), (2) + 2 (5), (2) / (1 - (1 - 1 / m)^p));
Interleaved1F1B and LoopedBFS >= max(m (1), (2) + 2 (5)); the zero-bubble schedules and DualPipeV >= max(m (1), (7) +
2 (5)) (the descriptors' docstrings say why). Each adds (6). tests/solve/test_bounds.py checks the bounds against the
estimate and the simulated step on random profiles and every schedule.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...costmodel import UnitArrays, stage_speeds, step_end_floor, transfer_time
from ...schedule import Activation, Floors, describe, pairing, policy, stage_to_rank
from .request import Config, PlanRequest

__all__ = ["lower_bound", "comm_floor", "without_comm"]


def without_comm(a: UnitArrays) -> UnitArrays:
    """`a` without its expert-parallel all-to-alls (`ep_time`) in F, its recomputation, I and B."""
    t = a.ep_time if a.ep_time is not None else np.zeros(a.n)
    return replace(a, forward=a.forward - t, recompute=a.recompute - t, backward_input=a.backward_input - t,
                   backward=a.backward - t, ep_time=None)

def comm_floor(a: UnitArrays, req: PlanRequest, c: Config) -> float:
    """(5): 2 x the sum of rank-crossing transfers of any split (the schedule's bound decides how much counts)."""
    if a.n < 2:
        return 0.0
    owner = stage_to_rank(c.schedule, c.layout.pp, c.layout.v)
    crossings = sum(owner[k] != owner[k + 1] for k in range(len(owner) - 1))
    links = req.cluster.pipeline_links
    cheapest = min(transfer_time(lk, float(np.min(a.cut[1:-1]))) for lk in links)
    return 2 * crossings * cheapest


def _speeds(req: PlanRequest, c: Config) -> tuple[float, float]:
    speeds = stage_speeds(req.cluster, range(c.layout.pp))
    return sum(speeds), max(speeds)


def lower_bound(a: UnitArrays, req: PlanRequest, c: Config, activation: Activation, simulated: bool = False) -> float:
    """A lower bound of `c`'s estimate for every split, every stage under `activation` (module docstring); with
    `simulated`, of its simulated step instead (the descriptor's `pipe_bound`, not its `estimate_bound`)."""
    d = describe(c.schedule)
    if pairing(c.schedule, a.overlap.ep_a2a, c.layout.v) is not None and a.ep_time is not None:  # what pairs hide
        a = without_comm(a)
    # the estimate charges a stage what its policy redoes, at most the forward again
    redo = np.minimum(policy(activation).unit_redo(a), a.forward)
    unit = a.work() + redo
    off = np.maximum(-a.stage_start, 0.0) if a.stage_start is not None else np.zeros(a.n)  # what a first unit sheds
    shed = float(np.sort(off)[::-1][:c.layout.stages].sum())
    total, sum_sp, max_sp = float(unit.sum()) - shed, *_speeds(req, c)
    rank = total / sum_sp  # (1)
    stage = max(rank / c.layout.v, float((unit - off).max()) / max_sp)  # (3)
    # (4); per unit the smaller of F + I - W and F - B, as stage 0 has I = 0 and W = B
    per_unit = np.minimum(a.forward + a.backward_input - a.backward_weight, a.forward - a.backward) + redo
    starts = 0.0 if a.stage_start is None else float(np.maximum(a.stage_start, 0.0).sum())  # added to W, at most
    gap = (float(per_unit.sum()) - starts) / c.layout.stages / max_sp
    bound = d.pipe_bound if simulated else d.estimate_bound or d.pipe_bound
    assert bound is not None  # configurations are named schedules
    trip = float((a.forward + np.minimum(a.backward, a.backward_input) + redo).sum()) - shed  # (7)
    floors = Floors(rank=rank, total=total / max_sp, stage=stage, gap=gap, comm=comm_floor(a, req, c),
                    path=trip / max_sp)
    return bound(floors, c.m, c.layout.pp, c.layout.v) + step_end_floor(a, req.cluster, c.layout, d.mirrored)
