"""The parallel axes as descriptors: whether autopp plans each, where its devices sit, and how the command line and
each trainer spell it.

As ZeRO stages are (autopp.data.zero), each axis of the Layout (autopp.data.layout) is one value in one registry,
`AXES`: the exporters (autopp.export), `autopp plan`'s flags (autopp.cli.plan) and the messages read an axis's
spelling here, so filling a new axis changes its descriptor, not each reader. The trainers' spellings are their own
documentation's: torchtitan's `[parallelism]` section (torchtitan/config/job_config.py: `pipeline_parallel_degree`,
`context_parallel_degree`, `tensor_parallel_degree`, `expert_parallel_degree`; dp is written by the ZeRO stage as
`data_parallel_replicate_degree` / `data_parallel_shard_degree`), Megatron-LM's arguments
(megatron/training/arguments.py: `--pipeline-model-parallel-size`, `--context-parallel-size`,
`--tensor-model-parallel-size`, `--expert-model-parallel-size`, with `--num-experts`, `--moe-router-topk` and
`--moe-token-dispatcher-type`; dp is the world size left over) and DeepSpeed's
`PipelineModule(num_stages=...)` (deepspeed/runtime/pipe/module.py; dp is the world size left over).

Expert tensor parallelism (`etp`) as autopp defines it: each expert's GEMMs sharded over etp ranks, gate and up
projections column-wise, down row-wise, as Megatron-Core's `--expert-tensor-parallel-size` (MoE Parallel Folding, Liu
et al. 2025, arXiv:2504.14960: the expert layers get their own grid etp x ep x edp over the devices of the
attention's tp x cp x dp). Its ranks are carved, like ep's, from a stage's data-parallel ranks: an MoE layer's
grid is etp (fastest) x ep x edp = dp (tp 1, cp 1, as autopp runs ep), so ep x etp divides dp, and etp > 1 needs
ep > 1 (torchtitan: "no effect ... when ep = 1"). The etp ranks hold different tokens: after the ep dispatch the rows
an etp group received are all-gathered over it, each rank runs its 1 / etp of its E / ep experts on all of them,
and the partial outputs are reduce-scattered back before the combine (Megatron-Core's all-to-all dispatcher:
all-to-all over ep, then all-gather over the expert-TP group, megatron/core/transformer/moe/token_dispatcher.py).
A rank then does the FLOPs of etp 1 on etp times the rows, reads 1 / (ep x etp) of the expert weights and holds 1 /
(ep x etp) of their bytes (autopp.costmodel.experts); the expert gradients are summed over the dp / (ep x etp) edp
ranks holding the same shard (autopp.run.expert_parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import LayoutError

__all__ = ["Spelling", "Flag", "Axis", "AXES", "TRAINERS", "unplanned", "UNPLANNED", "check_planned", "group_axes",
           "Switch", "SWITCHES"]

#: The trainers autopp exports to, by the name their descriptors use.
TRAINERS = ("torchtitan", "megatron", "deepspeed")


@dataclass(frozen=True, kw_only=True)
class Spelling:
    """How one trainer spells an axis."""

    degree: str | None = None
    """The trainer's key or flag for the axis's degree; None: it has none (derived from the world size, or written
    with the ZeRO stage, as dp)."""
    extra: tuple[str, ...] = ()
    """Whole lines (overrides, flags) the export adds when the degree is above 1."""
    note: str = ""
    """A note to the user when the degree is above 1: how the trainer runs it against what autopp costed."""
    refusal: str | None = None
    """Why the trainer cannot run the axis above degree 1 beside pipeline parallelism (None: it can)."""
    facts: tuple[tuple[str, str], ...] = ()
    """The model's facts the trainer needs beside the degree when it is above 1, and its key for each: (a key of
    the profile's `meta.extra["moe"]` (autopp.model.experts.moe_facts), the trainer's key)."""
    facts_if_any: tuple[tuple[str, str], ...] = ()
    """As `facts`, written only where the profile records the fact (not None): a group-limited routing's groups."""


@dataclass(frozen=True, kw_only=True)
class Flag:
    """`autopp plan`'s flag pinning the axis's degree (`--NAME`)."""

    help: str
    auto: bool = True
    """The flag takes `auto`: the degree is searched."""
    default: int | None = 1
    """The pin when the flag is not given (None: searched)."""


