"""Megatron-LM command-line arguments: pipeline sizes, `--pipeline-model-parallel-layout`, batch and recompute."""

from __future__ import annotations

import itertools
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..data.axes import AXES
from ..data.hf_config import read_hf_config
from ..data.plan import Plan
from ..data.trainers import EP_A2A_DTYPES, trainer_rules
from ..data.profile_values import LiveValue
from ..errors import ModelFileError
from .common import (Exported, axis_notes, carved_lines, group_lines, launch_grid, loss_parallel_notes, made_for,
                     refuse_layout, optimizer_note, refuse_schedule, uniform_policy)
from .layers import ExportError, ModelLayers, model_layers, skip_problem
from .overlap import combined_1f1b, megatron_overlap

__all__ = ["to_megatron", "layout_string", "data_parallel_flags", "model_problem", "refuse_model", "config_flags",
           "connections_note"]

#: The HF tasks whose model Megatron-LM's pretrain_gpt.py trains (a decoder with a causal language-model loss).
_GPT_TASKS = ("causal-lm",)

def data_parallel_flags(plan: Plan) -> list[str]:
    """ZeRO 0: Megatron's DDP (no flag); 1: `--use-distributed-optimizer` (optimizer state and fp32 master weights
    sharded over dp, gradients reduce-scattered once per step). ZeRO 2 and, with pipeline parallelism, ZeRO 3 are
    refused by the trainer's rules (autopp.data.trainers): Megatron-LM shards gradients and parameters only through
    its FSDP paths, and `--use-torch-fsdp2` asserts a pipeline size of 1 (megatron/training/arguments.py). ZeRO 3
    without pipeline parallelism is Megatron-FSDP's `optim_grads_params` strategy, with what Megatron-LM requires
    beside it (`ZeroStage.megatron_with`: `--ckpt-format fsdp_dtensor`, `--use-distributed-optimizer`)."""
    return [*plan.layout.zero.megatron, *plan.layout.zero.megatron_with]


def config_flags(plan: Plan) -> tuple[list[str], list[str]]:
    """What the plan's HF config says beyond the layout (`Plan.hf_config` recorded, `Plan.model_path` its
    config.json): its mixture of experts' architecture (`_expert_flags`), and `--untie-embeddings-and-output-weights`
    where its `tie_word_embeddings` is false: Megatron-LM ties the output layer to the
    embedding unless given it (a store_true flag; its HF loader maps `untie_embeddings_and_output_weights` to `not
    tie_word_embeddings`: megatron/training/arguments.py, NVIDIA/Megatron-LM d98e8a64). A missing key is transformers'
    PretrainedConfig default, tied. (lines, notes): a note where the config cannot be read."""
    if not plan.hf_config or not plan.model_path.endswith(".json"):
        return [], []
    try:
        values = read_hf_config(Path(plan.model_path))
    except ModelFileError as e:
        return [], [f"the plan's HF config could not be read ({e}): give --untie-embeddings-and-output-weights if its "
                    "tie_word_embeddings is false (Megatron-LM ties the output layer to the embedding by default)"]
    config = {**(values.get("text_config") or {}), **values}
    untie = ["--untie-embeddings-and-output-weights"] if config.get("tie_word_embeddings", True) is False else []
    return untie + _expert_flags(config), []


def _expert_flags(config: Mapping[str, Any]) -> list[str]:
    """A mixture of experts' architecture beyond the routing the profile records, as Megatron-Core's arguments
    (megatron/training/arguments.py; a tester's Qwen2-MoE and DeepSeek-V3 exports left their shared experts out):
    the experts' FFN width (`moe_intermediate_size`, where it differs from the dense `intermediate_size`), the
    router's softmax over every expert where the top-k weights are not renormalized (`norm_topk_prob` false, as
    Qwen2-MoE's; Megatron's softmax is over the top-k unless `--moe-router-pre-softmax`), shared
    experts (Qwen2-MoE's gated `shared_expert_intermediate_size`; DeepSeek-V3's `n_shared_experts` of the experts'
    width) and DeepSeek-V3's router (sigmoid scores, the auxiliary-loss-free bias of `topk_method` noaux_tc, and
    `routed_scaling_factor`)."""
    out = []
    width = config.get("moe_intermediate_size")
    if isinstance(width, int) and width != config.get("intermediate_size"):
        out.append(f"--moe-ffn-hidden-size {width}")
    if config.get("norm_topk_prob") is False and config.get("scoring_func", "softmax") == "softmax":
        out.append("--moe-router-pre-softmax")  # Qwen2-MoE: softmax over every expert, the top-k weights kept
    shared = config.get("shared_expert_intermediate_size")
    if isinstance(shared, int) and shared > 0:
        out += [f"--moe-shared-expert-intermediate-size {shared}", "--moe-shared-expert-gate"]
    count = config.get("n_shared_experts")
    if isinstance(count, int) and count > 0 and isinstance(width, int):
        out.append(f"--moe-shared-expert-intermediate-size {count * width}")
    if config.get("scoring_func") == "sigmoid":
        out.append("--moe-router-score-function sigmoid")
    if config.get("topk_method") == "noaux_tc":
        out.append("--moe-router-enable-expert-bias")
    scale = config.get("routed_scaling_factor")
    if isinstance(scale, (int, float)) and scale != 1:
        out.append(f"--moe-router-topk-scaling-factor {scale}")
    return out


