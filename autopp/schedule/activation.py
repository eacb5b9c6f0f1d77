"""Activation policies as descriptors: what a stage keeps of a microbatch's forward for its backward, what it redoes,
and how the runner and each trainer spell it.

One registry, like the schedules' (`descriptors.py`): the simulator's memory and time effects (`effects.py`), the
planner's split and its memory bounds, the runner and the exporters all read a policy's behaviour from here. A plan
gives each stage one policy. Full recomputation is Chen et al., "Training Deep Nets with Sublinear Memory Cost"
(arXiv:1604.06174) as torch's `torch.utils.checkpoint` runs it per stage: only the stage's input is kept, and the
forward runs again at the start of the backward.

Selective recomputation is op-level selective activation checkpointing as torch runs it
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) and torchtitan applies it
(torchtitan/distributed/activation_checkpoint.py, `_save_list`): the stage's forward runs under a checkpoint whose
policy saves the outputs of the matmuls and the attention kernels (`SAVED_OPS`) and recomputes every other op (norms,
activation functions, elementwise ops) at the start of the backward, the cheap-to-recompute, memory-heavy part that
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198), single out.
A profile gives per unit what it keeps so and what its recompute costs (`selective_activation_bytes`,
`selective_recompute_s`, docs/profile-format.md); a profile without them is not offered the policy.

Offload moves what a stage's forward saves for its backward to host memory and brings it back for the backward, as
torch's `torch.autograd.graph.save_on_cpu` does it (the runner) and PipeOffload (Wan et al., "PipeOffload:
Improving Scalability of Pipeline Parallelism with Memory Optimization", ICML 2025, arXiv:2503.01328) overlaps it
with a pipeline's compute: a microbatch keeps its stage input on the device, and from the start of its backward
until its end its activations (brought back) and the next microbatch's (being brought back under this backward: a
double buffer) are on the device again; the transfer is free where it hides under the compute between the
microbatch's forward and its backward, and its exposed rest is added to the backward (`_offload_figures`). Its
figures follow from the stages and the device's host link (PCIe, NVLink-C2C: the device catalog's `host_link`), not
from the profile; a device whose memory is the host's (a CPU rank) has no host link, and the policy is not offered
there: offloading would move bytes within the same memory and save nothing.

Per-unit full recomputation (`Activation.BLOCKS`, "recompute-units") checkpoints each unit of the stage on its own,
as torchtitan's full activation checkpointing wraps each transformer block, Megatron-LM's `--recompute-granularity
full --recompute-method uniform --recompute-num-layers 1` each layer and DeepSpeed's `activation_checkpoint_interval`
1 each layer: a microbatch keeps the inputs of the stage's units, each value once (`UnitArrays.checkpoint_inputs`:
torch's checkpoint holds the tensors it is given, one tensor however many units read it), and its backward redoes one
unit's forward at a time, holding one unit's activations (the stage's largest, `UnitArrays.activation`) beside
them; it redoes the whole forward, as whole-stage recomputation does (`_unit_figures`).

Per-unit selective recomputation (`Activation.SELECTIVE_UNITS`, "selective-units") checkpoints each unit on its own
with the selective policy, as torchtitan's `activation_checkpoint.mode = "selective"`, `selective_ac_option = "op"`
wraps each transformer block (Megatron-LM's `--recompute-granularity selective` is another policy: refused): a
microbatch keeps the units' inputs (`checkpoint_inputs`) and their saved ops' outputs (`selective_activation_bytes`);
the backward re-materialises one unit's other activations at a time and redoes the units' `selective_recompute_s`
(`_selective_unit_figures`). No trainer re-materialises a whole stage at once: they refuse whole-stage selective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Protocol

import numpy as np

from autopp.errors import ScheduleError

__all__ = ["Activation", "SAVED_OPS", "Figures", "ActivationPolicy", "StageFigures", "UnitFigures", "POLICIES",
           "POLICY_COLUMNS", "FIGURED", "figure_keys", "policy", "parse_activation", "order_key", "chosen",
           "by_saving", "tally"]


class Activation(Enum):
    """A stage's activation policy; its value is the JSON and flag spelling."""

    KEEP = "keep"
    RECOMPUTE = "recompute"
    SELECTIVE = "selective"
    OFFLOAD = "offload"
    BLOCKS = "recompute-units"
    SELECTIVE_UNITS = "selective-units"


