"""Expert GEMMs under expert parallelism: a rank of an ep group runs its E / ep experts of each MoE layer on the rows
every rank of the group routes to them, so it does the FLOPs of ep 1 but reads 1 / ep of the expert weights.

An analytic profile of a mixture of experts times each unit's expert GEMMs (the grouped matmuls over stacked expert
weights, `aten._grouped_mm` and transformers' fallback: autopp.measure.counting.expert_weight_bytes) apart from the
rest, per pass (autopp.data.profile.EXPERT_COLUMNS): F, their FLOPs at the roofline's compute peak (FP8's for the
fp8 recipe); W, the bytes of the expert weights they read (forward, input gradient) or of the weights' gradients
they write (weight gradient) at its bandwidth; O, their other bytes (the routed rows in and out). Counted at ep 1,
the pass's time holds max(F, W + O) for them: the roofline charges each op its slower side, and a layer's grouped
GEMMs all have F / W = 2 x rows per expert / bytes per weight element, so they sit on the same side of the ridge
(their other bytes aside) and the sum of their maxima is the maximum of their sums.

Under expert parallelism with balanced routing (every expert gets tokens x top-k / E rows: Megatron-Core's MoE
benchmarks force it, DeepSeek-V3's auxiliary-loss-free balancing aims at it, arXiv:2412.19437 s.2.1.2), a rank of an
ep group of e ranks holds E / e experts (DeepSeek-V3 s.3.2: EP64, 4 of 256 routed experts per GPU; Megatron-Core's
`--expert-model-parallel-size` with its all-to-all token dispatcher; torchtitan's `ExpertParallel`) and receives
from the e ranks the rows routed to them: e x tokens x top-k / e, as many rows as at ep 1. Its grouped GEMMs do the
same FLOPs and move the same rows, but read (and write the gradients of) 1 / e of the weights: each pass's expert
time becomes max(F, W / e + O) in place of max(F, W + O) (`expert_gemms`). A grouped GEMM that one device runs
memory-bound over every expert (DeepSeek-V3 at microbatch 1: 128 rows per expert, a layer's 22.5 GB of expert
weights read for 2.9 TFLOP) turns compute-bound over 4 experts with 8,192 rows each. The op count (launches) does
not change: a rank runs as many grouped GEMMs. The recomputed forward changes as the forward, selective
recomputation's rerun (the grouped GEMMs are not among the ops it saves) by its own pass's parts.

Exact when every expert gets rows at ep 1 (tokens x top-k >= E per microbatch; every profile under profiles/: 4,096
x 8 routed rows for 256 and 128 experts); below that the count's W already leaves out the idle experts' weights
(autopp.measure.counting.expert_weight_bytes_unread) and W / e understates what a rank reads.
A profile without the columns (measured, whose times are one device's at ep 1, or analytic from before them) keeps
the ep-1 times, an upper bound, and the plan says so (`Profile.experts_untimed`, autopp.solve.assemble).

Expert tensor parallelism (etp beside ep, autopp.data.axes; Megatron-Core's `--expert-tensor-parallel-size`, MoE
Parallel Folding, arXiv:2504.14960): the rows an ep rank received are all-gathered over its etp group, each rank
runs its column-wise 1 / etp of gate/up and row-wise 1 / etp of down on the group's etp x rows, and the partial
outputs are reduce-scattered back. Per pass a rank does the FLOPs of etp 1 (etp x the rows, 1 / etp of each row's
work), reads 1 / (ep x etp) of the expert weights, and moves at most etp x the other bytes (the rows in and out
are etp x as many; the intermediate ones as many, counted etp x: an upper bound): max(F, W / (ep x etp) + etp x O)
(`retimed`). Per MoE layer and microbatch it all-gathers and reduce-scatters S = etp x the routed rows' bytes
(top-k x the layer's tokens x hidden x dtype) in the forward and again in the backward (the gradients' reverse
pair), on a ring (t - 1) / t x S / B and t - 1 latencies each: an all-reduce of S per pass, tensor parallelism's
colwise -> rowwise pattern on the experts (Korthikanti et al. 2022: an all-gather + a reduce-scatter cost one
all-reduce). `expert_tensor_rows` records them as the unit's tensor-parallel collectives (`UnitArrays.tp_comm`:
expert parallelism runs at tp 1, so the experts' TP is the only TP there), which
autopp.costmodel.parallel.group_terms times over the etp group's link; and the gathered input rows each rank
keeps for its backward, (etp - 1) x the routed rows' bytes per MoE layer, join its activation bytes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..data.profile import EXPERT_PASSES
from ..schedule.activation import policy
from .units import TpComm, UnitArrays

__all__ = ["ExpertParts", "retimed", "expert_gemms", "expert_tensor_rows"]

#: Per pass (EXPERT_PASSES), per unit at one microbatch size: the expert GEMMs' FLOP, weight and other seconds
#: (EXPERT_PARTS' order).
ExpertParts = dict[str, tuple[np.ndarray, ...]]


def retimed(flop: np.ndarray, weight: np.ndarray, other: np.ndarray, ep: int, etp: int = 1) -> np.ndarray:
    """Per unit, what `ep` (and `etp`) change in one pass's expert GEMM time: max(F, W / (ep x etp) + etp x O) -
    max(F, W + O) (module docstring)."""
    return np.maximum(flop, weight / (ep * etp) + etp * other) - np.maximum(flop, weight + other)


def expert_gemms(a: UnitArrays, parts: ExpertParts, ep: int, etp: int = 1) -> UnitArrays:
    """`a` (a unit's ep-1 times) with its expert GEMMs re-timed for a rank of an ep group of `ep` (module
    docstring): forward and recomputed forward, full backward, its input and weight parts (halves of the full
    backward's change where the profile had no split, `a.split_assumed`), and the own time of each activation policy
    whose figures are one of the passes (selective recomputation's); with `etp`, for a rank of its etp group too.
    `parts` empty: `a` unchanged."""
    if ep * etp == 1 or not parts:
        return a
    d = {phase: retimed(flop, weight, other, ep, etp) for phase in EXPERT_PASSES
         for flop, weight, other in [parts[phase]]}
    i, w = (d["backward"] / 2, d["backward"] / 2) if a.split_assumed else (d["backward_input"], d["backward_weight"])
    own = {p: (kept, seconds + sum((d[phase] for phase in EXPERT_PASSES if f"{phase}_s" in policy(p).columns),
                                   np.zeros(a.n)))
           for p, (kept, seconds) in a.own.items()}
    return replace(a, forward=a.forward + d["forward"], recompute=a.recompute + d["forward"],
                   backward=a.backward + d["backward"], backward_input=a.backward_input + i,
                   backward_weight=a.backward_weight + w, own=own)


def expert_tensor_rows(a: UnitArrays, routed: np.ndarray, layers: np.ndarray, etp: int) -> UnitArrays:
    """`a` (a rank's arrays under expert parallelism, tp 1) with expert tensor parallelism's collectives over `etp`
    ranks as its tensor-parallel ones and the gathered rows it keeps (module docstring): `routed`, per unit, one MoE
    layer's routed rows' bytes per microbatch; `layers`, its MoE layers. `etp` 1: `a` unchanged."""
    if etp == 1:
        return a
    if a.tp_comm is not None:  # a programming error: ep runs at tp 1 (autopp.data.layout)
        raise ValueError("expert tensor parallelism beside tensor parallelism's own collectives")
    pair = layers * etp * routed  # S of one all-gather + reduce-scatter pair per MoE layer
    comm = TpComm(forward_allreduce=pair, backward_allreduce=pair, forward_allgather=np.zeros(a.n),
                  forward_count=layers.copy(), backward_count=layers.copy())
    return replace(a, tp_comm=comm, activation=a.activation + layers * (etp - 1) * routed)
