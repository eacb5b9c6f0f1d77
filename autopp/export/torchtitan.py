"""torchtitan 0.3: `--section.key=value` overrides for its ConfigManager (one per line), plus the schedule CSV."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from ..data.axes import AXES
from ..data.layout import MESH_AXES
from ..data.plan import Plan
from ..data.trainers import trainer_rules
from ..data.zero import ZeroStage
from ..schedule import StagePlacement, ScheduleName, describe
from .common import (Exported, axis_notes, carved_lines, group_lines, launch_grid, loss_parallel_notes, made_for,
                     refuse_layout, optimizer_note, refuse_schedule, stage_placement, trainer_axes, uniform_policy)
from .layers import ExportError
from .overlap import ep_a2a_note, torchtitan_overlap
from .torchcsv import csv_text

__all__ = ["to_torchtitan", "stage_fqns", "data_parallel", "group_parallel", "trainer_names", "check_renames",
           "rename_modules"]


def _renamed(name: str, renames: Sequence[tuple[str, str]]) -> str | None:
    """`name` with the first matching `old` prefix (a whole dotted component path) replaced by `new` ("" drops it);
    None when no `old` matches."""
    for old, new in renames:
        if name == old or name.startswith(old + "."):
            return new + name[len(old):] if new else ""
    return None


def check_renames(unit_modules: Sequence[Sequence[str]], renames: Sequence[tuple[str, str]]) -> None:
    """ExportError naming the first `old` that matches no module name (it would be ignored without a word)."""
    names = [m for mods in unit_modules for m in mods]
    for old, new in renames:
        if not any(_renamed(m, [(old, new)]) is not None for m in names):
            ends = f"{names[0]!r} ... {names[-1]!r}" if names else "none"
            raise ExportError(f"--rename {old}={new}: OLD {old!r} matches no profiled module (their names: {ends}); "
                              "OLD is a profiled name or a prefix of whole dotted parts of one")


def rename_modules(unit_modules: Sequence[Sequence[str]], renames: Sequence[tuple[str, str]]
                   ) -> list[list[str]]:
    """Module names with each `old` prefix (a whole dotted component path) replaced by `new`; an empty `new`
    drops the module (e.g. a parameter-free rotary table the trainer's model does not have). ExportError when an
    `old` matches no module (`check_renames`)."""
    check_renames(unit_modules, renames)
    out = []
    for mods in unit_modules:
        names = [m if r is None else r for m, r in ((m, _renamed(m, renames)) for m in mods)]
        out.append([m for m in names if m])
    return out


def trainer_names(unit_modules: Sequence[Sequence[str]], renames: Sequence[tuple[str, str]] = ()
                  ) -> tuple[list[list[str]], bool]:
    """The units' module names for torchtitan, and whether its mapping applied: each name `renames` matches
    (`rename_modules`) as renamed, the others as torchtitan's shipped decoders name them (`Trainer.module_names`: HF
    Llama / Qwen names -> `tok_embeddings`, `layers.N`, `norm`, `output`) when every one of them is one of the
    mapped prefixes; otherwise (another model) as renamed or given. The user's renames thus apply on top of the
    mapping (`--rename model.layers.3=blocks.3` keeps `tok_embeddings`, `layers.0`, ...)."""
    given = rename_modules(unit_modules, renames)
    table = trainer_rules("torchtitan").module_names
    out: list[list[str]] = []
    for mods in unit_modules:
        names = []
        for m in mods:
            name = _renamed(m, renames)
            if name is None:
                name = _renamed(m, table)
            if name is None:
                return given, False
            if name:
                names.append(name)
        out.append(names)
    return out, True


def stage_fqns(plan: Plan, unit_modules: Sequence[Sequence[str]], where: str) -> list[list[str]]:
    """`module_fqns_per_model_part`: per stage, the module names of its units. torchtitan's splitter keeps top-level
    children and entries of top-level ModuleLists (by index) and ModuleDicts (by key) only (`_split_module`), so
    names nested deeper than `container.entry` are refused."""
    out = [[m for u in range(*s.units) for m in unit_modules[u]] for s in plan.stages]
    deep = [m for stage in out for m in stage if m.count(".") > 1]
    if deep:
        raise ExportError(f"{where}: torchtitan keeps only top-level modules and entries of top-level lists, but the "
                          f"units hold {deep[0]!r}; rename the profiled modules to the trainer's with --rename "
                          f"OLD=NEW (e.g. --rename model.layers=layers)")
    return out


def _ends(fqns: Sequence[Sequence[str]]) -> list[str]:
    """The first and the last module name of all stages (for a note)."""
    names = [m for stage in fqns for m in stage]
    return names[:1] + names[-1:]


def _names_note(fqns: Sequence[Sequence[str]], mapped: bool) -> str:
    """How the module names were written: mapped to torchtitan's decoders, or as given."""
    ends = ", ..., ".join(_ends(fqns))
    if mapped:
        return (f"module names: the HF decoder's mapped to torchtitan's llama3 / qwen3 names ({ends}; "
                "model.rotary_emb dropped, a buffer there); --rename OLD=NEW renames profiled names on top of it")
    return (f"module names are written as given ({ends}): they must be the names of the model torchtitan builds, "
            "whose splitter (_split_module) drops names it lacks without a word; rename with --rename OLD=NEW")


