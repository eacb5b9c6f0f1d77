"""Megatron-LM command-line arguments: pipeline sizes, `--pipeline-model-parallel-layout`, batch and recompute."""

from __future__ import annotations

from typing import Any, Mapping

from ..data.axes import AXES
from ..data.plan import Plan
from .common import (Exported, axis_notes, carved_lines, group_lines, launch_grid, refuse_layout, refuse_schedule,
                     uniform_policy)
from .layers import ExportError, ModelLayers, model_layers

__all__ = ["to_megatron", "layout_string", "data_parallel_flags"]

def data_parallel_flags(plan: Plan) -> list[str]:
    """ZeRO 0: Megatron's DDP (no flag); 1: `--use-distributed-optimizer` (optimizer state and fp32 master weights
    sharded over dp, gradients reduce-scattered once per step). ZeRO 2 and, with pipeline parallelism, ZeRO 3 are
    refused by the trainer's rules (autopp.data.trainers): Megatron-LM shards gradients and parameters only through
    its FSDP paths, and `--use-torch-fsdp2` asserts a pipeline size of 1 (megatron/training/arguments.py). ZeRO 3
    without pipeline parallelism is Megatron-FSDP's `optim_grads_params` strategy."""
    return list(plan.layout.zero.megatron)


def layout_string(plan: Plan, layers: ModelLayers) -> str:
    """Megatron's layout in stage order (stage k on pp rank k % pp, virtual stage k // pp): `E` the embedding,
    one `t` per block, `L` the output part and loss; `|` between stages. Written out, without `t*N`, so the
    argument survives a shell's word splitting and globbing."""
    def stage(first: int, end: int) -> str:
        return "".join("E" if u == layers.pre else "L" if u == layers.post else "t" for u in range(first, end))
    return "|".join(stage(*s.units) for s in plan.stages)


def to_megatron(plan: Plan, where: str, moe: Mapping[str, Any] | None = None) -> Exported:
    """Arguments for `pretrain_gpt.py` (one flag and its value per line, for `$(cat FILE)`); `moe`: the profile's
    routing facts (meta.extra["moe"]), which expert parallelism needs."""
    refuse_schedule(plan, "megatron", where)
    refuse_layout(plan, "megatron", where)
    layers = model_layers([n for s in plan.stages for n in s.unit_names], where)
    if layers.pre is None or layers.post is None:
        raise ExportError(f"{where}: Megatron's layout needs an embedding unit before the blocks and an output unit "
                          "after them (E first, L last); this model's units start or end with a block")
    lines = [*group_lines(plan, "megatron", "{key} {degree}"),
             *carved_lines(plan, "megatron", "{key} {degree}", moe or {}, where),
             *data_parallel_flags(plan),
             f"{AXES['pp'].spelling('megatron').degree} {plan.layout.pp}",
             f"--num-layers {len(layers.blocks)}",
             f"--pipeline-model-parallel-layout {layout_string(plan, layers)}",
             f"--micro-batch-size {plan.microbatch_size}",
             f"--global-batch-size {plan.global_batch}"]
    notes = [f"Megatron: launch {plan.num_ranks} ranks (world size {launch_grid(plan, 'megatron')}; "
             "Megatron derives dp from the world size and orders ranks tp, dp, pp from the innermost, as autopp "
             "does)", *axis_notes(plan, "megatron")]
    activations = uniform_policy(plan, "megatron", where)
    lines += activations.megatron
    if activations.trainer_note:
        notes.append(f"Megatron's {' '.join(activations.megatron[:1])}: {activations.trainer_note}")
    if plan.layout.v > 1:
        notes.append(f"Megatron runs its own interleaved 1F1B (microbatch groups of pp = {plan.layout.pp}); autopp "
                     "simulated torch's Interleaved1F1B, the same warm-up / steady / cool-down order")
    return Exported("\n".join(lines) + "\n", {}, tuple(notes))