#: The ops whose outputs selective recomputation keeps (`str(op.overloadpacket)`: "aten.mm"), the one list the runner's
#: checkpoint policy (autopp.run.chain), the measured profile and the analytic count (autopp.measure) read. torchtitan's
#: `_save_list` (mm, the SDPA kernels, the reduce-scatter of a tensor-parallel output) plus the CPU spellings of a
#: matmul with bias or a batch (addmm, bmm, baddbmm) and of SDPA (`_scaled_dot_product_flash_attention_for_cpu`).
SAVED_OPS: frozenset[str] = frozenset({
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_attention_math",
    "aten._scaled_dot_product_fused_attention_overrideable", "_c10d_functional.reduce_scatter_tensor"})


class Figures(NamedTuple):
    """A policy's own figures of one microbatch of a stage, beyond what every stage has (its forward time, its
    activation and input bytes): carried generically, policy -> figures, from the profile's columns (or, for a
    policy whose figures follow from the stages and the hardware, from the cost model) through `UnitArrays`,
    `StageCost` and the plan's stages, so that a policy with figures of its own adds no field anywhere."""

    kept_bytes: int = 0
    """Bytes one microbatch keeps for its backward besides the stage input (selective: the saved ops' outputs)."""
    redo_s: float = 0.0
    """Time the policy adds to the stage's backward (selective: the ops it runs again)."""
    redone_bytes: int = 0
    """Bytes its backward allocates again at its start, freed at its end (per-unit recomputation: the largest unit's
    activations)."""


class StageFigures(Protocol):
    """What a policy reads of one microbatch of a stage (`autopp.schedule.effects.StageCost` has these)."""

    @property
    def forward_s(self) -> float: ...
    @property
    def redo_forward_s(self) -> float: ...
    @property
    def activation_bytes(self) -> int: ...
    @property
    def input_bytes(self) -> int: ...
    @property
    def backward_input_s(self) -> float: ...
    @property
    def backward_weight_s(self) -> float: ...
    def figures(self, a: Activation) -> Figures: ...


class UnitFigures(Protocol):
    """What a policy reads of a profile's units at one microbatch size (`autopp.costmodel.UnitArrays` has these)."""

    @property
    def forward(self) -> np.ndarray: ...
    @property
    def recompute(self) -> np.ndarray: ...
    @property
    def activation(self) -> np.ndarray: ...
    def checkpoint_inputs(self, i: int, j: int) -> float: ...
    def checkpoint_charge(self) -> np.ndarray: ...
    @property
    def own(self) -> Mapping[Activation, tuple[np.ndarray, np.ndarray]]: ...


def _none(a: UnitFigures) -> np.ndarray:
    return np.zeros(len(a.forward))