@dataclass(frozen=True, kw_only=True)
class Axis:
    """One parallel axis: its Layout field, what it is, whether autopp plans it, and its spellings."""

    name: str
    """The Layout and LayoutPins field, and the JSON field of plans and reports."""
    what: str
    """The axis in words ("tensor parallelism")."""
    in_group: bool = False
    """Its ranks are devices of one pipeline rank of one replica (`Layout.group`): the search sees each group as one
    rank (`PlanRequest.view`)."""
    syncs: bool = False
    """Its ranks hold the same parameters and average their gradients after a step (`Layout.sync`, over which ZeRO
    shards)."""
    unplanned: str | None = None
    """The issue that adds it, while autopp does not plan, run or export it (`check_planned` refuses it); None:
    planned."""
    flag: Flag | None = None
    """`autopp plan`'s flag for it (None: none)."""
    trainers: dict[str, Spelling] = field(default_factory=dict, compare=False, hash=False)
    """Trainer (`TRAINERS`) -> its spelling."""

    def spelling(self, trainer: str) -> Spelling:
        """How `trainer` spells the axis (nothing: no key, no refusal)."""
        return self.trainers.get(trainer, Spelling())

    def __str__(self) -> str:
        return self.name


_RE_PLAN = "re-plan with `{axis}` 1, or export to torchtitan or megatron"

