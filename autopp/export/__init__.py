"""Plans written for the trainers people run: torchtitan, Megatron-LM, DeepSpeed, torch's schedule CSV. No torch."""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..jsonio import write_text
from ..data.plan import Plan
from ..data.profile_values import LiveValue
from .common import Exported
from .layers import ExportError, ModelLayers, model_layers
from .torchtitan import check_renames, rename_modules
from .pin import config_degrees, config_kernels, config_seq_len, config_trainer, read_pinned
from .pin_fields import read_config_text

if TYPE_CHECKING:
    from ..data.profile import Profile

__all__ = ["Target", "ExportError", "Exported", "ModelLayers", "model_layers", "export_plan", "write_export",
           "default_output", "check_renames", "rename_modules", "read_pinned", "read_config_text", "config_degrees",
           "config_seq_len", "config_trainer", "config_kernels", "trainer_model_problem"]


class Target(enum.Enum):
    """Trainers a plan can be written for."""

    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"
    DEEPSPEED = "deepspeed"
    TORCH_CSV = "torch-csv"


_SUFFIX = {Target.TORCHTITAN: ".torchtitan.args", Target.MEGATRON: ".megatron.args",
           Target.DEEPSPEED: ".deepspeed.json", Target.TORCH_CSV: ".schedule.csv"}


def default_output(plan_path: str | Path, target: Target) -> Path:
    """PLAN.json -> PLAN.torchtitan.args, PLAN.megatron.args, PLAN.deepspeed.json, PLAN.schedule.csv."""
    p = Path(plan_path)
    stem = p.name[:-len(".plan.json")] if p.name.endswith(".plan.json") else p.stem
    return p.with_name(stem + _SUFFIX[target])


def _module_name(stem: str) -> str:
    """`STEM_deepspeed_pipe`, an importable Python module name: other characters become `_`, a leading digit gets
    one before it (`my-model` -> `my_model_deepspeed_pipe`)."""
    name = re.sub(r"\W", "_", stem, flags=re.ASCII) + "_deepspeed_pipe"
    return name if name.isidentifier() and not name[0].isdigit() else "_" + name


def export_plan(plan: Plan, target: Target, out: str | Path,
                unit_modules: Sequence[Sequence[str]] | None = None, where: str = "plan",
                moe: Mapping[str, Any] | None = None, values: Sequence[LiveValue] | None = None,
                renames: Sequence[tuple[str, str]] = ()) -> Exported:
    """The files of `plan` for `target` (not written); `out`: the main file's path, which names the files beside
    it (torchtitan's schedule CSV is named relative to it). `unit_modules`: each unit's module names (the
    profile's; torchtitan needs them), `renames`: (OLD, NEW) prefixes applied to them on top of torchtitan's own
    mapping of HF names (`rename_modules`, `trainer_names`). `moe`: the profile's routing facts
    (`meta.extra["moe"]`; Megatron's expert parallelism needs them). `values`: the profile's live values
    (Megatron's GPT checks that layers pass one hidden state; None: not checked). An ExportError (one line, naming
    `where` and why) for what the trainer cannot express."""
    from .deepspeed import to_deepspeed
    from .megatron import to_megatron
    from .torchcsv import to_torch_csv
    from .torchtitan import to_torchtitan
    base = Path(out)
    if unit_modules is not None and plan.stages[-1].units[1] != len(unit_modules):  # a tester's IndexError
        raise ExportError(f"{where}: the stages end at unit {plan.stages[-1].units[1] - 1}, and the profile has "
                          f"{len(unit_modules)} units: the plan was edited by hand or made from another profile; "
                          "re-plan from this one")
    if target is Target.TORCHTITAN:
        if unit_modules is None:
            raise ExportError(f"{where}: torchtitan needs each unit's module names: give --profile DIR (the profile "
                              "the plan was made from)")
        return to_torchtitan(plan, unit_modules, base.with_suffix(".csv"), where, moe, renames)
    if target is Target.MEGATRON:
        return to_megatron(plan, where, moe, values)
    if target is Target.DEEPSPEED:
        return to_deepspeed(plan, str(base.with_name(_module_name(base.name.split(".")[0]) + ".py")), where)
    return to_torch_csv(plan, where)


def trainer_model_problem(trainer: str, profile: Profile) -> str | None:
    """Why `trainer`'s export would refuse any plan of `profile`'s model (None: it would not): Megatron-LM's
    pretrain_gpt.py builds an embedding, numbered blocks and an output part of a causal LM (`model_problem`);
    torchtitan and DeepSpeed take the units as they are."""
    from .megatron import model_problem
    if trainer != Target.MEGATRON.value:
        return None
    return model_problem(profile.meta.unit_names, (profile.meta.extra.get("hf_config") or {}).get("task"),
                         profile.meta.live_values)


def write_export(exported: Exported, out: str | Path) -> list[Path]:
    """Write the main file and the files beside it (atomically each); their paths."""
    return [write_text(out, exported.text, "the export"),
            *(write_text(p, text, "the export") for p, text in exported.extra.items())]