def _always(a: UnitFigures, host_bandwidth: float) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class ActivationPolicy:
    """What one policy keeps, redoes and is called. Each policy reads its own figures: the simulator, the split's
    memory check and the bounds pass the stage's or the units' figures whole (`StageFigures`, `UnitFigures`)."""

    name: Activation
    summary: str
    """One line for tables and docs."""
    saving: int
    """Rank by memory saved (0: keeps everything): the search tries policies in this order, each cheaper in time
    and dearer in memory than the next (`by_saving`)."""
    redo_s: Callable[[StageFigures], float]
    """What the policy adds to a B or I of the stage: the forward again, part of it, or 0."""
    kept: Callable[[StageFigures], int]
    """Bytes one microbatch holds from its F until the backward that frees it."""
    redone: Callable[[StageFigures], int]
    """Bytes allocated again when the backward starts (the recomputed activations), freed with the kept ones."""
    unit_redo: Callable[[UnitFigures], np.ndarray]
    """Per unit, what the policy adds to one microbatch's compute (the split's objective, and with the units'
    forward as a ceiling the bounds)."""
    unit_bytes: Callable[[UnitFigures, int], np.ndarray]
    """Per unit, the activation bytes the split's memory check charges a stage with this many microbatches in flight
    (a relaxation where only inputs are kept: the kept inputs are charged by the simulator and the order walks, which
    judge every plan)."""
    columns: tuple[str, ...] = ()
    """The profile's units.csv columns of its own figures (`Figures`): per unit, the bytes kept and the seconds
    redone per microbatch, in that order (`POLICY_COLUMNS`; empty: the policy has none in the profile)."""
    derive: Callable[[Sequence[StageFigures], int, float], Figures] | None = None
    """Its figures for stage s of a split when they follow from the stages' costs and the device's host link
    (bytes/s per direction) rather than from profile columns (`autopp.costmodel.stage_costs` calls it)."""
    from_units: Callable[[UnitFigures, int, int], Figures] | None = None
    """Its figures for the stage of units [i, j) when they follow from the units' arrays (the cuts, the activations)
    rather than from profile columns (`autopp.costmodel.stage_costs` calls it; `redo_s` per unit of speed)."""
    offered: Callable[[UnitFigures, float], bool] = _always
    """Whether the search may give it a stage: the units carry its figures (a profile without them: not offered),
    and with the devices' host link (bytes/s per direction; 0: none, the device's memory is the host's)."""
    unoffered: str = ""
    """Why it may not be offered (`offered`), for messages."""
    checkpoint: bool
    """The runner wraps the stage's forward in `torch.utils.checkpoint.checkpoint` (non-reentrant)."""
    per_unit: bool = False
    """That checkpoint wraps each unit of the stage on its own instead of the whole stage."""
    saves_ops: frozenset[str] = frozenset()
    """Under that checkpoint, the ops whose outputs are kept (torch's selective checkpoint context); empty: none."""
    to_host: bool = False
    """The runner runs the stage's forward under `torch.autograd.graph.save_on_cpu`: what autograd saves goes to
    host memory, and comes back when the backward unpacks it."""
    torchtitan: str
    """torchtitan's `activation_checkpoint.mode` for it."""
    megatron: tuple[str, ...]
    """Megatron-LM's arguments for it."""
    deepspeed_interval: int | None
    """DeepSpeed PipelineModule's `activation_checkpoint_interval` for it (None: DeepSpeed cannot express it)."""
    refusals: Mapping[str, str] = field(default_factory=dict)
    """Per trainer ("torchtitan", "megatron", "deepspeed"), why it cannot apply this policy (absent: it can);
    `autopp plan --for TRAINER` does not offer a policy its trainer refuses, and the exporters refuse it."""
    trainer_note: str = ""
    """What the trainers' version leaves out that autopp counted (empty: nothing)."""

    def refusal(self, trainer: str) -> str | None:
        """Why `trainer` ("torchtitan", "megatron", "deepspeed") cannot apply this policy (None: it can)."""
        return self.refusals.get(trainer)

    @property
    def redoes_forward(self) -> bool:
        """The backward (B, or I of split-backward schedules) first runs some of the stage's forward again."""
        return self.checkpoint


def _selective_kept(a: UnitFigures) -> np.ndarray:
    """Per unit, what selective recomputation keeps; without the figures (not offered), everything, as keeping."""
    return a.own[Activation.SELECTIVE][0] if Activation.SELECTIVE in a.own else a.activation


def _selective_units(a: UnitFigures, inflight: int) -> np.ndarray:
    kept = _selective_kept(a)
    return inflight * kept + np.maximum(a.activation - kept, 0.0)


def _selective_redo(a: UnitFigures) -> np.ndarray:
    return a.own[Activation.SELECTIVE][1] if Activation.SELECTIVE in a.own else _none(a)


def _selective(c: StageFigures) -> Figures:
    return c.figures(Activation.SELECTIVE)