def connections_note(plan: Plan) -> str | None:
    """What Megatron-LM's validate_args asks of CUDA_DEVICE_MAX_CONNECTIONS (megatron/training/arguments.py,
    NVIDIA/Megatron-LM d98e8a64): with Megatron-FSDP it asserts the variable is not 1 ("FSDP requires
    CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset"); otherwise, with tp or cp above 1 on a GPU before Blackwell (compute
    capability below 10), it asserts it is 1 unless --overlap-moe-expert-parallel-comm is given (then it warns that
    the overlap wants it larger, and that 1 favours tp and cp: `ep_a2a`), which without tp and cp wants it above 1
    (megatron/core/transformer/moe/README.md, "Requirements for EP A2A Overlap"). None: none applies."""
    if "--use-megatron-fsdp" in data_parallel_flags(plan):
        return ("launch with CUDA_DEVICE_MAX_CONNECTIONS unset or above 1: Megatron-LM asserts it with Megatron-FSDP "
                "(\"FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset\")")
    if combined_1f1b(plan) and (plan.layout.tp > 1 or plan.layout.cp > 1):
        return ("CUDA_DEVICE_MAX_CONNECTIONS: Megatron-LM warns that tp or cp above 1 on GPUs before Blackwell want it "
                "1, and --overlap-moe-expert-parallel-comm wants it larger (it suggests 1 or 32)")
    if combined_1f1b(plan):
        return ("launch with CUDA_DEVICE_MAX_CONNECTIONS unset or above 1: Megatron-Core's MoE README lists it among "
                "the EP A2A overlap's requirements (--overlap-moe-expert-parallel-comm)")
    if plan.layout.tp > 1 or plan.layout.cp > 1:
        return ("launch with CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment: Megatron-LM asserts it with tp or cp "
                "above 1 on GPUs before Blackwell (compute capability below 10)")
    return None


def layout_string(plan: Plan, layers: ModelLayers) -> str:
    """Megatron's layout in stage order (stage k on pp rank k % pp, virtual stage k // pp): `E` the embedding,
    one `t` per block, `L` the output part and loss; `|` between stages. Written out, without `t*N`, so the
    argument survives a shell's word splitting and globbing; unquoted, as the file is read by `$(cat FILE)`, which
    keeps quotes (the export's notes give the quoted form for pasting: `|` is a pipe in a script's own text)."""
    def stage(first: int, end: int) -> str:
        return "".join("E" if u == layers.pre else "L" if u == layers.post else "t" for u in range(first, end))
    return "|".join(stage(*s.units) for s in plan.stages)


def model_problem(unit_names: Sequence[str], task: str | None, values: Sequence[LiveValue] | None) -> str | None:
    """Why pretrain_gpt.py cannot build a model of these units (None: it can): an HF task other than a causal
    language model; units that are not an embedding, numbered blocks and an output part (`model_layers`); layers
    that pass more than the hidden state on (`skip_problem`, from the profile's live values `values`; None: not
    checked). `autopp plan --for megatron` asks it before planning, the export again (a tester's MLP was planned
    for Megatron, then refused by its export)."""
    if task is not None and task not in _GPT_TASKS:
        return (f"Megatron-LM's pretrain_gpt.py trains a GPT decoder with a causal language-model loss, and the "
                f"model is a {task} model (its HF config's task); export to torchtitan or deepspeed, or run it with "
                "autopp run")
    why = None if values is None else skip_problem(values, unit_names)
    if why is not None:
        return (f"Megatron-LM's pretrain_gpt.py builds a GPT whose layers pass one hidden state each to the next, but "
                f"{why}; run it with autopp run, which relays such values")
    try:
        layers = model_layers(unit_names, "the model")
    except ExportError as e:
        return str(e).removeprefix("the model: ")
    if layers.pre is None or layers.post is None:
        return ("Megatron's layout needs an embedding unit before the blocks and an output unit after them (E first, "
                "L last); this model's units start or end with a block")
    return None


def refuse_model(plan: Plan, values: Sequence[LiveValue] | None, where: str) -> None:
    """An ExportError naming `where` when pretrain_gpt.py cannot build the plan's model (`model_problem`)."""
    why = model_problem([n for s in plan.stages for n in s.unit_names], plan.hf_config.get("task"), values)
    if why is not None:
        raise ExportError(f"{where}: {why}")