def _schedule(plan: Plan, where: str) -> tuple[str, bool]:
    """torchtitan's `pipeline_parallel_schedule` (torch's name; it also decides the stage placement) and whether the
    order goes through the CSV (synthesized orders)."""
    if not describe(plan.schedule).given_order:
        return plan.schedule.value, False
    placement = stage_placement(plan)
    if placement is StagePlacement.V:
        return ScheduleName.ZBV_ZERO_BUBBLE.value, True
    if placement is StagePlacement.LOOP:
        return (ScheduleName.INTERLEAVED_1F1B if plan.layout.v > 1 else ScheduleName.ONE_F_ONE_B).value, True
    raise ExportError(f"{where}: the synthesized order places stages on ranks {[s.rank for s in plan.stages]}, "
                      "which is neither torchtitan's loop nor its V placement")


#: How the dp replicas run, per ZeRO stage (for the launch note).
def _dp_as(zero: ZeroStage, replicate: int = 1) -> str:
    """How torchtitan runs the data parallelism of ZeRO stage `zero` (HSDP's `replicate` groups), for the launch
    note."""
    if zero.replicated:
        return "DDP replicas"
    how = "resharded after each forward" if zero.fsdp_reshard_after_forward else "kept whole through the step"
    return f"FSDP shards {how} ({zero})" + (f", HSDP: replicated {replicate} times" if replicate > 1 else "")


def data_parallel(plan: Plan) -> list[str]:
    """dp as torchtitan runs it: ZeRO 0 as replicas (`data_parallel_replicate_degree`, shard degree 1); ZeRO 1 and
    3 as FSDP over dp (`data_parallel_shard_degree`; with HSDP, `Layout.dp_replicate`, over dp / dp_replicate, the
    rest `data_parallel_replicate_degree`), parameters kept whole from the forward through the backward
    (`fsdp_reshard_after_forward=never`, torchtitan's default under PP) or resharded after each forward (`always`).
    ZeRO 2 is refused before (`refuse_layout`): torchtitan has no stage that shards gradients but not parameters."""
    zero, dp, r = plan.layout.zero, plan.layout.dp, plan.layout.dp_replicate
    if zero.replicated:
        return [f"--parallelism.data_parallel_replicate_degree={dp}", "--parallelism.data_parallel_shard_degree=1"]
    return [f"--parallelism.data_parallel_replicate_degree={r}", f"--parallelism.data_parallel_shard_degree={dp // r}",
            f"--parallelism.fsdp_reshard_after_forward={'always' if zero.fsdp_reshard_after_forward else 'never'}"]


def group_parallel(plan: Plan) -> list[str]:
    """The degrees of the axes inside a pipeline rank (autopp.data.axes: `tensor_parallel_degree`, with tp > 1
    sequence parallelism as the plan has it: left on, torchtitan's default, or turned off, `SWITCHES`)."""
    return group_lines(plan, "torchtitan", "--{key}={degree}")