def _selective_unit_figures(a: UnitFigures, i: int, j: int) -> Figures:
    """Per-unit selective recomputation of the stage of units [i, j): kept, the units' inputs (`checkpoint_inputs`)
    and saved ops' outputs; redone, the largest unit's other activations; redo, the units' selective recompute."""
    kept, redo = _selective_kept(a)[i:j], _selective_redo(a)[i:j]
    rest = np.maximum(a.activation[i:j] - kept, 0.0).max(initial=0.0)
    return Figures(int(kept.sum() + a.checkpoint_inputs(i, j)), float(redo.sum()), int(rest))


def _selective_per_unit(c: StageFigures) -> Figures:
    return c.figures(Activation.SELECTIVE_UNITS)


_SELECTIVE_NOTE = ("torchtitan's op-level policy also recomputes every second matmul; autopp counted every matmul "
                   "and attention output kept, so it keeps fewer bytes and recomputes more time than planned")
_MEGATRON_SELECTIVE = ("Megatron-LM's --recompute-granularity selective recomputes whole submodules (megatron-core's "
                       "recompute_modules, default core_attn, which fused attention makes nearly free: "
                       "transformer_config.py), not autopp's selective policy, so the plan's memory would not hold")
_SELECTIVE_REFUSALS = {
    "torchtitan": "torchtitan's activation_checkpoint:selective wraps each transformer block (per-unit selective "
                  "recomputation, `selective-units`); it has no whole-stage checkpoint",
    "megatron": _MEGATRON_SELECTIVE,
    "deepspeed": "DeepSpeed's PipelineModule checkpoints whole layers (activation_checkpoint_interval); it has no "
                 "op-level selective recomputation"}
_FULL_NOTE = ("the trainer's full recomputation covers the transformer blocks only; the embedding and the output "
              "part keep their activations, which autopp counted as recomputed")

def _offload_figures(stages: Sequence[StageFigures], s: int, host_bandwidth: float) -> Figures:
    """What offloading adds to a backward of stage `s`: the part of its activations' trip to host memory and back
    that does not hide under compute (PipeOffload). The trip takes `move` = activation bytes / host bandwidth each
    way, on a link that carries both ways at once. It hides when it fits between the microbatch's forward and its
    backward, a window that is at least the microbatch's own path through the later stages (their forward and
    input-gradient times, whatever the schedule), and when each way's transfer of one microbatch fits in the stage's
    own compute of one (forward + backward), so that transfers do not queue. The rest is exposed: max(0, 2 move -
    window, move - compute). The last stage has no window: offloading it exposes the whole trip."""
    c = stages[s]
    move = c.activation_bytes / host_bandwidth
    window = sum(x.forward_s + x.backward_input_s for x in stages[s + 1:])
    compute = c.forward_s + c.backward_input_s + c.backward_weight_s
    return Figures(0, max(0.0, 2 * move - window, move - compute))


def _unit_figures(a: UnitFigures, i: int, j: int) -> Figures:
    """Per-unit recomputation of the stage of units [i, j): kept, its units' inputs (`checkpoint_inputs`); redone,
    its largest unit's activations; the forward's time is the stage's own (`redo_s`)."""
    return Figures(int(a.checkpoint_inputs(i, j)), 0.0, int(a.activation[i:j].max(initial=0.0)))


def _units(c: StageFigures) -> Figures:
    return c.figures(Activation.BLOCKS)


_WHOLE_STAGE = ("{trainer} checkpoints each layer (per-unit recomputation, `recompute-units`), not a whole stage "
                "as one checkpoint")
_RECOMPUTE_REFUSALS = {
    "torchtitan": "torchtitan's activation_checkpoint:full wraps each transformer block (per-unit recomputation, "
                  "`recompute-units`); it has no whole-stage checkpoint",
    "megatron": _WHOLE_STAGE.format(trainer="Megatron-LM's --recompute-method uniform --recompute-num-layers 1")
                + "; a whole stage needs --recompute-num-layers of a stage's layers, which autopp does not export",
    "deepspeed": _WHOLE_STAGE.format(trainer="DeepSpeed's activation_checkpoint_interval 1")
                 + "; a whole stage needs an interval of a stage's layers, which autopp does not export"}


