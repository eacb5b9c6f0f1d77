"""DeepSpeed: the JSON config (batch, gradient accumulation = microbatches, ZeRO stage 0 or 1) and the PipelineModule
stage boundaries with the lines that apply them."""

from __future__ import annotations

import json

from ..data.plan import Plan
from ..schedule import ActivationPolicy, ScheduleName
from .common import Exported, refuse_schedule, refuse_zero, uniform_policy
from .layers import ExportError

__all__ = ["to_deepspeed", "deepspeed_config", "pipe_snippet"]


def deepspeed_config(plan: Plan) -> dict[str, object]:
    """DeepSpeed's config keys: a pipeline step runs `gradient_accumulation_steps` microbatches per replica; the
    plan's ZeRO stage (0 or 1: to_deepspeed refuses others)."""
    return {"train_batch_size": plan.global_batch,
            "train_micro_batch_size_per_gpu": plan.microbatch_size,
            "gradient_accumulation_steps": plan.num_microbatches,
            "zero_optimization": {"stage": plan.layout.zero.stage}}


def pipe_snippet(plan: Plan, activations: ActivationPolicy) -> str:
    """Python that builds a PipelineModule whose stage s holds layers parts[s]:parts[s + 1] of the user's list (one
    layer per autopp unit). DeepSpeed's partition methods (uniform, parameters, type:) cannot take explicit bounds,
    so `_partition_layers` is overridden to set them; it is private DeepSpeed API, checked by autopp's tests."""
    parts = [s.units[0] for s in plan.stages] + [plan.stages[-1].units[1]]
    names = [list(s.unit_names) for s in plan.stages]
    return f'''"""Stage boundaries chosen by autopp for {plan.model_path} (pp {plan.layout.pp}, dp {plan.layout.dp})."""
from deepspeed.pipe import PipelineModule

PARTS = {parts}
"""Stage s holds layers PARTS[s]:PARTS[s + 1] of the layer list: one layer per autopp unit, in this order:
{names}"""


class AutoppPipelineModule(PipelineModule):
    def _partition_layers(self, method="uniform"):
        if len(self._layer_specs) != PARTS[-1]:
            raise ValueError(f"autopp planned {{PARTS[-1]}} layers (one per unit), got {{len(self._layer_specs)}}")
        self.parts = list(PARTS)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def pipeline_module(layers, loss_fn, **kwargs):
    return AutoppPipelineModule(layers=layers, num_stages={plan.layout.pp}, loss_fn=loss_fn,
                                activation_checkpoint_interval={activations.deepspeed_interval}, **kwargs)
'''


def to_deepspeed(plan: Plan, snippet_path: str, where: str) -> Exported:
    """The JSON config, and `snippet_path`'s Python beside it."""
    if plan.schedule is not ScheduleName.ONE_F_ONE_B or plan.layout.v != 1:
        refuse_schedule(plan, "DeepSpeed's PipelineEngine", "1F1B (its own TrainSchedule, one stage per rank)", where)
    if plan.layout.tp > 1:
        raise ExportError(f"{where}: tp {plan.layout.tp}: DeepSpeed's PipelineModule does not shard layers (tensor "
                          "parallelism comes from the model's own layers, as in Megatron-DeepSpeed) and the exported "
                          "stage file builds none; re-plan with `tp` 1, or export to torchtitan or megatron")
    refuse_zero(plan, "deepspeed", where)
    activations = uniform_policy(plan, "DeepSpeed", where)
    if activations.deepspeed_interval is None:
        raise ExportError(f"{where}: activation policy {activations.name.value}: {activations.deepspeed_refusal}; "
                          "re-plan with `activations` keep or recompute, or export to torchtitan or megatron")
    layout = plan.layout
    notes = [f"DeepSpeed: launch {plan.num_ranks} ranks (pp {layout.pp} x dp {layout.dp}); build the model with "
             f"pipeline_module() from {snippet_path}"]
    return Exported(json.dumps(deepspeed_config(plan), indent=2) + "\n",
                    {snippet_path: pipe_snippet(plan, activations)}, tuple(notes))
