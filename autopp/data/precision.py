"""Mixed-precision recipes as descriptors: what dtype a profile is made in, which peak each kind of op runs at, the
bytes per parameter of weights, gradients, master copy and optimizer state, and how each trainer spells the recipe.

The byte layouts are the trainers' own. Megatron-LM's distributed optimizer guide (docs/source/api-guide/
dist_optimizer.md, "bf16 param, fp32 grads": 18 bytes per parameter with Adam, 6 + 12/d with the optimizer split
over d replicas): bf16 weights (2), fp32 gradients (4: its `--bf16` turns `accumulate_allreduce_grads_in_fp32` on),
an fp32 master copy (4) and Adam's two fp32 moments (8). torchtitan's FSDP2 `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)` keeps the same per parameter: the fp32 sharded parameter is the master copy, the bf16 gathered
copy is what the layers compute with, gradients are reduced and kept in fp32. FP8 training (torchtitan's
Float8LinearConverter, torchao's float8 rowwise/tensorwise recipes; Megatron-Core's `--fp8-format hybrid` with
Transformer Engine, Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433) runs only the
matmuls of linear layers in FP8, casting their operands with a per-tensor (or per-row) scale; weights, gradients,
master copy and optimizer state stay as in bf16, as do attention, norms and activations. Under expert parallelism
the fp8 recipe dispatches the routed tokens in FP8, as DeepSeek-V3 trains (arXiv:2412.19437v2 s.3.3.4: the
activations before the MoE up-projections are quantized to FP8 and dispatched so, as are the activation gradients
before the down-projections in the backward; the combines stay in BF16), with one fp32 scale per 128 elements (its
1 x 128 tile-wise activation scales, s.3.3.1; DeepEP's FP8 dispatch sends the values and those scales): 1 + 4 / 128
bytes per element (`Recipe.dispatch_bytes`). Every other module reads a recipe's properties from its descriptor
here; the recipe name appears only at the JSON and command-line boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ProfileError

if TYPE_CHECKING:
    from .catalog import DeviceSpec

__all__ = ["Recipe", "RECIPES", "DEFAULT_RECIPE", "recipe", "recipe_of_dtype", "plan_recipe", "KERNELS",
           "recorded_kernels", "counted_kernels"]

#: The elementwise kernels an analytic profile counts (autopp.measure.fusion; `extra.analytic.kernels`, a plan's
#: `kernels`): as eager PyTorch runs them, each op its own kernel, or chains of them fused into one.
KERNELS = ("eager", "fused")


def recorded_kernels(extra: dict[str, Any]) -> str | None:
    """The elementwise kernels a profile's `meta.extra` records (`extra.analytic.kernels`); None where it records
    none: a measured profile (the kernels that ran) or an analytic one counted before the choice (eager)."""
    kernels = (extra.get("analytic") or {}).get("kernels")
    return None if kernels is None else str(kernels)


def counted_kernels(extra: dict[str, Any]) -> str | None:
    """The elementwise kernels a profile's times count: `recorded_kernels`, "eager" for an analytic profile counted
    before the choice (which counted eager), None for a measured one (the kernels that ran)."""
    return recorded_kernels(extra) or ("eager" if "analytic" in extra else None)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One mixed-precision recipe: what it computes in, what it keeps per parameter, and each trainer's spelling."""

    name: str
    """Its name: `--precision`, a profile's `extra.precision` and a plan's `precision`."""
    what: str
    """The recipe in words, for messages and notes."""
    dtype: str
    """The dtype the model's parameters and activations are profiled in (a profile's `dtype`)."""
    peak: str
    """The device catalog's `peak_flops` key that every counted op runs at (autopp.data.catalog)."""
    matmul_peak: str
    """The catalog key the matmuls of linear layers run at (`peak` but for FP8: "float8")."""
    weight_bytes: int
    """Bytes per parameter of the weights the layers compute with (the model in `dtype`)."""
    grad_bytes: int
    """Bytes per parameter of the gradients kept and reduced (fp32 under bf16: Megatron's main_grad buffer)."""
    master_bytes: int
    """Bytes per parameter of the fp32 master copy the optimizer updates (0: the weights are the master)."""
    state_bytes: int = 4
    """Bytes of each optimizer state per parameter (fp32: Adam's moments; 2 in pure bf16)."""
    activations: str
    """What is saved for the backward, in words (as the trainers save it)."""
    dispatch_bytes: float | None = None
    """Bytes per element of the routed tokens an expert-parallel dispatch sends, and of the activation gradients
    the backward's all-to-all sends toward the experts (None: the activations' own, `weight_bytes`, as every
    combine sends them); module docstring."""
    torchtitan: tuple[str, ...]
    """torchtitan's overrides (torchtitan/config/configs.py: `training.dtype` is the master weights' and the
    optimizer's, `mixed_precision_param` the compute's under its FSDP wrapping, `mixed_precision_reduce` the gradient
    reduction's)."""
    torchtitan_note: str | None = None
    """What torchtitan sets outside its command line for this recipe (None: nothing)."""
    megatron: tuple[str, ...]
    """Megatron-LM's arguments (megatron/training/arguments.py)."""
    deepspeed: dict[str, object] = field(default_factory=dict, compare=False, hash=False)
    """DeepSpeed config keys (`bf16.enabled`: bf16 with fp32 master weights in its optimizer)."""
    trainer_refusals: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Trainer ("torchtitan", "megatron", "deepspeed") -> why it cannot train with this recipe."""
    implied: bool = True
    """Whether a profile in `dtype` that records no recipe (one counted before the recipes) was counted in this one:
    fp32 and bf16, the dtypes' own; the others are recorded by name always."""

    def bytes_per_param(self, optimizer_states: int) -> int:
        """Weights, gradients, master copy and `optimizer_states` states, per parameter (bf16 with Adam: 18, pure bf16:
        8)."""
        return self.weight_bytes + self.grad_bytes + self.master_bytes + optimizer_states * self.state_bytes

    def refusal(self, trainer: str) -> str | None:
        """Why `trainer` cannot train with this recipe (None: it can)."""
        return self.trainer_refusals.get(trainer)

    def step_bytes(self, optimizer_states: int) -> int:
        """Bytes the optimizer step moves per parameter: gradients scaled (read + write), then read once; the master
        copy (else the weights) and each state read and written; with a master copy, the weights written from it
        (fp32 with Adam: 36, bf16 with Adam: 38, pure bf16: 18)."""
        updated = self.master_bytes or self.weight_bytes
        return 3 * self.grad_bytes + 2 * updated + 2 * optimizer_states * self.state_bytes + \
            (self.weight_bytes if self.master_bytes else 0)

    def peaks(self, spec: DeviceSpec) -> tuple[float, float]:
        """`spec`'s dense peak FLOP/s for every op and for the linear layers' matmuls; a ProfileError naming the
        device when its catalog entry has no peak for one of them (no FP8 on an A100)."""
        missing = [k for k in (self.peak, self.matmul_peak) if k not in spec.peak_flops]
        if missing:
            raise ProfileError(f"precision {self.name} needs a {missing[0]} peak, which device {spec.name} does not "
                               f"have (its catalog entry lists {', '.join(sorted(spec.peak_flops))}); give "
                               f"`precision` {'bf16' if self.name == 'fp8' else 'fp32'}")
        return spec.peak(self.peak), spec.peak(self.matmul_peak)

    def dispatch_scale(self) -> float:
        """Bytes a dispatch sends per byte of the activations it dispatches (1: as they are; fp8: 0.52)."""
        return 1.0 if self.dispatch_bytes is None else self.dispatch_bytes / self.weight_bytes

    def __str__(self) -> str:
        return self.name


