"""Lower bounds of a configuration's estimate, valid for every split: the outer search skips what they rule out.

A configuration's estimate (search._estimate) is costmodel.estimate_named of the DP's split plus the all-reduce of
its largest stage's gradients x v. For ANY contiguous split into S = p x v stages on ranks of speed sp_r (stage
times T_s, rank times R_r, W = the replica's work per microbatch, recomputed forwards included when every stage
recomputes):
  1. max_r R_r >= W / sum_r sp_r           (rank r does at most max R x sp_r of work)
  2. sum_s T_s >= W / max_r sp_r           (all of W at the fastest speed)
  3. max_s T_s >= max(max_r R_r / v, the largest unit / max_r sp_r)
  4. max_s (F + I - W)_s^+ >= the mean over the S stages (for speed 1; / max sp_r otherwise); stage 0 has I = 0
     and W = B, so each unit counts the smaller of F + I - W and F - B
  5. sum of the p - 1 (x v for multi-stage layouts) rank-crossing transfers >= their count x the cheapest transfer
     of any interior cut over any link
  6. the largest stage's gradients x v >= all gradients / p, and the ring all-reduce grows with bytes.
Hence, per formula: GPipe and 1F1B >= (2) + (m - 1) (3) + 2 (5); Interleaved1F1B and LoopedBFS >= (m + (p - 1) / v)
(1) + 2 (5); the zero-bubble family >= m (1) + (p - 1) / v (4) + 2 (5) / v; and each adds (6). GPipe's
(m - 1)(max F + max B) >= (m - 1) max T, so 1F1B's bound serves it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..schedule import SINGLE_STAGE, ScheduleName, stage_to_rank
from .arrays import UnitArrays
from .judge import allreduce_time

if TYPE_CHECKING:
    from .search import Config, PlanRequest

__all__ = ["lower_bound", "comm_floor"]

_MEGATRON = (ScheduleName.INTERLEAVED_1F1B, ScheduleName.LOOPED_BFS)


def comm_floor(a: UnitArrays, req: PlanRequest, c: Config) -> float:
    """(5): 2 x the sum of rank-crossing transfers (/ v for zero bubble) of any split."""
    if a.n < 2:
        return 0.0
    owner = stage_to_rank(c.schedule, c.pp, c.v)
    crossings = sum(owner[k] != owner[k + 1] for k in range(len(owner) - 1))
    links = req.cluster.links + (req.cluster.link,)
    cheapest = min(lk.transfer_s(float(np.min(a.cut[1:-1]))) for lk in links)
    ratio = 1.0 if c.schedule in SINGLE_STAGE or c.schedule in _MEGATRON else 1.0 / c.v
    return 2 * crossings * cheapest * ratio


def _speeds(req: PlanRequest, c: Config) -> tuple[float, float]:
    speeds = [req.cluster.device(r).speed for r in range(c.pp)]
    return sum(speeds), max(speeds)


def lower_bound(a: UnitArrays, req: PlanRequest, c: Config, recompute: bool) -> float:
    """A lower bound of `c`'s estimate for every split, every stage recomputing or none (module docstring)."""
    redo = a.forward if recompute else 0.0  # the estimate charges a recomputing stage its forward again
    unit = a.work() + redo
    total, sum_sp, max_sp = float(unit.sum()), *_speeds(req, c)
    rank = total / sum_sp  # (1)
    if c.schedule in SINGLE_STAGE:
        stage = max(rank / c.v, float(unit.max()) / max_sp)  # (3)
        pipe = total / max_sp + (c.m - 1) * stage  # (2) + (m - 1) (3)
    elif c.schedule in _MEGATRON:
        pipe = (c.m + (c.pp - 1) / c.v) * rank
    else:
        # (4); per unit the smaller of F + I - W and F - B, as stage 0 has I = 0 and W = B
        per_unit = np.minimum(a.forward + a.backward_input - a.backward_weight, a.forward - a.backward) + redo
        gap = float(per_unit.sum()) / (c.pp * c.v) / max_sp
        pipe = c.m * rank + (c.pp - 1) / c.v * max(0.0, gap)
    return pipe + comm_floor(a, req, c) + allreduce_time(float(a.grads.sum()) / c.pp, c.dp, req.cluster)