def _moe_layer_freq(plan: Plan, layers: ModelLayers, moe: Mapping[str, Any]) -> list[str]:
    """`--moe-layer-freq` where the experts are written (`carved_lines`: an MoE model, at any ep) and some blocks are
    dense (DeepSeek-V3's first three: its config's `first_k_dense_replace`): the blocks' pattern, 1 for a block with
    experts, as Megatron-LM's `moe_freq_type` reads a Python list expression ("([0]*3+[1]*58)"); without it
    Megatron-Core makes every layer an MoE layer. `moe["moe_units"]`: each unit's MoE layers (the profile's
    `moe_layers`)."""
    units = moe.get("moe_units")
    if units is None or moe.get("num_experts") is None:
        return []
    pattern = [1 if units[k] else 0 for k in layers.blocks]
    if all(pattern):
        return []
    runs = [(bit, len(list(group))) for bit, group in itertools.groupby(pattern)]
    return ["--moe-layer-freq (" + "+".join(f"[{bit}]*{n}" for bit, n in runs) + ")"]


def to_megatron(plan: Plan, where: str, moe: Mapping[str, Any] | None = None,
                values: Sequence[LiveValue] | None = None) -> Exported:
    """Arguments for `pretrain_gpt.py` (one flag and its value per line, for `$(cat FILE)`); `moe`: the profile's
    routing facts (meta.extra["moe"]), which expert parallelism needs; `values`: the profile's live values, which
    `refuse_model` checks (None: no profile, not checked)."""
    refuse_schedule(plan, "megatron", where)
    refuse_layout(plan, "megatron", where)
    refuse_model(plan, values, where)
    if combined_1f1b(plan) and plan.dtype not in (None, *EP_A2A_DTYPES):
        raise ExportError(f"{where}: the plan hid expert all-to-alls (`overlap` ep_a2a), which Megatron-Core overlaps "
                          f"on a bf16 or fp16 model only, and its model is {plan.dtype}; re-plan a bfloat16 profile, "
                          "or without ep-a2a")
    layers = model_layers([n for s in plan.stages for n in s.unit_names], where)
    layout = layout_string(plan, layers)
    lines = [*group_lines(plan, "megatron", "{key} {degree}"),
             *carved_lines(plan, "megatron", "{key} {degree}", moe or {}, where),
             *_moe_layer_freq(plan, layers, moe or {}),
             *data_parallel_flags(plan),
             *megatron_overlap(plan),
             f"{AXES['pp'].spelling('megatron').degree} {plan.layout.pp}",
             f"--num-layers {len(layers.blocks)}",
             f"--pipeline-model-parallel-layout {layout}",
             f"--micro-batch-size {plan.microbatch_size}",
             f"--global-batch-size {plan.global_batch}"]
    settings, setting_notes = made_for(plan, "megatron")
    from_config, config_notes = config_flags(plan)
    lines += settings + from_config
    connections = connections_note(plan)
    notes = [f"Megatron: launch {plan.num_ranks} ranks (world size {launch_grid(plan, 'megatron')}; "
             "Megatron derives dp from the world size and orders ranks tp, cp, dp, pp from the innermost, as autopp "
             "does)", *([connections] if connections else []), *setting_notes, *config_notes,
             optimizer_note(plan, "megatron"), *axis_notes(plan, "megatron"), *loss_parallel_notes(plan, "megatron")]
    if "|" in layout:
        notes.append(f"the file is for $(cat FILE), where the shell takes the layout's `|` as part of the word; "
                     "pasting the lines into a script instead, quote the layout: --pipeline-model-parallel-layout "
                     f"{shlex.quote(layout)}")
    if values is None:
        notes.append("the model's layer-to-layer values were not checked (no profile of the plan found): "
                     "pretrain_gpt.py's layers pass one hidden state each to the next")
    activations = uniform_policy(plan, "megatron", where)
    if combined_1f1b(plan) and activations.name in trainer_rules("megatron").beside_ep_a2a:
        raise ExportError(f"{where}: the plan hid expert all-to-alls (`overlap` ep_a2a) and recomputes every stage "
                          f"({activations.name.value}), which Megatron-Core refuses together (\"disable full "
                          "recomputation when enabling overlap_moe_expert_parallel_comm\"); re-plan with `autopp plan "
                          "--for megatron`, which plans full recomputation without the overlap")
    lines += activations.megatron
    if activations.trainer_note:
        notes.append(f"Megatron's {' '.join(activations.megatron[:1])}: {activations.trainer_note}")
    if plan.assumed_overlap.ep_a2a and plan.layout.ep > 1 and not combined_1f1b(plan):
        notes.append(f"no --overlap-moe-expert-parallel-comm: the plan's {plan.schedule.value} at v {plan.layout.v} "
                     "was costed with its expert all-to-alls exposed (autopp costs Megatron-Core's EP A2A overlap on "
                     "Interleaved1F1B with v > 1)")
    if plan.layout.v > 1:
        notes.append(f"Megatron runs its own interleaved 1F1B (microbatch groups of pp = {plan.layout.pp}); autopp "
                     "simulated torch's Interleaved1F1B, the same warm-up / steady / cool-down order")
    return Exported("\n".join(lines) + "\n", {}, tuple(notes))
