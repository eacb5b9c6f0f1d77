"""A profile as per-unit cost vectors at one microbatch size, with prefix sums: what every cost term reads (numpy)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from ..data.overlap import NO_OVERLAP, Overlap
from ..data.precision import plan_recipe
from ..data.profile import Profile, ValueAction
from ..data.tp_plan import LOSS_PARALLEL
from ..data.zero import NO_ZERO, ZeroStage
from ..errors import ProfileError
from ..schedule.activation import FIGURED, POLICY_COLUMNS, Activation, policy

if TYPE_CHECKING:
    import pandas as pd

    from .alltoall import AllToAll

__all__ = ["UnitArrays", "TpComm", "ExpertBytes", "TP_COMM_COLUMNS", "ProfileTable", "unit_arrays", "born_table"]

#: tp.csv's collective columns (docs/profile-format.md), per microbatch, and the TpComm field each fills.
TP_COMM_COLUMNS = {"tp_forward_allreduce_bytes": "forward_allreduce", "tp_backward_allreduce_bytes":
                   "backward_allreduce", "tp_forward_allgather_bytes": "forward_allgather",
                   "tp_forward_collectives": "forward_count", "tp_backward_collectives": "backward_count"}


@dataclass(frozen=True, eq=False)
class TpComm:
    """Per unit, one microbatch's tensor-parallel collectives at one degree: the bytes S of nccl-tests' formulas
    summed over the unit's all-reduces in F and in B and its all-gathers in F, and how many collectives (for the
    latency term)."""

    forward_allreduce: np.ndarray
    backward_allreduce: np.ndarray
    forward_allgather: np.ndarray
    forward_count: np.ndarray
    backward_count: np.ndarray


@dataclass(frozen=True, eq=False)
class ExpertBytes:
    """Per unit, a rank's share of the stacked experts' static bytes under expert parallelism (already divided over
    the ranks that shard the experts; autopp.costmodel.parallel.ExpertTable), which ZeRO shards over the `replicas`
    holding the same expert shard, and the weight their gradient bytes carry in `UnitArrays.grads` (the step's
    synchronisation)."""

    params: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    """Optimizer-state bytes."""
    replicas: int
    """The data-parallel ranks holding the same expert shard (`UnitView.ep_replicas`)."""
    sync_weight: float
    """How many bytes of a dp-wide all-reduce one byte of expert gradient costs over the `replicas`: ring
    ((r - 1) / r) / ((d - 1) / d), 0 when r = 1."""


@dataclass(frozen=True, eq=False)
class UnitArrays:
    """Per-unit costs of one microbatch (index = unit) and the bytes crossing each cut (index = unit boundary)."""

    forward: np.ndarray
    backward_input: np.ndarray
    """I: input-gradient part of the backward."""
    backward_weight: np.ndarray
    """W: weight-gradient part of the backward, run after I (torch's `stage_backward_weight`)."""
    recompute: np.ndarray
    """Extra time of a recomputing unit (its forward again)."""
    static: np.ndarray
    """Parameters + gradients + optimizer state bytes."""
    activation: np.ndarray
    params: np.ndarray
    grads: np.ndarray
    cut: np.ndarray
    """Length n + 1: cut[k] = bytes live across the cut before unit k (cut[0] = cut[n] = 0)."""
    split_assumed: bool
    """True when the profile had no I/W split and I = W = B / 2 was assumed."""
    backward: np.ndarray
    """B: one full backward, which schedules without I/W run; I + W usually costs more."""
    optimizer: np.ndarray | None = None
    """Per unit, its share (by trainable bytes) of the profile's optimizer step, once per training step (None: 0)."""
    transient: np.ndarray | None = None
    """Per unit, its working memory of one microbatch (None: 0): the peak bytes its forward + backward allocated
    (`Profile.unit_peak_bytes`) minus what the memory model already charges for it (activation, output and gradient
    bytes), at least 0. How it enters a rank's peak: `autopp.schedule.effects` (TRANSIENT)."""
    zero: ZeroStage = NO_ZERO
    """ZeRO stage the arrays were sharded for (`autopp.costmodel.parallel.data_sharded`): which data-parallel
    collectives end a step (`terms.sync_time`). `params` and `grads` stay the whole (unsharded) bytes."""
    tp_comm: TpComm | None = None
    """Per unit, the tensor-parallel collectives of one microbatch (None: no tensor parallelism), already included
    in the times by `autopp.costmodel.parallel.tensor_parallel`; kept for the plan's figures."""
    own: dict[Activation, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Per activation policy with figures of its own (`activation.Figures`) whose columns the profile has
    (`ActivationPolicy.columns`: selective recomputation's), per unit: the bytes one microbatch keeps and the time
    the policy adds to its backward. A policy missing here is not offered."""
    ep_comm: AllToAll | None = None
    """Per unit, one microbatch's expert-parallel all-to-alls (None: ep 1; `autopp.costmodel.parallel.ExpertTable`):
    the tokens' bytes summed over the unit's MoE layers, how many MoE layers it has (each runs 2 all-to-alls
    forward, 2 backward) and the routing, timed by `autopp.costmodel.alltoall.alltoall_time`."""
    ep_time: np.ndarray | None = None
    """Per unit, the time of one microbatch's expert-parallel all-to-alls in one pass (a dispatch and a combine per
    MoE layer), already in `forward`, `recompute`, `backward_input` and `backward`: what DualPipe can hide (None:
    ep 1)."""
    expert: ExpertBytes | None = None
    """Per unit, its expert bytes on one rank (None: ep 1), which `autopp.costmodel.parallel.data_sharded` shards
    over their own data-parallel group."""
    overlap: Overlap = NO_OVERLAP
    """The collectives the request hides under compute (`PlanRequest.overlap`; autopp.data.overlap), stamped by the
    search's views: the per-unit terms already hold its effect; the step's end (`terms.step_end_time`) reads
    `grad_reduce`."""
    fsdp: bool = False
    """ZeRO runs as FSDP2 outside a pipeline (pp 1, resharding after forward: `autopp.costmodel.parallel`): its
    all-gathers and reduce-scatters are per unit inside F and B, and nothing is left for the step's end."""
    tp_seconds: tuple[np.ndarray, np.ndarray] | None = None
    """Per unit, one microbatch's tensor-parallel collective seconds (F + B) and the part of them on the critical
    path (all of it unless async TP hides some), already in the times: the plan's time breakdown reads them."""
    zero_seconds: tuple[np.ndarray, np.ndarray] | None = None
    """Per unit, one microbatch's ZeRO collective seconds inside F and B (stage 3's gathers, stage 2's scatters,
    FSDP2's at pp 1) and the part of them on the critical path, already in the times (stage 2's overlapped
    scatters: a stage's exposed part is its units' plus `stage_start` at its first unit, and its first unit's
    scatter runs on the rank's reduce-scatter stream, `stage_scatter`)."""
    stage_start: np.ndarray | None = None
    """Per unit i, the backward seconds a stage whose first unit is i adds beyond its units' sums (None: 0 each; <= 0
    now): ZeRO 2's overlapped reduce-scatter charges each unit what its scatter exceeds the backward of the unit
    before it, and a stage's first unit's scatter runs on the rank's reduce-scatter stream instead
    (`stage_scatter`), so a stage starting at i takes unit i's charge off
    (`autopp.costmodel.parallel.scatter_in_backward`). Never more than unit i's own charge, which is part of its
    `work`, so a stage's time still grows with the stage (`starts`). Every stage time from these arrays adds it:
    `stage_costs` (the simulator's), the split's DP and CP-SAT, the breakdown's exposed ZeRO seconds, the search's
    bounds."""
    stage_scatter: np.ndarray | None = None
    """Per unit i, the seconds of one microbatch's reduce-scatter a stage whose first unit is i queues on its rank's
    reduce-scatter stream when the microbatch's backward ends (None: none; ZeRO 2 with `Overlap.fsdp_prefetch`,
    `autopp.costmodel.parallel.scatter_in_backward`): `StageCost.scatter_s`, which the simulator runs beside the
    rank's next actions (autopp.schedule.simulate)."""
    runtime_forward_s: float = 0.0
    """Not per unit: the pipelining runtime's own time in each forward action of a stage, once per stage however
    many units it has (the profile's `runtime_forward_s`; `autopp.costmodel.stage.stage_costs` adds it)."""
    runtime_backward_s: float = 0.0
    """The same in each backward action (the profile's `runtime_backward_s`)."""
    resume_s: float = 0.0
    """Not per unit: the extra time of an action that starts after its rank waited (the profile's `resume_s`;
    `StageCost.resume_s`)."""
    cp_ring: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    """Per unit, one microbatch's context-parallel ring (None: cp 1; `autopp.costmodel.context.ContextTable`): a
    rank's K/V shard bytes per layer, its attention layers, and one ring step's attention compute per layer in the
    forward and the backward, timed by `autopp.costmodel.context.context_parallel`."""

    born: np.ndarray | None = None
    """Per unit k, the bytes of the values unit k makes that later units read, each value once whatever cuts it
    crosses (a rank's sequence shard of the residual stream under sequence parallelism: `autopp.costmodel.parallel.
    group_table`); what per-unit checkpoints keep of them (`checkpoint_inputs`). None: cut[k + 1], each value
    counted at every cut it crosses (arrays made without the profile's live values)."""
    master: bool = False
    """The optimizer bytes hold an fp32 master copy (the recipe the profile records, autopp.data.precision), which
    is what FSDP2 keeps as the sharded parameter under its MixedPrecisionPolicy (`autopp.costmodel.parallel`)."""
    model_output: float = 0.0
    """The model's output of one microbatch, which a rank's last stage hands to the loss and holds until its backward
    (`StageCost.output_bytes`): the last unit's `output_bytes` (1/tp under loss parallelism; 0: profiled before it)."""
    frees_outputs: bool = False
    """The runtime frees a stage's outputs once sent (`PlanRequest.frees_outputs`, autopp.data.trainers)."""

    def held_outputs(self) -> np.ndarray:
        """Per end j (0..n), one microbatch's outputs a stage ending there holds until its backward: the values
        crossing cut j (none where the runtime frees them once sent), and at n the model's output (`model_output`)."""
        out = np.zeros(self.n + 1) if self.frees_outputs else np.asarray(self.cut, dtype=np.float64).copy()
        out[self.n] = self.model_output
        return out

    def checkpoint_inputs(self, i: int, j: int) -> float:
        """Bytes one microbatch of the stage of units [i, j) keeps when each unit runs under its own checkpoint: the
        units' inputs, each value once. torch's non-reentrant `checkpoint` keeps a reference to the tensors it is
        given for the recomputation, so a value several units read is one tensor held once: the values entering
        the stage (cut[i], as received) and those its units make for its later units (`born`)."""
        return float(self.cut[i] + self.born_bytes()[i:j - 1].sum()) if j > i else 0.0

    def checkpoint_charge(self) -> np.ndarray:
        """Per unit k, the bytes unit k - 1 makes for later units (`born`; 0 for unit 0): summed over a stage [i, j),
        at most `checkpoint_inputs(i, j)` (what unit i - 1 makes for later units is part of cut[i]), the additive
        charge of the split's memory check; the order walks charge the exact figure."""
        return np.concatenate(([0.0], self.born_bytes()[:-1]))

    def born_bytes(self) -> np.ndarray:
        """`born`, or cut[k + 1] per unit k when the arrays have none."""
        return self.born if self.born is not None else self.cut[1:]

    def transient_bytes(self) -> np.ndarray:
        """`transient`, zeros when the profile had no peak data."""
        return self.transient if self.transient is not None else np.zeros(self.n)

    @property
    def n(self) -> int:
        return len(self.forward)

    def start_s(self, i: int) -> float:
        """`stage_start` of a stage whose first unit is i (0 without it)."""
        return 0.0 if self.stage_start is None or i >= self.n else float(self.stage_start[i])

    def scatter_s(self, i: int) -> float:
        """`stage_scatter` of a stage whose first unit is i (0 without it)."""
        return 0.0 if self.stage_scatter is None or i >= self.n else float(self.stage_scatter[i])

    def starts(self, values: np.ndarray) -> np.ndarray:
        """Prefix sums of per-unit times `values` as a stage's start sees them: s[i] = prefix[i] - `start_s(i)`, so
        a stage [i, j) takes prefix(values)[j] - s[i] (non-decreasing in i when `values` hold each unit's work)."""
        p = self.prefix(values)
        if self.stage_start is not None:
            p[:-1] -= self.stage_start
        return p

    def prefix(self, values: np.ndarray) -> np.ndarray:
        """Prefix sums with a leading 0: sum over units [i, j) is p[j] - p[i]."""
        return np.concatenate(([0.0], np.cumsum(values, dtype=np.float64)))

    def work(self, activation: Activation = Activation.KEEP) -> np.ndarray:
        """Per-unit compute time of one microbatch: F + the cheaper of B and I + W (+ what the activation policy
        redoes), a lower bound for schedules of either kind of backward."""
        base = self.forward + np.minimum(self.backward, self.backward_input + self.backward_weight)
        return base + policy(activation).unit_redo(self)


class ProfileTable:
    """A profile's columns as (unit x profiled size) arrays, interpolated between profiled sizes (piecewise linear,
    extrapolated along the end segments; proportionally when one size was profiled), all units at once. With `tp`
    > 1, a tensor-parallel rank's costs at that degree: its compute, bytes and collectives from the profile's
    `tp.csv` rows (`Profile.tp_units`); cuts, working memory and the optimizer's time per byte stay the profile's."""

    def __init__(self, profile: Profile, tp: int = 1) -> None:
        base = profile.units.sort_values(["microbatch_size", "unit"])
        t = base if tp == 1 else _tp_rows(profile, tp)
        self.tp = tp
        self.sizes = [int(b) for b in profile.meta.microbatch_sizes]
        self.sizes.sort()
        n = profile.num_units
        cols = ["forward_s", "backward_s", "activation_bytes",
                *(c for c in ("backward_input_s", "backward_weight_s", "recompute_s", *TP_COMM_COLUMNS,
                              *POLICY_COLUMNS) if c in t.columns)]
        at_size = [t[t.microbatch_size == b] for b in self.sizes]
        self.cols = {c: np.array([rows[c].to_numpy(dtype=np.float64) for rows in at_size]).T for c in cols}
        first = at_size[0]
        self.params = first.param_bytes.to_numpy(dtype=np.float64)
        self.grads = first.grad_bytes.to_numpy(dtype=np.float64)
        self.static = (first.param_bytes + first.grad_bytes + first.optimizer_bytes).to_numpy(dtype=np.float64)
        self.cuts = np.array([_cuts(profile, b) for b in self.sizes],
                             dtype=np.float64).reshape(len(self.sizes), n - 1).T
        self.n = n
        # The optimizer step was timed on the whole model, where a tied weight is one tensor; each unit holding a
        # copy steps its own, so a unit's share is its trainable bytes at the model's time per trainable byte.
        copies = sum(float(g.bytes) * (len(g.units) - 1) for g in profile.meta.tied_parameters)
        whole = base[base.microbatch_size == self.sizes[0]].grad_bytes.to_numpy(dtype=np.float64)
        total = float(whole.sum()) - copies
        self.optimizer = profile.meta.optimizer_step_s * self.grads / total if total > 0 else np.zeros(n)
        # the recipe recorded, else its dtype's (a measured bf16 profile records none: bfloat16 alone means bf16;
        # profiles made before the recipes counted an fp32 master copy below float32 too)
        recorded = profile.meta.extra.get("precision")
        made = plan_recipe(None if recorded is None else str(recorded), profile.meta.dtype)
        own = profile.unit_peak_bytes(tp) if tp > 1 else {}  # a TP rank's working memory, counted at its shapes
        self.transient = _transients(own or profile.unit_peak_bytes(), t if own else base, base, self.sizes)
        self.runtime = (profile.meta.runtime_forward_s, profile.meta.runtime_backward_s, profile.meta.resume_s)
        self.born = born_table(profile, self.sizes)
        self.master = made is not None and made.master_bytes > 0
        shard = tp if tp > 1 and LOSS_PARALLEL in profile.meta.tp_plan.values() else 1  # a TP rank's vocabulary
        self.model_output = np.array([[float(base[base.microbatch_size == b].output_bytes.iloc[-1]) / shard
                                       for b in self.sizes]])  # the last unit's output: the model's

    def _at(self, values: np.ndarray, x: float) -> np.ndarray:
        """The profile's interpolation (profile._interp) of every row of `values` (columns = profiled sizes)."""
        xs = self.sizes
        if len(xs) == 1:
            return values[:, 0] * x / xs[0]
        i = 0
        while i < len(xs) - 2 and x > xs[i + 1]:
            i += 1
        x0, x1 = xs[i], xs[i + 1]
        return np.maximum(0.0, values[:, i] + (values[:, i + 1] - values[:, i]) * (x - x0) / (x1 - x0))

    def arrays(self, b: float) -> UnitArrays:
        f, back = self._at(self.cols["forward_s"], b), self._at(self.cols["backward_s"], b)
        i = self._at(self.cols["backward_input_s"], b) if "backward_input_s" in self.cols else np.zeros(self.n)
        w = self._at(self.cols["backward_weight_s"], b) if "backward_weight_s" in self.cols else np.zeros(self.n)
        redo = self._at(self.cols["recompute_s"], b) if "recompute_s" in self.cols else np.zeros(self.n)
        act = np.round(self._at(self.cols["activation_bytes"], b))
        cut = np.concatenate(([0.0], np.round(self._at(self.cuts, b)) if self.n > 1 else [], [0.0]))
        transient = None if self.transient is None else np.round(self._at(self.transient, b))
        comm = None if self.tp == 1 else TpComm(**{field: self._comm(c, b) for c, field in TP_COMM_COLUMNS.items()})
        own = {p: (np.round(self._at(self.cols[c[0]], b)), self._at(self.cols[c[1]], b))
               for p in FIGURED for c in [policy(p).columns] if c and all(x in self.cols for x in c)}
        born = None if self.born is None else np.round(self._at(self.born, b))
        return replace(_assemble(f, back, i, w, redo, self.static, act, self.params, self.grads, cut),
                       optimizer=self.optimizer, transient=transient, tp_comm=comm, own=own, born=born,
                       master=self.master, model_output=float(np.round(self._at(self.model_output, b)[0])),
                       runtime_forward_s=self.runtime[0],
                       runtime_backward_s=self.runtime[1], resume_s=self.runtime[2])


    def _comm(self, column: str, b: float) -> np.ndarray:
        """A collective column at microbatch size `b`: bytes interpolated like every size-dependent cost, counts of
        collectives (which do not grow with the batch) those of the smallest profiled size."""
        if column not in self.cols:
            return np.zeros(self.n)
        if column.endswith("_collectives"):
            return self.cols[column][:, 0]
        return self._at(self.cols[column], b)


def _tp_rows(profile: Profile, tp: int) -> pd.DataFrame:
    """The profile's rows of tensor-parallel degree `tp`, ordered as units.csv's; ProfileError when it has none
    (the degrees it has are in `ProfileMeta.tp_degrees`)."""
    rows = profile.tp_units
    if rows is None or not (rows.tp == tp).any():
        where = f"the profile of {profile.meta.model_path}"
        if not profile.meta.tp_plan:
            skipped = profile.meta.extra.get("tp_skipped")  # why an analytic profile made none
            why = f" ({skipped})" if skipped else ""
            raise ProfileError(f"{where} has no tensor-parallel rows{why}: profile it with `tp_degrees` {tp} (the "
                               "model needs a TP plan: TP_PLAN in the model file, or an HF model's "
                               "base_model_tp_plan), or plan with `tp` 1")
        have = ", ".join(str(d) for d in profile.meta.tp_degrees) or "none"
        ask = ",".join(str(d) for d in sorted({*profile.meta.tp_degrees, tp}))
        raise ProfileError(f"{where} has no tensor-parallel rows of degree {tp} (it has: {have}); profile again "
                           f"with `tp_degrees` {ask}")
    return rows[rows.tp == tp].sort_values(["microbatch_size", "unit"])


def _transients(peaks: dict[int, dict[int, int]], t: pd.DataFrame, base: pd.DataFrame, sizes: list[int]
                ) -> np.ndarray | None:
    """(unit x profiled size) working memory: `peaks` (Profile.unit_peak_bytes, the whole model's or a TP rank's)
    - activation and gradient bytes of the rows `t` they were counted with - output bytes (`base`'s), at least 0; 0
    where a unit or size has no peak; None without peaks (every plan as before them). Without a TP rank's own peaks
    (measured profiles, analytic ones before them) a TP plan takes the whole model's: an upper bound.
    The gradients in a peak are autograd's, in the parameters' dtype: the smaller of the rows' `param_bytes` and
    `grad_bytes` (the bf16 and fp8 recipes keep fp32 gradients, twice the bf16 ones the count made; profiles made
    before the recipes, and the fp32 and pure bf16 recipes, keep them as made), so the working memory is not the
    peak less gradients it never held. The last unit's output (the model's) is not subtracted: the measured piece
    hands it to the loss and drops it, where torch's last stage holds it until the backward, so the peak mostly
    lacks it (where the forward's peak held it, the stage is over-counted by at most that output)."""
    if not peaks:
        return None
    last = int(base.unit.max())
    out = np.zeros((last + 1, len(sizes)))
    outputs = {(int(r.unit), int(r.microbatch_size)): 0 if int(r.unit) == last else int(r.output_bytes)
               for r in base.itertuples()}
    for row in t.itertuples():
        peak = peaks.get(int(row.unit), {}).get(int(row.microbatch_size))
        if peak is not None and int(row.microbatch_size) in sizes:
            grads = min(row.param_bytes, row.grad_bytes)
            held = row.activation_bytes + outputs[int(row.unit), int(row.microbatch_size)] + grads
            out[int(row.unit), sizes.index(int(row.microbatch_size))] = max(0.0, float(peak - held))
    return out


def _cuts(profile: Profile, b: int) -> np.ndarray:
    """Profile.cut_bytes(b, recompute=True) at a profiled size, vectorised: each live value (or edge) from unit
    src >= 0 to its last reader adds its bytes to the cuts src + 1 .. last, but a value marked `recompute` crosses
    none: the runner never sends it, every stage that reads it holds it (autopp.run.chain)."""
    n = profile.num_units
    diff = np.zeros(n + 1)
    if profile.meta.live_values:
        spans = [(v.src, max(v.dsts), float(v.bytes[b]))
                 for v in profile.meta.live_values if v.action is not ValueAction.RECOMPUTE]
    else:
        e = profile.edges[profile.edges.microbatch_size == b]
        spans = list(zip(e.src.astype(int), e.dst.astype(int), e.bytes.astype(float)))
    for src, last, nbytes in spans:
        if src >= 0 and last > src:
            diff[src + 1] += nbytes
            diff[last + 1] -= nbytes
    return np.cumsum(diff)[1:n]


def born_table(profile: Profile, sizes: list[int], within: np.ndarray | None = None) -> np.ndarray | None:
    """(unit x profiled size) bytes of the live values each unit makes that a later unit reads (`UnitArrays.born`),
    each value once; values marked `recompute` are made by every stage that reads them and cross no cut (`_cuts`).
    `within` (per unit, bool): only the values whose producer and readers all are such units. None when the profile
    has no live values (its edges may repeat a value per reader)."""
    if not profile.meta.live_values:
        return None
    out = np.zeros((profile.num_units, len(sizes)))
    for v in profile.meta.live_values:
        if v.action is ValueAction.RECOMPUTE or v.src < 0 or max(v.dsts) <= v.src:
            continue
        if within is None or (within[v.src] and all(within[d] for d in v.dsts)):
            out[v.src] += [float(v.bytes[b]) for b in sizes]
    return out


def _assemble(f: np.ndarray, b: np.ndarray, i: np.ndarray, w: np.ndarray, redo: np.ndarray, static: np.ndarray,
              act: np.ndarray, params: np.ndarray, grads: np.ndarray, cut: np.ndarray) -> UnitArrays:
    if assumed := bool(np.all(i + w <= 0)):
        i, w = b / 2, b / 2
    return UnitArrays(f, i, w, np.where(redo > 0, redo, f), static, act, params, grads, cut, assumed, b)


def unit_arrays(profile: Profile, microbatch_size: float) -> UnitArrays:
    """The profile's unit costs at `microbatch_size`."""
    return ProfileTable(profile).arrays(microbatch_size)