#: Every axis of the Layout (but v, the stages per pipeline rank), in the order of its mesh (`MESH_AXES`), then the
#: axes carved from its dp ranks: ep, etp.
AXES: dict[str, Axis] = {a.name: a for a in (
    Axis(name="pp", what="pipeline parallelism",
         flag=Flag(help="pin the pipeline ranks (default: devices / (dp x tp), searched with them)", auto=False,
                   default=None),
         trainers={"torchtitan": Spelling(degree="parallelism.pipeline_parallel_degree"),
                   "megatron": Spelling(degree="--pipeline-model-parallel-size"),
                   "deepspeed": Spelling(degree="num_stages")}),
    Axis(name="dp", what="data parallelism", syncs=True,
         flag=Flag(help="data-parallel replicas, or auto (default): every divisor of the devices (devices / (pp x "
                        "cp x tp) with --pp)", default=None)),
    Axis(name="cp", what="context parallelism", in_group=True, syncs=True,
         flag=Flag(help="context-parallel degree: each sequence sharded over cp ranks, attention as ring attention "
                        "(the sequence must divide by 2 x cp x tp; needs a profile of an HF config), or auto: 1 and "
                        "every degree that fits (default 1)"),
         trainers={"torchtitan": Spelling(
                       degree="parallelism.context_parallel_degree",
                       note="torchtitan shards each sequence over cp ranks with torch's context_parallel (head-tail "
                            "load balancing, as autopp costed it) but gathers K/V with torch's default all-gather, "
                            "overlapped with the first block of attention only, where autopp costed a ring that "
                            "overlaps each step: more is exposed when one block's compute is shorter than cp - 1 "
                            "transfers (torchtitan 0.3 has no rotation option)"),
                   "megatron": Spelling(
                       degree="--context-parallel-size",
                       note="Megatron-Core shards each sequence over cp ranks (2 x cp chunks, load-balanced) and "
                            "passes K/V around a P2P ring under the attention compute, as autopp costed it"),
                   "deepspeed": Spelling(refusal="DeepSpeed's PipelineModule does not shard sequences and the "
                                                 "exported stage file builds no context parallelism (DeepSpeed-"
                                                 "Ulysses is another scheme: all-to-all over heads, heads % cp == 0, "
                                                 "not costed by autopp); "
                                                 + _RE_PLAN.format(axis="cp"))}),
    Axis(name="tp", what="tensor parallelism", in_group=True,
         flag=Flag(help="tensor-parallel degree (devices per pipeline rank; the profile needs rows of it: "
                        "`autopp profile --tp`), or auto (default): 1 and every degree profiled that fits a node "
                        "(a profile counted for --device has rows of each; one measured here only those its --tp "
                        "made, unless --tp auto is given)", default=None),
         trainers={
             "torchtitan": Spelling(
                 degree="parallelism.tensor_parallel_degree",
                 note="torchtitan shards with its model's own TP plan (for Llama the Megatron pattern autopp costed: "
                      "colwise q/k/v and gate/up, rowwise o and down, vocab-parallel embedding; its output layer "
                      "keeps vocab-sharded logits for a parallel loss: the loss-parallelism note says how the plan "
                      "counted them)"),
             "megatron": Spelling(
                 degree="--tensor-model-parallel-size",
                 note="Megatron shards with its own layers (column-parallel QKV and fc1, row-parallel proj and fc2, "
                      "vocab-parallel embedding and output with a parallel loss), the pattern autopp costed for "
                      "Llama-style blocks (the loss-parallelism note says how the plan counted the logits)"),
             "deepspeed": Spelling(refusal="DeepSpeed's PipelineModule does not shard layers (tensor parallelism "
                                           "comes from the model's own layers, as in Megatron-DeepSpeed) and the "
                                           "exported stage file builds none; " + _RE_PLAN.format(axis="tp"))}),
    Axis(name="ep", what="expert parallelism",
         flag=Flag(help="expert-parallel degree: ep groups carved from a stage's dp ranks each hold its experts, "
                        "1 / ep per rank (tp 1; ZeRO 0-2, or 3 at pp 1 as FSDP2; the runner runs ZeRO 0, and 3 at pp "
                        "1), or auto: 1 and every divisor of dp that divides the experts (default 1; beside --ep N "
                        "dp is searched among N's multiples, N x E's with --etp E)"),
         trainers={"torchtitan": Spelling(
                       degree="parallelism.expert_parallel_degree",
                       note="torchtitan's ExpertParallel shards each MoE layer's experts over ep ranks carved from "
                            "dp_shard x cp (x tp) and routes tokens by all-to-all, as autopp costed and runs it (ep "
                            "divides dp), and with FSDP shards the experts over dp_shard / ep (its dp_shard_mod_ep); "
                            "its model's config gives the experts and top-k (and a group-limited "
                            "routing's `num_expert_groups` / `num_limited_groups`, TokenChoiceTopKRouter); for such "
                            "a routing over several nodes autopp costed DeepEP's node-limited sends: "
                            "`--parallelism.expert_parallel_comm_backend=deepep` runs them"),
                   "megatron": Spelling(
                       degree="--expert-model-parallel-size", extra=("--moe-token-dispatcher-type alltoall",),
                       facts=(("num_experts", "--num-experts"), ("top_k", "--moe-router-topk")),
                       facts_if_any=(("num_groups", "--moe-router-num-groups"),
                                     ("group_top_k", "--moe-router-group-topk")),
                       note="Megatron-Core shards the experts over ep ranks carved from dp x cp and dispatches with "
                            "its all-to-all dispatcher, the pattern autopp costed (balanced routing; no capacity "
                            "factor, no token dropping); for a group-limited routing (DeepSeek-V3's, its groups "
                            "written) over an ep group of several nodes autopp costed DeepEP's node-limited sends "
                            "(each token across nodes once per target node): `--moe-token-dispatcher-type flex "
                            "--moe-flex-dispatcher-backend deepep` runs them, the alltoall dispatcher sends every "
                            "copy; under fp8 autopp costed DeepSeek's FP8 dispatch, which megatron-core's DeepEP "
                            "path does not do (it dispatches BF16: slower than the plan by the dispatch's bytes)"),
                   "deepspeed": Spelling(refusal="the exported stage file builds no expert parallelism (DeepSpeed's "
                                                 f"MoE layers take their own ep_size); {_RE_PLAN.format(axis='ep')}")}),
    Axis(name="etp", what="expert tensor parallelism",
         flag=Flag(help="expert-tensor-parallel degree: each expert's GEMMs sharded over etp ranks carved beside ep "
                        "from a stage's dp ranks (gate/up column-wise, down row-wise; needs ep > 1 and a --dp that ep "
                        "x etp divides), or auto: 1 and every divisor of dp / ep (default 1)"),
         trainers={"torchtitan": Spelling(
                       refusal="torchtitan's expert_tensor_parallel_degree takes only 1 or the tensor-parallel degree "
                               "(torchtitan/config/job_config.py; 0.3 has no such key), and autopp's etp is carved "
                               "from dp at tp 1; re-plan with `etp` 1, or export to megatron"),
                   "megatron": Spelling(
                       degree="--expert-tensor-parallel-size", extra=("--disable-bias-linear",),
                       note="Megatron-Core folds the expert layers onto their own etp x ep x edp grid (MoE Parallel "
                            "Folding) and its all-to-all dispatcher all-gathers the received rows over the etp group "
                            "and reduce-scatters the partial outputs, as autopp costed and runs it; it runs etp only "
                            "without linear biases (megatron-core's TransformerConfig: \"Bias in Moe is only "
                            "supported when ETP==1\"), hence --disable-bias-linear: the experts autopp runs etp for "
                            "have none"),
                   "deepspeed": Spelling(refusal="the exported stage file builds no expert layers (DeepSpeed's MoE "
                                                 "layer shards experts over Megatron-DeepSpeed's tensor-parallel "
                                                 "group, not over data-parallel ranks); re-plan with `etp` 1, or "
                                                 "export to megatron")}),
)}


