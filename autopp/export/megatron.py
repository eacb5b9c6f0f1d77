"""Megatron-LM command-line arguments: pipeline sizes, `--pipeline-model-parallel-layout`, batch and recompute."""

from __future__ import annotations

from ..data.axes import AXES
from ..data.plan import Plan
from ..schedule import StagePlacement, ScheduleName
from .common import (Exported, axis_notes, group_lines, launch_grid, refuse_axes, refuse_schedule, refuse_zero,
                     stage_placement, uniform_policy)
from .layers import ExportError, ModelLayers, model_layers

__all__ = ["to_megatron", "layout_string", "interleaving_problem", "data_parallel_flags"]

#: Schedules Megatron-Core runs: 1F1B without virtual stages, its interleaved 1F1B with them.
_RUNS = "1F1B or Interleaved1F1B"


def interleaving_problem(pp: int, microbatches: int) -> str | None:
    """Why Megatron-Core's interleaved 1F1B refuses `microbatches` on `pp` ranks, or None. It runs microbatches in
    groups of `microbatch_group_size_per_vp_stage` (default pp: model_parallel_config.py) and requires
    pp <= group <= M and M % group to be 0 or >= pp (schedules.py, forward_backward_pipelining_with_interleaving);
    with the default group that is M a multiple of pp."""
    if microbatches % pp:
        return (f"Megatron-Core's interleaved 1F1B runs microbatches in groups of pp ({pp}) and needs their count "
                f"to be a multiple of it, but it is {microbatches}; re-plan with --microbatches "
                f"{pp * max(1, round(microbatches / pp))} (or another multiple of {pp})")
    return None


def data_parallel_flags(plan: Plan, where: str) -> list[str]:
    """ZeRO 0: Megatron's DDP (no flag); 1: `--use-distributed-optimizer` (optimizer state and fp32 master weights
    sharded over dp, gradients reduce-scattered once per step). ZeRO 2 and, with pipeline parallelism, ZeRO 3 are
    refused: Megatron-LM shards gradients and parameters only through its FSDP paths, and `--use-torch-fsdp2`
    asserts a pipeline size of 1 (megatron/training/arguments.py). ZeRO 3 without pipeline parallelism is
    Megatron-FSDP's `optim_grads_params` strategy."""
    zero, pp = plan.layout.zero, plan.layout.pp
    refuse_zero(plan, "megatron", where)
    if zero.gathers_each_forward and pp > 1:
        raise ExportError(f"{where}: zero {zero.stage} with pp {pp}: Megatron-LM shards parameters only through FSDP, "
                          "which it does not run beside pipeline parallelism (--use-torch-fsdp2 asserts a pipeline "
                          "size of 1); re-plan with `zero` 1")
    return list(zero.megatron)


def layout_string(plan: Plan, layers: ModelLayers) -> str:
    """Megatron's layout in stage order (stage k on pp rank k % pp, virtual stage k // pp): `E` the embedding,
    one `t` per block, `L` the output part and loss; `|` between stages. Written out, without `t*N`, so the
    argument survives a shell's word splitting and globbing."""
    def stage(first: int, end: int) -> str:
        return "".join("E" if u == layers.pre else "L" if u == layers.post else "t" for u in range(first, end))
    return "|".join(stage(*s.units) for s in plan.stages)


def to_megatron(plan: Plan, where: str) -> Exported:
    """Arguments for `pretrain_gpt.py` (one flag and its value per line, for `$(cat FILE)`)."""
    if plan.schedule not in (ScheduleName.ONE_F_ONE_B, ScheduleName.INTERLEAVED_1F1B):
        refuse_schedule(plan, "Megatron-Core", _RUNS, where)
    if stage_placement(plan) is not StagePlacement.LOOP:
        refuse_schedule(plan, "Megatron-Core", _RUNS, where)
    if plan.layout.v > 1 and (problem := interleaving_problem(plan.layout.pp, plan.num_microbatches)):
        raise ExportError(f"{where}: {problem}")
    layers = model_layers([n for s in plan.stages for n in s.unit_names], where)
    if layers.pre is None or layers.post is None:
        raise ExportError(f"{where}: Megatron's layout needs an embedding unit before the blocks and an output unit "
                          "after them (E first, L last); this model's units start or end with a block")
    refuse_axes(plan, "megatron", where)
    lines = [*group_lines(plan, "megatron", "{key} {degree}"),
             *data_parallel_flags(plan, where),
             f"{AXES['pp'].spelling('megatron').degree} {plan.layout.pp}",
             f"--num-layers {len(layers.blocks)}",
             f"--pipeline-model-parallel-layout {layout_string(plan, layers)}",
             f"--micro-batch-size {plan.microbatch_size}",
             f"--global-batch-size {plan.global_batch}"]
    notes = [f"Megatron: launch {plan.num_ranks} ranks (world size {launch_grid(plan, 'megatron')}; "
             "Megatron derives dp from the world size and orders ranks tp, dp, pp from the innermost, as autopp "
             "does)", *axis_notes(plan, "megatron")]
    activations = uniform_policy(plan, "Megatron-Core", where)
    lines += activations.megatron
    if activations.trainer_note:
        notes.append(f"Megatron's {' '.join(activations.megatron[:1])}: {activations.trainer_note}")
    if plan.layout.v > 1:
        notes.append(f"Megatron runs its own interleaved 1F1B (microbatch groups of pp = {plan.layout.pp}); autopp "
                     "simulated torch's Interleaved1F1B, the same warm-up / steady / cool-down order")
    return Exported("\n".join(lines) + "\n", {}, tuple(notes))
