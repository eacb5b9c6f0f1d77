"""What each trainer autopp exports to can run beside pipeline parallelism, as data: `autopp plan --for TRAINER`
searches only that (`PlanRequest.trainer`), and the exporters refuse the rest of a plan made without it in the
same words.

The rules come from the trainers' own code, as the exporters found them: torchtitan builds torch's pipelining
schedules by name and runs a synthesized order through torch's CSV runtime on the loop or V placement
(torchtitan/distributed/pipeline_parallel.py); Megatron-Core runs its own 1F1B and interleaved 1F1B
(megatron/core/pipeline_parallel/schedules.py), whose interleaving needs pp > 1 (parallel_state.py: "pipeline-model-
parallel size should be greater than 1 with interleaved schedule") and microbatches in groups of pp; DeepSpeed's
PipelineEngine runs its own TrainSchedule, one stage per rank (deepspeed/runtime/pipe/schedule.py). All three apply
one activation-checkpointing policy to every stage. What each runs of ZeRO and of the other parallel axes is said by
those descriptors (`ZeroStage.refusal`, `Axis.spelling(...).refusal`), which these rules read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from ..schedule import Activation, ScheduleName, describe, policy
from .axes import AXES, SWITCHES
from .layout import MESH_AXES, Layout, LayoutPins
from .overlap import TRAINER_OVERLAP, Overlap
from .zero import HSDP_REFUSALS, ZeroStage

__all__ = ["Trainer", "TRAINER_RULES", "trainer_rules", "refusal", "interleaving_problem", "optimizer_words",
           "kernels_words", "frees_outputs",
           "HF_DECODER_TO_TORCHTITAN"]


@dataclass(frozen=True, kw_only=True)
class Trainer:
    """What one trainer runs beside pipeline parallelism."""

    name: str
    """Its name in `TRAINERS` (autopp.data.axes), `--for` and `autopp export --to`."""
    title: str
    """How messages name it ("Megatron-Core")."""
    schedules: tuple[ScheduleName, ...]
    """The named schedules it runs."""
    runs: str
    """Those schedules in words, for messages."""
    synthesized: bool = False
    """It runs a synthesized order (`ScheduleName.CUSTOM`: torchtitan through torch's CSV runtime, on the loop or V
    placement of the named schedule the order was made from)."""
    groups_microbatches: bool = False
    """Its interleaved schedule runs microbatches in groups of pp (`interleaving_problem`)."""
    gathers_only_without_pp: str | None = None
    """Why a ZeRO stage that gathers parameters for each forward runs only without pipeline parallelism (None: it
    runs with it)."""
    seq_len: str | None = None
    """Its setting of the sequence length, `{}` for the value (None: the model's own, not a trainer setting)."""
    shards_beside: tuple[tuple[str, str], ...] = ()
    """(axis, why) for each axis beside which it never keeps whole data-parallel replicas (ZeRO 0)."""
    vocab: str = ""
    """Why it cannot run vocabulary parallelism (Yeung et al., MLSys 2025; `Plan.vocab`): none of the three splits
    the vocabulary layers over the pipeline ranks, so `--for` never offers it and the exporters refuse it."""
    optimizer: str = ""
    """What it trains with when its config names no optimizer, in words (the exports' optimizer note; none of them
    writes an optimizer)."""
    overlap: Overlap = TRAINER_OVERLAP
    """What it hides under compute on a GPU (autopp.data.overlap): the plan's default for `--for` it
    (`PlanRequest.assumed_overlap`), so that the search costs the run the export writes."""
    ep_a2a: str = ""
    """Why it cannot run expert parallelism's all-to-alls of one microbatch under another's compute
    (`Overlap.ep_a2a`: Megatron-Core's combined 1F1B); empty: it can."""
    beside_ep_a2a: tuple[Activation, ...] = ()
    """The activation policies it refuses beside `Overlap.ep_a2a` (Megatron-Core asserts that
    overlap_moe_expert_parallel_comm runs without full recomputation: megatron/core/transformer/transformer_config.py,
    "disable full recomputation when enabling overlap_moe_expert_parallel_comm"): `--for` plans them without it."""
    frees_outputs: bool = False
    """Its pipeline frees a stage's outputs once they are sent, keeping only their autograd node for the backward
    (Megatron-LM: `deallocate_output_tensor` in megatron/core/pipeline_parallel/schedules.py, on since its
    `core_transformer_config_from_args` sets `deallocate_pipeline_outputs`, in megatron/training/arguments.py, in
    argument_utils.py since 2026-05; Megatron-Bridge's providers default it on);
    False: it holds them until their backward (torch's PipelineStage, `fwd_cache`; DeepSpeed's PipelineEngine keeps
    them, or 1/tp of them under its activation partitioning, which autopp does not count)."""
    kernels: str = "eager"
    """The elementwise kernels it runs unless told (autopp.data.precision.KERNELS): "fused" where its model code is
    fused by default (Megatron-LM: Transformer Engine and its own fusions), else "eager"."""
    fuse: tuple[str, ...] = ()
    """Its lines that fuse them where it does not by default (torchtitan: torch.compile); () where it has none."""
    fused_how: str = ""
    """How it fuses them, in words, for the exports' notes."""
    module_names: tuple[tuple[str, str], ...] = ()
    """How the models it ships name the modules of a Hugging Face decoder: (HF prefix, its name; "" where its model
    has no such module), applied by the export when every profiled name is one of these prefixes (empty: it splits
    by layer counts, not names)."""

    def schedule_refusal(self, schedule: ScheduleName, layout: Layout, microbatches: int) -> str | None:
        """Why it cannot run `schedule` on `layout` with `microbatches` per replica (None: it can)."""
        if describe(schedule).given_order:
            return None if self.synthesized else f"{self.title} runs no synthesized order, only {self.runs}"
        if describe(schedule).mirrored:  # no trainer ships Chimera (Li and Hoefler, SC'21)
            return (f"{self.title} runs no bidirectional pipelines ({schedule.value}'s two replicas of every stage "
                    f"per rank), only {self.runs}")
        alone = (layout.pp, layout.v) == (1, 1) and not describe(schedule).sequence_chunks  # no pipeline to schedule
        if schedule not in self.schedules and not alone:
            return f"{self.title} runs only {self.runs}"
        if layout.v > 1 and self.groups_microbatches:
            return interleaving_problem(layout.pp, microbatches)
        return None

    def layout_refusal(self, layout: Layout) -> str | None:
        """Why it cannot run `layout`'s ZeRO stage or parallel axes beside pipeline parallelism (None: it can)."""
        found = self._refused(layout.zero, layout.pp, layout.dp_replicate, {a: getattr(layout, a) for a in AXES},
                              {s: bool(getattr(layout, s)) for s in SWITCHES}, str)
        return None if found is None else f"{found[0]}: {found[1]}"

    def pins_refusal(self, pins: LayoutPins, devices: int) -> str | None:
        """Why it cannot run what `pins` fix on `devices` devices, whatever the search chooses for the rest, in the
        words of `layout_refusal` with the pinned field in backquotes (None: it may). pp counts as pinned where every
        other degree of the mesh is (`devices` over their product)."""
        mesh = {a: getattr(pins, a) for a in MESH_AXES if a != "pp"}
        pp = pins.pp if pins.pp is not None or None in mesh.values() else devices // math.prod(mesh.values())
        found = self._refused(pins.zero, pp, pins.dp_replicate, {a: getattr(pins, a) for a in AXES},
                              {s: pins.sp for s in SWITCHES}, lambda field: f"`{field}`")
        return None if found is None else f"`trainer` {self.name} cannot run {found[0]}: {found[1]}"

    def overlap_refusal(self, overlap: Overlap, dtype: str | None) -> str | None:
        """Why it cannot hide what `overlap` assumes hidden on a model of `dtype` (None: it can; a dtype not known:
        not refused). Megatron-Core runs its EP A2A overlap on a bf16 or fp16 model only (transformer_config.py:
        "overlap_moe_expert_parallel_comm is only supported with bf16 or fp16 model")."""
        if not overlap.ep_a2a:
            return None
        if self.ep_a2a:
            return f"`overlap` ep_a2a with `trainer` {self.name}: {self.ep_a2a}; drop ep-a2a"
        if dtype not in (None, *EP_A2A_DTYPES):
            return (f"`overlap` ep_a2a with `trainer` {self.name}: {self.title} runs its EP A2A overlap on a bf16 or "
                    f"fp16 model only, and the model is {dtype}; profile it in bfloat16 or drop ep-a2a")
        return None

    def policies_refusal(self, allowed: tuple[Activation, ...], asked: str) -> str | None:
        """Why it applies none of the activation policies `allowed` (`asked`: the request's field that allowed them),
        as `recompute` all asks a whole-stage checkpoint, which none of the trainers applies (None: it applies one)."""
        if not allowed or any(policy(a).refusal(self.name) is None for a in allowed):
            return None
        return (f"{asked} (activation policy {allowed[0].value}) with `trainer` {self.name}: "
                f"{policy(allowed[0]).refusal(self.name)}; give `recompute` auto (with `trainer`, each policy it "
                "applies on every stage) or none")

    def _refused(self, zero: ZeroStage | None, pp: int | None, dp_replicate: int | None,
                 degrees: Mapping[str, int | None], switches: Mapping[str, bool | None],
                 field: Callable[[str], str]) -> tuple[str, str] | None:
        """(what, why) of the first of these values it cannot run beside pipeline parallelism, `what` naming the
        fields as `field` spells them (a None value is left to the search: never refused); None: it runs them all."""
        why = zero.refusal(self.name, pp) if zero is not None else None
        if zero is not None and why is not None:
            return f"{field('zero')} {zero.stage}", why
        hsdp = HSDP_REFUSALS.get(self.name)
        if dp_replicate is not None and dp_replicate > 1 and hsdp is not None:
            return f"{field('dp_replicate')} {dp_replicate} (HSDP)", hsdp
        if self.gathers_only_without_pp and zero is not None and zero.gathers_each_forward and pp is not None \
                and pp > 1:
            return (f"{field('zero')} {zero.stage} with {field('pp')} {pp}",
                    f"{self.gathers_only_without_pp}; re-plan with `zero` 1")
        for axis in AXES.values():
            degree = degrees.get(axis.name)
            why = axis.spelling(self.name).refusal
            if degree is not None and degree > 1 and why is not None:
                return f"{field(axis.name)} {degree}", why
        for name, rule in self.shards_beside:  # (HSDP beside ep is no layout: autopp.data.layout)
            degree = degrees.get(name)
            if degree is not None and degree > 1 and zero is not None and zero.replicated:
                return (f"{field('zero')} {zero.stage} with {field(name)} {degree}",
                        f"{rule}; re-plan with `zero` 1 or 3, or `{name}` 1")
        for switch in SWITCHES.values():  # a switch of an axis above 1 (sp of tp), as set
            value, above = switches.get(switch.name), degrees.get(switch.axis)
            why = switch.spelling(self.name, bool(value)).refusal if value is not None and above is not None \
                and above > 1 else None
            if why is not None:
                return f"{field(switch.name)} {'on' if value else 'off'}", why
        return None


def refusal(trainer: Trainer, schedule: ScheduleName, layout: Layout, microbatches: int) -> str | None:
    """Why `trainer` cannot run `schedule` on `layout` with `microbatches` per replica: its schedule or its ZeRO stage
    and axes (None: it can)."""
    return trainer.schedule_refusal(schedule, layout, microbatches) or trainer.layout_refusal(layout)


def interleaving_problem(pp: int, microbatches: int) -> str | None:
    """Why Megatron-Core's interleaved 1F1B refuses `microbatches` on `pp` ranks, or None. It needs pp > 1
    (parallel_state.py) and runs microbatches in groups of `microbatch_group_size_per_vp_stage` (default pp:
    model_parallel_config.py), requiring pp <= group <= M and M % group to be 0 or >= pp (schedules.py,
    forward_backward_pipelining_with_interleaving); with the default group that is M a multiple of pp."""
    if pp == 1:
        return ("Megatron-Core's interleaved 1F1B needs more than one pipeline rank (\"pipeline-model-parallel size "
                "should be greater than 1 with interleaved schedule\"); re-plan with `pp` above 1 or `schedule` 1F1B")
    if microbatches % pp:
        return (f"Megatron-Core's interleaved 1F1B runs microbatches in groups of pp ({pp}) and needs their count "
                f"to be a multiple of it, but it is {microbatches}; re-plan with `num_microbatches` "
                f"{pp * max(1, round(microbatches / pp))} (or another multiple of {pp})")
    return None


_ONE_F_ONE_B = ScheduleName.ONE_F_ONE_B

#: The model dtypes Megatron-Core runs its EP A2A overlap on (`Overlap.ep_a2a`; transformer_config.py asserts
#: "overlap_moe_expert_parallel_comm is only supported with bf16 or fp16 model").
EP_A2A_DTYPES = ("bfloat16", "float16")

#: HF Llama / Qwen2 / Qwen3 / Mistral module names (LlamaForCausalLM's `model.embed_tokens`, `model.layers.N`,
#: `model.norm`, `lm_head`) -> torchtitan's for the decoders it ships (torchtitan/models/llama3/model.py, and alike in
#: qwen3 and deepseek_v3: `tok_embeddings`, `layers.N`, `norm`, `output`); HF's `model.rotary_emb` is a buffer of
#: torchtitan's model (`freqs_cis`), not a module, so it is dropped.
HF_DECODER_TO_TORCHTITAN = (("model.embed_tokens", "tok_embeddings"), ("model.rotary_emb", ""),
                            ("model.layers", "layers"), ("model.norm", "norm"), ("lm_head", "output"))

#: Every trainer autopp exports to, by name.
TRAINER_RULES: dict[str, Trainer] = {t.name: t for t in (
    Trainer(name="torchtitan", title="torchtitan", runs="torch's named schedules",
            optimizer="AdamW unless its [optimizer] section names another (torchtitan/config/job_config.py)",
            schedules=tuple(s for s in ScheduleName if not describe(s).given_order and describe(s).torch_class
                            and not describe(s).sequence_chunks),
            synthesized=True,
            seq_len="--training.seq_len={}",
            ep_a2a="torch.distributed.pipelining's schedules run each forward and backward on its own, and "
                   "torchtitan's expert parallelism waits for each all-to-all (no combined forward-backward step)",
            shards_beside=(("cp", "torchtitan shards over dp_shard x cp whenever cp > 1 (ParallelDims.fsdp_enabled: "
                                  "dp_shard > 1 or cp > 1), so it never keeps whole replicas beside cp"),
                           ("ep", "torchtitan carves the ep ranks from dp_shard x cp x tp (ParallelDims: its expert "
                                  "mesh's efsdp = dp_shard x cp x tp / ep), and autopp's ep runs at tp 1 and cp 1, "
                                  "so dp_shard (1 without sharding: ZeRO 0 writes dp as "
                                  "data_parallel_replicate_degree) must hold the ep ranks")),
            module_names=HF_DECODER_TO_TORCHTITAN,
            fuse=("--compile.enable",), fused_how="torch.compile of each block (`--compile.enable`; off by default)",
            vocab="torchtitan keeps the embedding and the output layer whole in the first and last stages (it splits "
                  "them only by tensor parallelism), never along the vocabulary over the pipeline ranks"),
    Trainer(name="megatron", title="Megatron-Core", runs="1F1B or Interleaved1F1B",
            optimizer="Adam with decoupled weight decay unless --optimizer sgd (megatron/training/arguments.py)",
            schedules=(_ONE_F_ONE_B, ScheduleName.INTERLEAVED_1F1B), groups_microbatches=True,
            seq_len="--seq-length {}",
            kernels="fused", frees_outputs=True, beside_ep_a2a=(Activation.BLOCKS, Activation.RECOMPUTE),
            fused_how="Transformer Engine's fused norms and attention (its default --transformer-impl "
                      "transformer_engine) and Megatron-LM's bias-SwiGLU, bias-GeLU, masked-softmax and RoPE fusions, "
                      "each on unless its --no-*-fusion flag is given (megatron/training/arguments.py)",
            vocab="Megatron-LM's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split "
                  "only count the embedding and the loss as a layer when dividing layers among stages; they do not "
                  "split the vocabulary over the pipeline ranks",
            gathers_only_without_pp="Megatron-LM shards parameters only through FSDP, which it does not run beside "
                                    "pipeline parallelism (--use-torch-fsdp2 asserts a pipeline size of 1)"),
    Trainer(name="deepspeed", title="DeepSpeed's PipelineEngine",
            optimizer="the optimizer given to deepspeed.initialize, or an \"optimizer\" block added to the JSON",
            runs="1F1B (its own TrainSchedule, one stage per rank)", schedules=(_ONE_F_ONE_B,),
            ep_a2a="its TrainSchedule runs each microbatch's forward and backward as instructions of their own",
            fused_how="the kernels of the model's own code (PipelineModule runs its layers as written)",
            # its TrainSchedule reduces gradients only after the last backward (ReduceGrads; autopp.export.overlap),
            # and it runs no ZeRO stage that scatters per microbatch (ZeRO 0 and 1 under pipelining)
            overlap=Overlap(fsdp_prefetch=False, grad_reduce=False),
            vocab="DeepSpeed's PipelineModule places the embedding and the head as layers of the first and last "
                  "stages; it does not split the vocabulary over the pipeline ranks"),
)}


def trainer_rules(name: str) -> Trainer:
    """The rules of trainer `name` (one of `TRAINER_RULES`)."""
    return TRAINER_RULES[name]


def frees_outputs(trainer: str | None, asked: bool | None) -> bool:
    """Whether a plan's pipeline frees each stage's outputs once sent (`PlanRequest.frees_outputs`): `asked`, else
    what `trainer` does (`Trainer.frees_outputs`), else not (torch's PipelineStage, which `autopp run` drives)."""
    return asked if asked is not None else trainer is not None and trainer_rules(trainer).frees_outputs


def optimizer_words(trainer: str, counted: str | None) -> str:
    """What a plan's memory counts of the optimizer (`counted`: the profile's optimizer, None where the plan records
    none), what `trainer` trains with unless told (`Trainer.optimizer`), and, where the count is not Adam(W)'s, how
    to plan for it: the one sentence of `autopp plan --for`'s note and of every export's."""
    what = f"{counted}'s state" if counted else "the state of an optimizer the plan does not record"
    again = "" if counted in ("adam", "adamw") else \
        "; to plan for Adam(W), profile again with --optimizer adamw (2 fp32 states per parameter) and plan again"
    return f"the plan's memory counts {what} (the profile's); {trainer_rules(trainer).title} trains with " \
        f"{trainer_rules(trainer).optimizer}{again}"


def kernels_words(trainer: str, counted: str | None, compiles: bool = False) -> str | None:
    """Where `trainer` runs other elementwise kernels than the plan's profile counted (`counted`: "eager", "fused"
    or None, not known; `compiles`: its run is compiled for another reason, torchtitan's async TP), what that does to
    its step, in one sentence (None: they agree, or the plan does not know): the note of `autopp plan --for` and of
    every export (autopp.export.common.kernels_for, which also writes the lines that fuse where it can)."""
    rules = trainer_rules(trainer)
    runs = "fused" if compiles else rules.kernels
    if counted is None or counted == runs:
        return None
    if counted == "eager":
        how = rules.fused_how if rules.kernels == "fused" else "torch.compile, which the run turns on"
        return (f"the plan counted eager elementwise kernels, each op its own; {rules.title} fuses them ({how}): its "
                "step may be shorter and its activations smaller than predicted (fused kernels recompute what eager "
                "ones save); count the profile with `--kernels fused` to predict them")
    if rules.fuse:
        return (f"the plan counted fused elementwise kernels (`--kernels fused`): {rules.title} fuses them with "
                f"{rules.fused_how}, which its export turns on")
    return (f"the plan counted fused elementwise kernels (`--kernels fused`); {rules.title} runs {rules.fused_how}: "
            "unless that code fuses them (torch.compile), its step takes longer and its activations take more "
            "memory than predicted (eager kernels save what fused ones recompute); plan from a profile counted "
            "with eager kernels to predict it")