def unplanned() -> dict[str, str]:
    """Axis name -> what it is and the issue that adds it, for the axes autopp does not plan, run or export yet."""
    return {a.name: f"{a.what} ({a.unplanned})" for a in AXES.values() if a.unplanned is not None}


#: Axes with a slot in the Layout that autopp does not plan, run or export yet, and the issue that adds each (their
#: descriptors' `unplanned`).
UNPLANNED = unplanned()


def check_planned(layout: object, where: str = "") -> None:
    """A LayoutError when `layout` (a Layout or LayoutPins, autopp.data.layout) asks for an axis autopp does not
    plan, run or export yet (`UNPLANNED`): the planner, the runner and the exporters would treat it as 1."""
    for axis, what in unplanned().items():
        value = getattr(layout, axis)
        if value not in (1, None):
            raise LayoutError(f"{where}`{axis}` {value}: {what} is not planned, run or exported yet; give `{axis}` 1")


def group_axes() -> tuple[Axis, ...]:
    """The axes whose ranks are the devices of one pipeline rank (`Axis.in_group`), in mesh order."""
    return tuple(a for a in AXES.values() if a.in_group)


@dataclass(frozen=True, kw_only=True)
class Switch:
    """A property of a layout's axis that is on or off (sequence parallelism of tp): its Layout field, `autopp
    plan`'s flag (`--NAME on|off|auto`) and each trainer's spelling of both states (where the axis is above 1)."""

    name: str
    """The Layout and LayoutPins field, and the JSON field of plans (written when true)."""
    what: str
    axis: str
    """The axis it belongs to (applies where that axis's degree is above 1)."""
    help: str
    on: dict[str, Spelling] = field(default_factory=dict, compare=False, hash=False)
    """Trainer -> its spelling when on: `extra` lines, a `note`, or a `refusal`."""
    off: dict[str, Spelling] = field(default_factory=dict, compare=False, hash=False)
    """Trainer -> its spelling when off (torchtitan's default is SP on: the export turns it off)."""

    def spelling(self, trainer: str, value: bool) -> Spelling:
        """How `trainer` spells the switch at `value`."""
        return (self.on if value else self.off).get(trainer, Spelling())


#: The layout's switches: sequence parallelism (docs/parallelism.md). torchtitan: `parallelism.
#: enable_sequence_parallel` (default true; torchtitan/config/job_config.py); Megatron-LM: `--sequence-parallel`
#: (megatron/training/arguments.py); DeepSpeed's pipeline engine has no sequence parallelism of TP.
SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch(name="sp", what="sequence parallelism", axis="tp",
           help="sequence parallelism with tp > 1 (the norms on 1/tp of the sequence, reduce-scatter + all-gather "
                "in place of each all-reduce): on, off, or auto: on wherever the profile counts it (it never costs "
                "more in autopp's model), off with profiles made before it (default auto)",
           on={"torchtitan": Spelling(extra=("--parallelism.enable_sequence_parallel",),
                                      note="sequence parallelism: torchtitan's own (enable_sequence_parallel, its "
                                           "default), as autopp ran and costed it (norms SequenceParallel, "
                                           "attention/MLP inputs all-gathered, row-wise outputs reduce-scattered)"),
               "megatron": Spelling(extra=("--sequence-parallel",),
                                    note="sequence parallelism: Megatron's --sequence-parallel also keeps the "
                                         "column-parallel inputs and dropout masks sharded (Korthikanti et al. "
                                         "2022: 34 sbh/t per layer), below autopp's count for torch's run"),
               "deepspeed": Spelling(refusal="DeepSpeed's pipeline engine has no sequence parallelism of tensor "
                                             "parallelism (its Ulysses sequence parallelism is another scheme); "
                                             "re-plan with `sp` off, or export to torchtitan or megatron")},
           off={"torchtitan": Spelling(extra=("--parallelism.no_enable_sequence_parallel",),
                                       note="without sequence parallelism, as autopp costed it (torchtitan's "
                                            "default is on: the export turns it off)"),
                "megatron": Spelling(note="no sequence parallelism, as autopp costed it")}),
)}