def _offloaded(c: StageFigures) -> float:
    return c.figures(Activation.OFFLOAD).redo_s


_OFFLOAD_REFUSALS = {
    "torchtitan": "torchtitan 0.3 has no activation offload (its training.enable_cpu_offload is FSDP's "
                  "CPUOffloadPolicy for parameters, gradients and optimizer state)",
    "megatron": "Megatron-Core's --cpu-offloading refuses pipeline parallelism (TransformerConfig: \"Currently there "
                "is no support for Pipeline parallelism with CPU offloading\") and offloads fewer layers than the "
                "model has (--cpu-offloading-num-layers < num_layers)",
    "deepspeed": "DeepSpeed's cpu_checkpointing moves the inputs that activation checkpointing keeps to host memory, "
                 "which is recomputation, not offloading a stage's saved activations"}

#: Every activation policy.
POLICIES: dict[Activation, ActivationPolicy] = {p.name: p for p in (
    ActivationPolicy(name=Activation.KEEP, summary="keep every activation for the backward", saving=0,
                     redo_s=lambda c: 0.0, kept=lambda c: c.activation_bytes, redone=lambda c: 0, unit_redo=_none,
                     unit_bytes=lambda a, inflight: inflight * a.activation,
                     checkpoint=False, torchtitan="none", megatron=(), deepspeed_interval=0),
    ActivationPolicy(name=Activation.RECOMPUTE, summary="keep the stage input; recompute the forward in the backward",
                     saving=4, redo_s=lambda c: c.redo_forward_s, kept=lambda c: c.input_bytes,
                     redone=lambda c: c.activation_bytes, unit_redo=lambda a: a.recompute,
                     unit_bytes=lambda a, inflight: a.activation,
                     checkpoint=True, torchtitan="none", megatron=(), deepspeed_interval=None,
                     refusals=_RECOMPUTE_REFUSALS),
    ActivationPolicy(name=Activation.SELECTIVE, summary="keep matmul and attention outputs; recompute the other ops "
                     "in the backward", saving=1,
                     redo_s=lambda c: _selective(c).redo_s, kept=lambda c: _selective(c).kept_bytes + c.input_bytes,
                     redone=lambda c: max(0, c.activation_bytes - _selective(c).kept_bytes),
                     unit_redo=_selective_redo, unit_bytes=_selective_units,
                     columns=("selective_activation_bytes", "selective_recompute_s"),
                     offered=lambda a, host: Activation.SELECTIVE in a.own,
                     unoffered="the profile has no figures for it: profile again",
                     checkpoint=True, saves_ops=SAVED_OPS, torchtitan="none", megatron=(), deepspeed_interval=None,
                     refusals=_SELECTIVE_REFUSALS),
    ActivationPolicy(name=Activation.OFFLOAD, summary="move the saved activations to host memory after the forward "
                     "and back before the backward", saving=3,
                     redo_s=_offloaded, kept=lambda c: c.input_bytes, redone=lambda c: 2 * c.activation_bytes,
                     unit_redo=_none, unit_bytes=lambda a, inflight: 2 * a.activation, derive=_offload_figures,
                     offered=lambda a, host: host > 0, unoffered="the devices have no host link to offload over (a "
                     "CPU rank's memory is the host's: offloading would save nothing)", checkpoint=False, to_host=True,
                     torchtitan="none", megatron=(), deepspeed_interval=None, refusals=_OFFLOAD_REFUSALS),
    ActivationPolicy(name=Activation.BLOCKS, summary="keep each unit's input; recompute one unit's forward at a time "
                     "in the backward", saving=5,
                     redo_s=lambda c: c.redo_forward_s, kept=lambda c: _units(c).kept_bytes,
                     redone=lambda c: _units(c).redone_bytes, unit_redo=lambda a: a.recompute,
                     unit_bytes=lambda a, inflight: inflight * a.checkpoint_charge(), from_units=_unit_figures,
                     checkpoint=True, per_unit=True, torchtitan="full",
                     megatron=("--recompute-granularity full", "--recompute-method uniform",
                               "--recompute-num-layers 1"),
                     deepspeed_interval=1, trainer_note=_FULL_NOTE),
    ActivationPolicy(name=Activation.SELECTIVE_UNITS, summary="keep each unit's input and its matmul and attention "
                     "outputs; recompute one unit's other ops at a time in the backward", saving=2,
                     redo_s=lambda c: _selective_per_unit(c).redo_s, kept=lambda c: _selective_per_unit(c).kept_bytes,
                     redone=lambda c: _selective_per_unit(c).redone_bytes, unit_redo=_selective_redo,
                     unit_bytes=lambda a, inflight: inflight * (_selective_kept(a) + a.checkpoint_charge()),
                     from_units=_selective_unit_figures,
                     offered=lambda a, host: Activation.SELECTIVE in a.own,
                     unoffered="the profile has no figures for selective recomputation: profile again",
                     checkpoint=True, per_unit=True, saves_ops=SAVED_OPS, torchtitan="selective",
                     megatron=(), deepspeed_interval=None, trainer_note=_SELECTIVE_NOTE,
                     refusals={t: _SELECTIVE_REFUSALS[t] for t in ("megatron", "deepspeed")}),
)}