def to_torchtitan(plan: Plan, unit_modules: Sequence[Sequence[str]], csv_path: Path, where: str,
                  moe: Mapping[str, Any] | None = None, renames: Sequence[tuple[str, str]] = ()) -> Exported:
    """Overrides for `torchtitan.train --module M --config C`; `csv_path`: where the schedule CSV of a synthesized
    order is written, beside the export, which names it by its file name (a path relative to the export: launch
    torchtitan from the export's directory). HF decoder names are mapped to torchtitan's (`trainer_names`), those
    `renames` matches renamed instead; other names are written as renamed or given. The AC subcommand comes last,
    as tyro requires."""
    name, via_csv = _schedule(plan, where)
    activations = uniform_policy(plan, "torchtitan", where)
    names, mapped = trainer_names(unit_modules, renames)
    fqns = stage_fqns(plan, names, where)
    parts = " ".join(",".join(stage) for stage in fqns)
    # torchtitan's trainer (train.py: gradient_accumulation_steps, the data loader's batch): with pp > 1 the pipeline
    # schedule splits local_batch_size into microbatches; without pp, each forward and backward takes local_batch_size
    # and the microbatches are gradient-accumulation steps (global / (local x dp))
    local = plan.microbatch_size * (plan.num_microbatches if plan.layout.pp > 1 else 1)
    refuse_schedule(plan, "torchtitan", where)
    refuse_layout(plan, "torchtitan", where)
    lines = [f"--{AXES['pp'].spelling('torchtitan').degree}={plan.layout.pp}",
             f"--parallelism.pipeline_parallel_schedule={name}",
             f"--parallelism.pipeline_parallel_microbatch_size={plan.microbatch_size}",
             f"--parallelism.module_fqns_per_model_part {parts}",
             *data_parallel(plan),
             *group_parallel(plan),
             *carved_lines(plan, "torchtitan", "--{key}={degree}", moe or {}, where),
             f"--training.local_batch_size={local}",
             f"--training.global_batch_size={plan.num_microbatches * plan.microbatch_size * plan.layout.dp}"]
    overlap, overlap_notes = torchtitan_overlap(plan)
    settings, setting_notes = made_for(plan, "torchtitan", compiles=bool(overlap))  # async TP compiles the model
    lines += settings + overlap
    if plan.layout.pp > 1:  # Trainer.Config refuses pipeline parallelism with CUDA graphs, which are on by default
        lines.append("--training.disable_cuda_graphs")
    extra = {}
    if via_csv:
        lines.append(f"--parallelism.pipeline_parallel_schedule_csv={csv_path.name}")
        extra[str(csv_path)] = csv_text(plan)
    lines.append(f"activation_checkpoint:{activations.torchtitan}")
    mesh = ", ".join(a.name for a, _ in trainer_axes(plan, "torchtitan") if a.name in MESH_AXES)
    notes = [f"torchtitan: launch {plan.num_ranks} ranks ({launch_grid(plan, 'torchtitan')}, dp as "
             f"{_dp_as(plan.layout.zero, plan.layout.dp_replicate)}; torchtitan's mesh [{mesh}] numbers them as autopp "
             "does)",
             f"overrides of your own go before $(cat FILE): its last line, activation_checkpoint:"
             f"{activations.torchtitan}, is a tyro subcommand, after which torchtitan's parser takes only that "
             "subcommand's options (others: \"Unrecognized options\")",
             *setting_notes, optimizer_note(plan, "torchtitan"), _names_note(fqns, mapped)]
    if via_csv:
        notes.append(f"the schedule CSV is named relative to the export ({csv_path.name}): launch torchtitan from "
                     "the export's directory, or give its path from where you launch")
    notes += axis_notes(plan, "torchtitan") + overlap_notes + ep_a2a_note(plan, "torchtitan") \
        + loss_parallel_notes(plan, "torchtitan")
    if activations.trainer_note:
        notes.append(f"torchtitan's {activations.torchtitan} AC: {activations.trainer_note}")
    return Exported("\n".join(lines) + "\n", extra, tuple(notes))
