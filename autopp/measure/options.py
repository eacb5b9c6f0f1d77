"""What a profile is asked for: `ProfileOptions`, shared by measured (autopp.measure.profiler) and analytic
(autopp.measure.analytic) profiles, and `MeasureOptions`, how a measurement times them; the optimizers and parameter
dtypes they know. Shared by the profiler and its co-runner processes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Literal, cast

import torch
from torch import nn

from ..data.precision import Recipe, recipe, recipe_of_dtype

if TYPE_CHECKING:
    from ..data.profile import ProfileMeta

__all__ = ["OPTIMIZER_STATES", "DTYPES", "Optimizer", "DType", "ProfileOptions", "MeasureOptions", "make_optimizer"]

#: Optimizer state kept per parameter, in multiples of the parameter's element count (fp32 states).
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
#: Parameter dtypes that can be profiled; below float32, an fp32 master copy is counted with the optimizer state.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Optimizer = Literal["sgd", "momentum", "adam", "adamw"]
"""A key of OPTIMIZER_STATES."""
DType = Literal["float32", "bfloat16"]
"""A key of DTYPES."""


def _sizes(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted({int(v) for v in values}))


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """What a profile is made for, measured or counted alike: the microbatch sizes, the optimizer and dtype, the
    tensor-parallel degrees. Recorded in the profile's metadata (ProfileMeta)."""

    microbatch_sizes: tuple[int, ...] = (1, 4)
    """Sizes to profile (any iterable is taken, sorted and deduplicated); the cost model interpolates between them."""
    optimizer: Optimizer = "sgd"
    """Whose state is counted per parameter (OPTIMIZER_STATES) and whose step is timed."""
    dtype: DType = "float32"
    """Parameter and activation dtype; bfloat16: mixed precision, the fp32 master copy counted with the optimizer."""
    precision: str | None = None
    """The mixed-precision recipe counted (autopp.data.precision: its times and bytes per parameter); it computes
    in `dtype`. None (filled in): the recipe of `dtype` (fp32 or bf16, `Recipe.implied`)."""
    tp_degrees: tuple[int, ...] | None = ()
    """Tensor-parallel degrees to make tp.csv rows for (1 is dropped; the model needs a TP plan, autopp.model.tp);
    (): none; None: every degree the plan allows, up to the catalog device's devices per node when counted (a plan
    that fails then leaves the rows out, and `extra.tp_skipped` says why) or 8 when measured."""

    def __post_init__(self) -> None:
        sizes = _sizes(self.microbatch_sizes)
        object.__setattr__(self, "microbatch_sizes", sizes)
        if self.tp_degrees is not None:
            object.__setattr__(self, "tp_degrees", _sizes(self.tp_degrees))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"microbatch sizes must be positive integers, got {list(sizes)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.precision is None:
            object.__setattr__(self, "precision", self.recipe.name)  # one spelling: options compare equal
        if self.recipe.dtype != self.dtype:
            raise ValueError(f"precision {self.precision} computes in {self.recipe.dtype}, not {self.dtype}")

    @classmethod
    def recorded(cls, meta: ProfileMeta) -> ProfileOptions:
        """The options a profile was made for, as its metadata records them."""
        return cls(microbatch_sizes=meta.microbatch_sizes, optimizer=cast(Optimizer, meta.optimizer),
                   dtype=cast(DType, meta.dtype), precision=meta.extra.get("precision"), tp_degrees=meta.tp_degrees)

    @property
    def recipe(self) -> Recipe:
        """The recipe counted: `precision`'s, else `dtype`'s."""
        found = recipe(self.precision) if self.precision is not None else recipe_of_dtype(self.dtype)
        if found is None:  # every DTYPES entry has one (tests/measure/test_options.py)
            raise ValueError(f"no precision recipe computes in {self.dtype}")
        return found

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as torch spells it."""
        return DTYPES[self.dtype]


@dataclass(frozen=True, kw_only=True)
class MeasureOptions:
    """How a measured profile times its units (autopp.measure.profiler.profile_model); an analytic profile has
    none of these. Recorded in the profile's metadata where it says how the times were taken."""

    warmup: int = 2
    """Untimed runs before the timed ones."""
    repeats: int = 5
    """Timed runs per unit and phase; the median is kept."""
    time_budget_s: float | None = None
    """Stop timing a unit once this many seconds are spent on it, even before `repeats` runs (at least one)."""
    threads: int = 1
    """torch threads while measuring."""
    device: Literal["cpu", "cuda"] = "cpu"
    """The device measured on."""
    compare_whole: bool = True
    """Also time one whole-model step beside the units' sum (when the whole model fits in `memory_limit_bytes`)."""
    co_runners: int = 0
    """Processes training the model beside every timing (autopp.measure.corun), as the other ranks of a CPU host
    do; they need the whole model."""
    measure_every_unit: bool = False
    """Measure also the units of the same structure and input shapes as an earlier one (else: shared from it)."""
    memory_limit_bytes: int | None = None
    """Materialize the whole model only when its parameters and gradients fit in this; None: a quarter of physical
    memory, or of the GPU's when it is smaller (autopp.measure.profiler.default_memory_limit)."""
    clock: Callable[[], float] | None = None
    """Where every time (and the time budget) is read (an autopp.measure.timing.Clock); None: time.perf_counter on
    CPU, CUDA events on a GPU. Tests inject a fake clock to get exact times."""

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repeats < 1 or self.threads < 1:
            raise ValueError(f"warmup must be >= 0 ({self.warmup}), repeats >= 1 ({self.repeats}) and threads >= 1 "
                             f"({self.threads})")
        if self.time_budget_s is not None and not (math.isfinite(self.time_budget_s) and self.time_budget_s > 0):
            raise ValueError(f"time_budget_s must be a positive number of seconds, got {self.time_budget_s}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.co_runners < 0:
            raise ValueError(f"co_runners must be >= 0, got {self.co_runners}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 0:
            raise ValueError(f"memory_limit_bytes must be >= 0, got {self.memory_limit_bytes}")


def make_optimizer(name: str, params: list[nn.Parameter], lr: float = 1e-3) -> torch.optim.Optimizer:
    """The torch optimizer that OPTIMIZER_STATES[`name`] describes, over `params` (the profiler's and the runner's).
    """
    if name not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZER_STATES)}")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=lr)
