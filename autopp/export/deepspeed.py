"""DeepSpeed: the JSON config (batch, gradient accumulation = microbatches, ZeRO stage 0 or 1) and the PipelineModule
stage boundaries with the lines that apply them."""

from __future__ import annotations

import json

from ..data.axes import AXES
from ..data.plan import Plan
from ..data.precision import plan_recipe
from ..schedule import ActivationPolicy
from .common import (Exported, kernels_for, launch_grid, optimizer_note, outputs_notes, refuse_layout,
                     refuse_schedule, uniform_policy)
from .overlap import deepspeed_overlap

__all__ = ["to_deepspeed", "deepspeed_config", "grad_accum", "pipe_snippet"]


def deepspeed_config(plan: Plan) -> dict[str, object]:
    """DeepSpeed's config keys: a pipeline step runs `gradient_accumulation_steps` microbatches per replica; the
    plan's ZeRO stage (0 or 1: to_deepspeed refuses others); the plan's precision recipe (`bf16`) and where its
    gradients are accumulated (`grad_accum`)."""
    recipe = plan_recipe(plan.precision, plan.dtype)
    return {"train_batch_size": plan.global_batch,
            "train_micro_batch_size_per_gpu": plan.microbatch_size,
            "gradient_accumulation_steps": plan.num_microbatches,
            "zero_optimization": {"stage": plan.layout.zero.stage},
            **(recipe.deepspeed if recipe is not None else {}), **grad_accum(plan)}


def grad_accum(plan: Plan) -> dict[str, object]:
    """`data_types.grad_accum_dtype` fp32 where the plan's recipe keeps gradients wider than its weights (bf16: fp32
    gradients, `Recipe.grad_bytes`) under ZeRO 1. DeepSpeed 0.19 (runtime/engine.py, `get_data_types` and
    `_do_optimizer_sanity_check`) accumulates in the weights' dtype unless the key says otherwise: under ZeRO 1 bf16
    weights with fp32 accumulation select its BF16_Optimizer, which adds each microbatch's gradient into fp32
    (bf16_optimizer.py, `_update_hp_grad`), and without the key its ZeRO optimizer keeps them in bf16. At ZeRO 0 the
    key is left out: there the PipelineEngine runs the BF16_Optimizer for bf16 anyway, and bf16 weights with fp32
    accumulation raise NotImplementedError ("unsupported mix of model_dtype and grad_accum_dtype")."""
    recipe = plan_recipe(plan.precision, plan.dtype)
    wider = recipe is not None and recipe.grad_bytes > recipe.weight_bytes
    return {"data_types": {"grad_accum_dtype": "fp32"}} if wider and plan.layout.zero.shards_optimizer else {}


def pipe_snippet(plan: Plan, activations: ActivationPolicy) -> str:
    """Python that builds a PipelineModule whose stage s holds layers parts[s]:parts[s + 1] of the user's list (one
    layer per autopp unit). DeepSpeed's partition methods (uniform, parameters, type:) cannot take explicit bounds,
    so `_partition_layers` is overridden to set them; it is private DeepSpeed API, checked by autopp's tests. Its
    docstring says what each unit holds (a unit is named by its first module: the last one, `model.norm` of an HF
    decoder, holds the final norm and lm_head too)."""
    parts = [s.units[0] for s in plan.stages] + [plan.stages[-1].units[1]]
    names = [list(s.unit_names) for s in plan.stages]
    stages, last = AXES["pp"].spelling("deepspeed").degree, plan.stages[-1].unit_names[-1]
    return f'''"""Stage boundaries chosen by autopp for {plan.model_path} (pp {plan.layout.pp}, dp {plan.layout.dp})."""
from deepspeed.pipe import PipelineModule

PARTS = {parts}
"""Stage s holds layers PARTS[s]:PARTS[s + 1] of the layer list: one layer per autopp unit, in this order, each unit
named by its first module and holding the modules up to the next unit's; the last, {last!r}, holds every module
after the previous one, the output layer included, and the loss autopp timed with it is loss_fn, which DeepSpeed
runs on the last stage after that layer:
{names}"""


class AutoppPipelineModule(PipelineModule):
    def _partition_layers(self, method="uniform"):
        if len(self._layer_specs) != PARTS[-1]:
            raise ValueError(f"autopp planned {{PARTS[-1]}} layers (one per unit), got {{len(self._layer_specs)}}")
        self.parts = list(PARTS)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def pipeline_module(layers, loss_fn, **kwargs):
    return AutoppPipelineModule(layers=layers, {stages}={plan.layout.pp}, loss_fn=loss_fn,
                                activation_checkpoint_interval={activations.deepspeed_interval}, **kwargs)
'''


def to_deepspeed(plan: Plan, snippet_path: str, where: str) -> Exported:
    """The JSON config, and `snippet_path`'s Python beside it."""
    refuse_schedule(plan, "deepspeed", where)
    refuse_layout(plan, "deepspeed", where)
    activations = uniform_policy(plan, "deepspeed", where)
    notes = [f"DeepSpeed: launch {plan.num_ranks} ranks ({launch_grid(plan, 'deepspeed')}); build the model with "
             f"pipeline_module() from {snippet_path}", optimizer_note(plan, "deepspeed"), *deepspeed_overlap(plan),
             *kernels_for(plan, "deepspeed")[1], *outputs_notes(plan, "deepspeed"),
             "DeepSpeed hands each layer what the previous one returned: a value a unit reads from a unit further "
             "back than the one before it (a skip connection) must be returned by the layers in between"]
    return Exported(json.dumps(deepspeed_config(plan), indent=2) + "\n",
                    {snippet_path: pipe_snippet(plan, activations)}, tuple(notes))