_BF16_TITAN = ("--training.dtype=float32", "--training.mixed_precision_param=bfloat16",
               "--training.mixed_precision_reduce=float32")
_BF16_SAVED = "bf16, as the layers compute them"
#: What a trainer's refusal of a recipe says to do: the recipe is the profile's, fixed when it is counted (a tester
#: told to "re-plan with --precision bf16" was then told that --precision goes only with a profile plan makes).
_AGAIN = "count the profile again with `precision` bf16 (the recipe is the profile's), then re-plan"

#: Every recipe by name.
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe(name="fp32", what="float32 throughout", dtype="float32", peak="float32", matmul_peak="float32",
           weight_bytes=4, grad_bytes=4, master_bytes=0, activations="fp32",
           torchtitan=("--training.dtype=float32", "--training.mixed_precision_param=float32"), megatron=()),
    Recipe(name="bf16", what="bf16 mixed precision (bf16 compute, fp32 master weights, gradients and optimizer "
                             "state)", dtype="bfloat16", peak="bfloat16", matmul_peak="bfloat16",
           weight_bytes=2, grad_bytes=4, master_bytes=4, activations=_BF16_SAVED, torchtitan=_BF16_TITAN,
           megatron=("--bf16",), deepspeed={"bf16": {"enabled": True}}),
    Recipe(name="fp8", what="FP8 matmuls in linear layers, the rest as bf16 mixed precision", dtype="bfloat16",
           peak="bfloat16", matmul_peak="float8", weight_bytes=2, grad_bytes=4, master_bytes=4,
           activations=f"{_BF16_SAVED}, as torchao's Float8Linear saves the bf16 input and weight and casts them "
                       "again in the backward (Transformer Engine may keep a linear input's FP8 cast instead, smaller: "
                       "not modelled)",
           dispatch_bytes=1 + 4 / 128, torchtitan=_BF16_TITAN, implied=False,
           torchtitan_note="torchtitan 0.3 sets FP8 in Python, not on its command line: give the model spec "
                           "`converters=[Float8LinearConverter.Config(recipe_name=\"rowwise\")]` "
                           "(torchtitan/models/llama3/config_registry.py, llama3_debugmodel_float8)",
           megatron=("--bf16", "--fp8-format hybrid", "--fp8-recipe tensorwise"),
           trainer_refusals={"deepspeed": "DeepSpeed's config has no FP8 training (only its `bf16` and `fp16` "
                                          "sections; FP8 needs Transformer Engine layers in the model code); "
                                          f"{_AGAIN}"}),
    Recipe(name="bf16-pure", what="pure bf16 (bf16 weights, gradients and optimizer state, no fp32 master copy: "
                                  "updates below bf16's resolution of the weight are lost)",
           dtype="bfloat16", peak="bfloat16", matmul_peak="bfloat16", weight_bytes=2, grad_bytes=2, master_bytes=0,
           state_bytes=2, activations=_BF16_SAVED, implied=False,
           torchtitan=("--training.dtype=bfloat16", "--training.mixed_precision_param=bfloat16"), megatron=(),
           trainer_refusals={
               "megatron": "Megatron-LM keeps a master copy beside bf16 weights (its --main-params-dtype takes fp32 "
                           "or fp16 only, megatron/training/arguments.py); "
                           f"{_AGAIN}",
               "deepspeed": "DeepSpeed keeps a master copy beside bf16 weights (its bf16_master_weights_and_grads "
                            "clones the partition in bf16, runtime/zero/stage_1_and_2.py); "
                            f"{_AGAIN}"}),
)}
#: The recipe of a GPU profile when none is asked for.
DEFAULT_RECIPE = RECIPES["bf16"]


def recipe(name: str) -> Recipe:
    """The recipe `name`; a ProfileError naming the recipes that exist otherwise."""
    if name not in RECIPES:
        raise ProfileError(f"precision {name!r} does not exist; give one of {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_of_dtype(dtype: str) -> Recipe | None:
    """The recipe a profile made in `dtype` without a recorded recipe was counted for: fp32 or bf16 (None: a dtype
    no recipe has)."""
    return next((r for r in RECIPES.values() if r.dtype == dtype and r.implied), None)


def plan_recipe(precision: str | None, dtype: str | None) -> Recipe | None:
    """The recipe a plan records (`precision`), else the one of its profile's `dtype`; None when it knows neither
    (older plans, plans of the Python API) or the dtype has no recipe."""
    return RECIPES.get(precision) if precision is not None else recipe_of_dtype(dtype or "")