#: The optional units.csv columns of the policies' own figures (`ActivationPolicy.columns`) and their types, not
#: filled in when absent (docs/profile-format.md): a profile without a policy's columns is planned without it.
POLICY_COLUMNS: dict[str, str] = {c: t for p in POLICIES.values() if p.columns
                                  for c, t in zip(p.columns, ("int", "float"))}

#: The policies with figures of their own (`Figures`: from profile columns, or derived).
FIGURED: tuple[Activation, ...] = tuple(p.name for p in POLICIES.values() if p.columns or p.derive or p.from_units)


def figure_keys(a: Activation) -> tuple[str, str, str]:
    """The plan JSON's stage fields of `a`'s own figures ("selective_bytes", ...: `Figures`' fields in order)."""
    return f"{a.value}_bytes", f"{a.value}_redo_s", f"{a.value}_redone_bytes"


def policy(a: Activation) -> ActivationPolicy:
    return POLICIES[a]  # the descriptor of activation policy `a`


def parse_activation(text: object, where: str = "activation") -> Activation:
    """The policy spelled `text` (its value); a ScheduleError naming the policies otherwise."""
    names = [a.value for a in Activation]
    if not isinstance(text, str) or text not in names:
        raise ScheduleError(f"{where}: activation policy {text!r} does not exist; give one of {names}")
    return Activation(text)


def order_key(activations: tuple[Activation, ...]) -> tuple[int, ...]:
    """A sort key of per-stage policies, each by its place in `Activation` (KEEP first): ties break the same way."""
    return tuple(list(Activation).index(a) for a in activations)


def chosen(stages: int, recomputed: set[int] | frozenset[int] | tuple[int, ...]) -> tuple[Activation, ...]:
    """Per-stage policies of `stages` stages: RECOMPUTE for the stages in `recomputed`, KEEP for the others."""
    return tuple(Activation.RECOMPUTE if s in recomputed else Activation.KEEP for s in range(stages))


def by_saving(activations: tuple[Activation, ...] | list[Activation] | set[Activation]) -> tuple[Activation, ...]:
    """`activations` without repeats, least memory saved first (`ActivationPolicy.saving`): the search's ladder."""
    return tuple(sorted(set(activations), key=lambda a: POLICIES[a].saving))


def tally(activations: Sequence[Activation]) -> str:
    """Per-stage policies counted by name, in registry order ("4 keep, 60 offload")."""
    return ", ".join(f"{n} {a.value}" for a in Activation if (n := sum(x is a for x in activations)))

